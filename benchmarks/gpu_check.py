"""The prepared GPU check: extraction and drafter training throughput on one GPU, in one go.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json      # on the GPU machine, < 8 min on one H200
    python benchmarks/gpu_check.py --dry-run                       # every path at toy sizes, on CPU (make test)

Plain modules of the project only (no Dagster, no vLLM). BENCHMARKS.md has the exact command
for the lent machine, and what travels with the working tree (`benchmarks/gpu_check_deps.sh`
unpacks the wheels the machine lacks into `.gpu_deps/site`, which this script puts on the path).

1. Extraction: an 8B-shaped Llama (32 layers, H 4096, GQA 32/8, vocab 128,256) built in place
   with random bf16 weights, through the project's HF backend and `extract_shard`: 256 rows of
   1,000-3,000 tokens batched by the GPU default (`extraction.batch_tokens`), files written to
   local disk. Tokens/s, MFU (2 x params x tokens/s / 989 TFLOP/s dense bf16), bytes/s
   written, and the same forward without writing: the data path's cost as a ratio.
2. Drafter training at the Kimi shape (H 7168, 64 heads, draft vocab 32,000, target vocab
   163,840) and the 8B shape, sequences of 2,048 and 8,192 tokens, 7 TTT steps, the
   trainer's own step (bf16 autocast on CUDA): tokens/s per optimizer step, peak memory,
   MFU (6 x trainable params x tokens x TTT steps, plus the frozen target head's forward).
3. Loader: samples/s reading Kimi-shaped sample files from local disk through the training
   loader, over the samples/s a training step consumes.
4. Data parallel: the Kimi-shaped training step (T=8,192 per rank) under torchrun with one rank
   per visible GPU (DistributedDataParallel over NCCL, as the `drafter` asset launches it): tokens/s
   of all ranks, and the scaling over that many single-GPU steps (1.0 = linear). --dry-run: 2 gloo
   ranks on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Wheels carried to a machine that lacks them (pydantic on the GPU machine): last, so installed packages win.
sys.path.append(str(REPO / ".gpu_deps" / "site"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from eagle3_assets.drafter.data import BatchLoader, index_samples  # noqa: E402
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3_assets.drafter.target_head import TargetHead  # noqa: E402
from eagle3_assets.drafter.train import autocast, objective  # noqa: E402
from eagle3_assets.hidden_states import ExtractionRequest  # noqa: E402
from eagle3_assets.hidden_states.hf_extractor import HFExtractor  # noqa: E402
from eagle3_assets.hidden_states.shard import extract_shard  # noqa: E402
from eagle3_assets.sample_file import SampleSpec, encode_sample, manifest_path, sample_path  # noqa: E402
from eagle3_assets.settings import ExtractionSettings, TrainingSettings  # noqa: E402
from eagle3_assets.shards import Shard  # noqa: E402
from eagle3_assets.storage import ArtifactStore  # noqa: E402
from eagle3_assets.target import TargetModel  # noqa: E402
from eagle3_assets.tokenized import TokenizedSet  # noqa: E402

H200_BF16_FLOPS = 989e12  # dense bf16, no sparsity


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int


LLAMA_8B = Shape("llama-8b", 32, 4096, 32, 8, 14336, 128256, 32000)
KIMI = Shape("kimi", 61, 7168, 64, 64, 18432, 163840, 32000)
TOY = Shape("toy", 4, 64, 2, 1, 128, 256, 64)


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def llama_config(shape: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": shape.layers,
        "hidden_size": shape.hidden, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads, "intermediate_size": shape.intermediate, "vocab_size": shape.vocab,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    }  # fmt: skip


def random_llama(shape: Shape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The shape with random weights, built on the device (no 16 GB of init on the CPU first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**llama_config(shape)))
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    model.model.rotary_emb.inv_freq.copy_(
        1.0 / (500000.0 ** (torch.arange(0, shape.hidden // shape.heads, 2, device=device).float() / (shape.hidden // shape.heads)))
    )
    return model.eval()


def extraction(shape: Shape, rows: int, lengths: tuple[int, int], device: torch.device, workdir: Path) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_llama(shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    target = TargetModel.from_config(
        llama_config(shape), path=workdir / "in-memory", aux_layer_ids=(2, shape.layers // 2, shape.layers - 3)
    )
    settings = ExtractionSettings()  # the GPU default budget and bf16 storage
    extractor = HFExtractor(target, batch_tokens=settings.batch_tokens, device=str(device), model=model)
    rng = np.random.default_rng(0)
    token_rows = [(rng.integers(0, shape.vocab, size=int(n)).tolist(), [1] * int(n))
                  for n in rng.integers(lengths[0], lengths[1] + 1, size=rows)]  # fmt: skip
    tokenized = TokenizedSet.from_rows(token_rows, list(range(rows)))
    tokens = tokenized.num_tokens

    # The forward alone (the HF backend's extract, results left on the floor): the model's speed.
    requests = [ExtractionRequest(r, tokenized.row(r)[0]) for r in range(rows)]
    sync(device)
    t0 = time.perf_counter()
    for _ in extractor.extract(requests):
        pass
    sync(device)
    forward_s = time.perf_counter() - t0

    store = ArtifactStore(workdir / "store")
    t0 = time.perf_counter()
    result = extract_shard(store, tokenized, Shard(0, rows), extractor, settings, model_name=shape.name)
    sync(device)
    shard_s = time.perf_counter() - t0
    extractor.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(workdir / "store", ignore_errors=True)
    return {
        "shape": shape.name, "params": params, "rows": rows, "tokens": tokens,
        "batch_tokens": settings.batch_tokens, "storage_dtype": settings.storage_dtype,
        "forward_tokens_per_s": tokens / forward_s, "extract_shard_tokens_per_s": tokens / shard_s,
        "data_path_ratio": forward_s / shard_s,  # extract_shard speed / forward-only speed
        "mfu_forward": 2 * params * tokens / forward_s / H200_BF16_FLOPS,
        "mfu_extract_shard": 2 * params * tokens / shard_s / H200_BF16_FLOPS,
        "bytes_written": result.bytes_written, "bytes_per_s_written": result.bytes_written / shard_s,
        "bytes_per_token": result.bytes_written / tokens,
    }  # fmt: skip


def drafter_parts(shape: Shape, device: torch.device) -> tuple[Eagle3Drafter, TargetHead]:
    """The drafter and the frozen target head at `shape`, random weights, on the device."""
    target = TargetModel.from_config(llama_config(shape), path="in-memory")
    cfg = DrafterConfig.from_target(target, draft_vocab_size=shape.draft_vocab)
    used = np.sort(np.random.default_rng(0).choice(shape.vocab, size=shape.draft_vocab, replace=False))
    t2d = np.zeros(shape.vocab, dtype=bool)
    t2d[used] = True
    embed = torch.randn(shape.vocab, shape.hidden, dtype=torch.bfloat16) * 0.02
    model = Eagle3Drafter(cfg, used - np.arange(shape.draft_vocab), t2d, embed_tokens=embed).to(device)
    head = TargetHead(torch.ones(shape.hidden), torch.randn(shape.vocab, shape.hidden, dtype=torch.bfloat16) * 0.02, 1e-5)
    return model, head.to(device)


def training(shape: Shape, seq_len: int, device: torch.device, steps: int, warmup: int) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    settings = TrainingSettings(ttt_steps=7, device=device.type)
    model, head = drafter_parts(shape, device)
    # Under torchrun (the data-parallel case) the step is the trainer's: gradients all-reduced by DDP.
    stepped = model
    if dist.is_initialized():
        stepped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95))
    step = objective(settings)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape.vocab, (1, seq_len), generator=g).to(device)
    aux = (torch.randn(1, seq_len, 3 * shape.hidden, generator=g) * 0.5).to(device, torch.bfloat16)
    last = torch.randn(1, seq_len, shape.hidden, generator=g).to(device, torch.bfloat16)
    mask = torch.ones(1, seq_len, dtype=torch.uint8, device=device)
    lengths = torch.tensor([seq_len], device=device)
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        targets = head.targets(last, True, model.t2d)
        with autocast(device):
            out = step(stepped, ids, aux, mask, lengths, targets)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
        opt.step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    # Training FLOPs: fwd+bwd of the drafter at every TTT step, and the target head's forward once.
    flops = 6 * params * seq_len * settings.ttt_steps + 2 * shape.vocab * shape.hidden * seq_len
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, stepped, head, opt
    return {
        "shape": shape.name, "seq_len": seq_len, "ttt_steps": settings.ttt_steps, "trainable_params": params,
        "step_s": step_s, "tokens_per_s": seq_len / step_s, "samples_per_s": 1 / step_s,
        "mfu": flops / step_s / H200_BF16_FLOPS, "peak_memory_gib": peak / 2**30,
    }  # fmt: skip


def loader(shape: Shape, seq_len: int, samples: int, workdir: Path, consumed_per_s: float) -> dict:
    """Samples/s through the training loader from sample files on local disk, over what training consumes."""
    store = ArtifactStore(workdir / "loader-store")
    spec = SampleSpec(shape.hidden, (2, 30, 58), "bfloat16", shape.name, "pre_norm")
    key = Shard(0, samples).key
    aux = torch.randn(seq_len, 3 * shape.hidden).to(torch.bfloat16)
    last = torch.randn(seq_len, shape.hidden).to(torch.bfloat16)
    ids, mask = np.zeros(seq_len, np.int32), np.ones(seq_len, np.uint8)
    for r in range(samples):
        data = encode_sample(row=r, input_ids=ids, loss_mask=mask, aux_hidden_states=aux, last_hidden_state=last,
                             spec=spec, backend="hf")  # fmt: skip
        store.write_bytes(sample_path(key, r), data)
    store.write_json(manifest_path(key), {"rows": samples})
    refs, _ = index_samples(store, [key])
    batches = BatchLoader(store, refs, batch_tokens=seq_len, seed=0)
    t0 = time.perf_counter()
    seen = 0
    for _, batch in batches.iterate():
        seen += len(batch.samples)
        if seen >= samples:
            break
    loader_per_s = seen / (time.perf_counter() - t0)
    shutil.rmtree(workdir / "loader-store", ignore_errors=True)
    return {
        "shape": shape.name, "seq_len": seq_len, "samples": samples, "bytes_per_sample": spec.bytes_per_token * seq_len,
        "loader_samples_per_s": loader_per_s, "training_samples_per_s": consumed_per_s,
        "loader_over_training": loader_per_s / consumed_per_s,
    }  # fmt: skip


SHAPES = {s.name: s for s in (LLAMA_8B, KIMI, TOY)}


def data_parallel(shape: Shape, seq_len: int, ranks: int, steps: int, warmup: int, single: dict, workdir: Path) -> dict:
    """The training step on `ranks` ranks (this script again, under torchrun): tokens/s of all ranks together."""
    out = workdir / "data_parallel.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
        "--dp-worker", f"{shape.name},{seq_len},{steps},{warmup}", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    rank0 = json.loads(out.read_text())
    total = ranks * rank0["tokens_per_s"]
    return {
        "shape": shape.name, "ranks": ranks, "seq_len_per_rank": seq_len, "step_s": rank0["step_s"],
        "tokens_per_s_all_ranks": total, "scaling": total / (ranks * single["tokens_per_s"]),
        "peak_memory_gib": rank0["peak_memory_gib"],
    }  # fmt: skip


def dp_worker(spec: str, out: Path) -> int:
    """One rank of the data-parallel case; rank 0 writes its figures to `out`."""
    name, seq_len, steps, warmup = spec.split(",")
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = training(SHAPES[name], int(seq_len), device, int(steps), int(warmup))
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(result))
    return 0


def print_table(report: dict) -> None:
    print(f"\n{'check':<44}{'figure':>16}")
    for e in report["extraction"]:
        print(f"{'extract ' + e['shape'] + ' tokens/s (shard / forward)':<44}{e['extract_shard_tokens_per_s']:>10.0f} / {e['forward_tokens_per_s']:.0f}")
        print(f"{'  data path ratio, MFU forward':<44}{e['data_path_ratio']:>10.3f}, {e['mfu_forward']:.3f}")
        print(f"{'  bytes/s written':<44}{e['bytes_per_s_written'] / 1e9:>10.2f} GB/s")
    for t in report["training"]:
        label = f"train {t['shape']} T={t['seq_len']} tokens/s, MFU, peak"
        print(f"{label:<44}{t['tokens_per_s']:>10.0f}, {t['mfu']:.3f}, {t['peak_memory_gib']:.1f} GiB")
    for ld in report["loader"]:
        print(f"{'loader ' + ld['shape'] + ' samples/s / training':<44}{ld['loader_samples_per_s']:>10.1f} / {ld['training_samples_per_s']:.2f} = {ld['loader_over_training']:.1f}x")
    for d in report["data_parallel"]:
        label = f"train {d['shape']} x{d['ranks']} ranks tokens/s, scaling"
        print(f"{label:<44}{d['tokens_per_s_all_ranks']:>10.0f}, {d['scaling']:.2f}")
    print(f"\n{report['seconds']:.0f} s on {report['device']}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every path at toy sizes, on the CPU")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "gpu_check.json")
    ap.add_argument("--workdir", type=Path, default=None, help="local disk for the written shards (default: a temp dir)")
    ap.add_argument("--dp-worker", default=None, help=argparse.SUPPRESS)  # shape,seq_len,steps,warmup: one torchrun rank
    args = ap.parse_args(argv)
    if args.dp_worker:
        return dp_worker(args.dp_worker, args.out)
    started = time.perf_counter()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if not args.dry_run and device.type != "cuda":
        log("no CUDA device: run with --dry-run for the toy check")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.workdir))
    if args.dry_run:
        plan = {"extraction": [(TOY, 8, (8, 24))], "training": [(TOY, 32), (TOY, 64)], "steps": (2, 1), "loader": (TOY, 32, 8),
                "data_parallel": (TOY, 64, 2)}  # fmt: skip
    else:
        plan = {
            "extraction": [(LLAMA_8B, 256, (1000, 3000))],
            "training": [(KIMI, 2048), (KIMI, 8192), (LLAMA_8B, 2048), (LLAMA_8B, 8192)],
            "steps": (5, 2),
            "loader": (KIMI, 2048, 16),
            "data_parallel": (KIMI, 8192, torch.cuda.device_count()),
        }
    report: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "dry_run": args.dry_run}  # fmt: skip
    try:
        report["extraction"] = []
        for shape, rows, lengths in plan["extraction"]:
            log(f"extraction: {shape.name}, {rows} rows of {lengths[0]}-{lengths[1]} tokens")
            report["extraction"].append(extraction(shape, rows, lengths, device, workdir))
        report["training"] = []
        steps, warmup = plan["steps"]
        for shape, seq_len in plan["training"]:
            log(f"training: {shape.name}, T={seq_len}, 7 TTT steps")
            report["training"].append(training(shape, seq_len, device, steps, warmup))
        shape, seq_len, samples = plan["loader"]
        consumed = next(t["samples_per_s"] for t in report["training"] if (t["shape"], t["seq_len"]) == (shape.name, seq_len))
        log(f"loader: {samples} {shape.name} samples of {seq_len} tokens from local disk")
        report["loader"] = [loader(shape, seq_len, samples, workdir, consumed)]
        shape, seq_len, ranks = plan["data_parallel"]
        single = next(t for t in report["training"] if (t["shape"], t["seq_len"]) == (shape.name, seq_len))
        log(f"data parallel: {shape.name}, T={seq_len} per rank, {ranks} ranks under torchrun")
        report["data_parallel"] = [data_parallel(shape, seq_len, ranks, steps, warmup, single, workdir)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    log(f"report: {args.out}")
    bad = [k for k, v in _numbers(report) if not math.isfinite(v)]
    return 1 if bad else 0


def _numbers(d: dict | list, prefix: str = ""):
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        if isinstance(v, dict | list):
            yield from _numbers(v, f"{prefix}{k}.")
        elif isinstance(v, float):
            yield f"{prefix}{k}", v


if __name__ == "__main__":
    sys.exit(main())
