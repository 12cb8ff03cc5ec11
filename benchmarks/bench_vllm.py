"""vLLM extraction: model loads for an N-shard backfill, and throughput against HF on the same rows.

P4 (loads): model loads for an N-shard backfill through one long-lived server (each shard opened,
    extracted and closed as its own Dagster run would): counted from the server's log
    (vLLM logs "Starting to load model" once per load on one device) and from the
    number of server processes started. Without `vllm.server_url` each run would start
    its own server: N loads.
P4 (throughput): extraction samples/s through `extract_shard` with the vLLM backend (requests in
    flight up to `max_concurrency`) / samples/s with the HF backend, same target, same
    rows, same run, each end to end (files validated and written); interleaved repeats, best
    of each, because the machine is shared.

The target is demo-like (4 layers, hidden 128, head_dim 32, vocab 1024, random weights,
a BPE tokenizer trained here); rows are random token ids of 50-400 tokens.

Run: .venv/bin/python benchmarks/bench_vllm.py [--shards 3] [--rows-per-shard 40] [--threads 1] [--repeat 3] [--eager]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_assets.demo.tokenizer import train_tokenizer
from eagle3_assets.hidden_states import check_shards, extract_shard, open_extractor
from eagle3_assets.settings import ExtractionSettings, Settings, VllmSettings
from eagle3_assets.shards import plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vllm_server import MODEL_LOAD_MARKER, SERVER_LOG_FILE, VllmServer, free_port

AUX = [1, 2, 3]
HIDDEN, LAYERS, VOCAB, CONTEXT = 128, 4, 1024, 2048


def build_target(path: Path) -> int:
    """A demo-shaped target with random weights; returns the tokenizer's size (rows stay below it)."""
    words = [f"entity{i} eats plum{i % 7} near tower{i % 13} and counts {i}" for i in range(4000)]
    tok = train_tokenizer(words, VOCAB)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // 32, num_key_value_heads=HIDDEN // 32, head_dim=32,
        max_position_embeddings=CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return len(tok)


def make_rows(n: int, vocab: int, lo: int = 50, hi: int = 400) -> TokenizedSet:
    rng = np.random.default_rng(0)
    rows = []
    for length in rng.integers(lo, hi + 1, size=n):
        ids = rng.integers(7, vocab, size=int(length)).tolist()
        rows.append((ids, [0] * (len(ids) // 4) + [1] * (len(ids) - len(ids) // 4)))
    return TokenizedSet.from_rows(rows, list(range(n)))


def backfill(settings: Settings, target: Path, tok: TokenizedSet, shard_size: int, store: ArtifactStore) -> float:
    """Every shard as its own run: open the backend, extract, close. Returns seconds spent extracting."""
    seconds = 0.0
    for shard in plan_shards(tok.num_rows, shard_size):
        extractor = open_extractor(settings, target, device="cpu")
        try:
            t0 = time.perf_counter()
            result = extract_shard(store, tok, shard, extractor, settings.extraction, model_name="bench")
            seconds += time.perf_counter() - t0
        finally:
            extractor.close()
        assert result.rows_computed == len(shard)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--rows-per-shard", type=int, default=40)
    # 1 by default: on this shared 2-core box, 2 HF threads collapsed to ~5 samples/s whenever other
    # processes were busy (OpenMP spin-waits on oversubscribed cores), 1 thread held ~79.
    parser.add_argument("--threads", type=int, default=1, help="torch threads for HF")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="vLLM dtype; HF computes in float32 on CPU")
    parser.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (starts faster, may run slower)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    server = None
    try:
        vocab = build_target(work / "target")
        tok = make_rows(args.shards * args.rows_per_shard, vocab)
        shards = plan_shards(tok.num_rows, args.rows_per_shard)
        extraction = ExtractionSettings(batch_tokens=1, progress_interval_s=3600)  # the demo's CPU setting
        hf_settings = Settings(aux_layer_ids=AUX, extraction=extraction)

        vllm = VllmSettings(
            port=free_port(), dtype=args.dtype, max_model_len=CONTEXT, max_concurrency=args.concurrency,
            gpu_memory_utilization=0.3, extra_args=["--enforce-eager"] if args.eager else [],
        )  # fmt: skip
        t0 = time.perf_counter()
        server = VllmServer.start(work / "target", vllm, "extract", aux_layer_ids=AUX, workdir=work / "server")
        startup_s = time.perf_counter() - t0
        vllm_settings = Settings(
            aux_layer_ids=AUX,
            extraction=extraction.model_copy(update={"backend": "vllm"}),
            vllm=vllm.model_copy(update={"server_url": server.url}),
        )
        # Interleaved repeats, best of each: the least-disturbed run on a shared machine.
        hf_times, vllm_times = [], []
        for _ in range(args.repeat):
            hf_store = ArtifactStore(work / "hf")
            hf_times.append(backfill(hf_settings, work / "target", tok, args.rows_per_shard, hf_store))
            store = ArtifactStore(work / "vllm")
            vllm_times.append(backfill(vllm_settings, work / "target", tok, args.rows_per_shard, store))
            reports = check_shards(store, tok, shards, hidden_size=HIDDEN, aux_layer_ids=AUX, dtype="bfloat16")
            assert all(r.ok for r in reports), [r.summary() for r in reports if not r.ok]
            shutil.rmtree(work / "hf")
            shutil.rmtree(work / "vllm")
        hf_s, vllm_s = min(hf_times), min(vllm_times)
        log = (work / "server" / SERVER_LOG_FILE).read_text(errors="replace")
        starts = sum(1 for line in log.splitlines() if line.startswith("$ "))
        loads = log.count(MODEL_LOAD_MARKER)

        rows = tok.num_rows
        print(
            f"target hidden={HIDDEN} layers={LAYERS} vocab={VOCAB}; rows={rows} tokens={tok.num_tokens:,} "
            f"in {len(shards)} shards; vllm dtype={args.dtype} eager={args.eager} concurrency={args.concurrency}; "
            f"HF threads={args.threads}; best of {args.repeat}, interleaved"
        )
        print(
            f"P4 loads: model loads for {args.repeat} backfills of {len(shards)} shards "
            f"({args.repeat * len(shards)} shard runs) through one long-lived server: {loads} "
            f"(server processes started: {starts}; ready in {startup_s:.1f} s)"
        )
        print(
            f"P4 throughput: extraction vLLM {rows / vllm_s:.2f} samples/s ({vllm_s:.2f} s) / "
            f"HF {rows / hf_s:.2f} samples/s ({hf_s:.2f} s) = {hf_s / vllm_s:.3f}"
        )
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
