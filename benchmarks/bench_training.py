"""Drafter training throughput (P5): can the loader keep the training step fed, and how fast is a step.

    .venv/bin/python benchmarks/bench_training.py [--threads 2] [--kimi-intermediate 18432] [--skip-kimi]

1. Loader: demo-like shards (H 128, bf16, ~200-token rows) read through `BatchLoader`
   (memory-mapped files, worker threads), in samples/s.
2. Training step: the demo-sized drafter (H 128, 4 heads of 32, MLP 512, vocab 1024,
   draft vocab 512, 7 TTT steps, 4,096-token batches) on the same batches: samples/s
   and tokens/s it consumes. P5 is (1) / (2), goal >= 5. Each row's first quarter is
   its prompt (no loss), as in chat rows; the same steps are timed again computing every
   TTT step at every index (`skip_unscored=False`), alternating step by step, and the
   ratio is the CPU the skipped indices save.
3. One Kimi-shaped layer (H 7168, 64 heads of 112, MLP 18,432, draft vocab 32,000,
   7 TTT steps): one forward+backward on a short sequence, tokens/s. The frozen
   embedding is given a 32,000-row vocabulary instead of 163,840 (lookup cost does not
   depend on it; it saves 3.7 GB); no optimizer step (AdamW state would add 9 GB).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_assets.drafter.data import BatchLoader, index_samples
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter, count_parameters
from eagle3_assets.drafter.target_head import Targets
from eagle3_assets.drafter.ttt import ttt_forward
from eagle3_assets.sample_file import SampleSpec, encode_sample, manifest_path, sample_path
from eagle3_assets.storage import ArtifactStore

DEMO = DrafterConfig(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=512,
    vocab_size=1024, draft_vocab_size=512, rms_norm_eps=1e-6,
)


def write_demo_shards(store: ArtifactStore, rows: int, shard_size: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    spec = SampleSpec(DEMO.hidden_size, (1, 2, 3), "bfloat16", "bench", "post_norm")
    keys = []
    for start in range(0, rows, shard_size):
        key = f"rows_{start}-{min(start + shard_size, rows)}"
        for row in range(start, min(start + shard_size, rows)):
            T = int(rng.integers(120, 300))
            data = encode_sample(
                row=row,
                input_ids=torch.randint(0, DEMO.vocab_size, (T,), generator=g, dtype=torch.int32).numpy(),
                loss_mask=(np.arange(T) >= T // 4).astype(np.uint8),  # a prompt, then the answer
                aux_hidden_states=torch.randn(T, 3 * DEMO.hidden_size, generator=g),
                last_hidden_state=torch.randn(T, DEMO.hidden_size, generator=g),
                spec=spec,
                backend="hf",
            )
            store.write_bytes(sample_path(key, row), data)
        store.write_json(manifest_path(key), {"rows": shard_size})
        keys.append(key)
    return keys


def random_targets(B: int, T: int, cfg: DrafterConfig, model: Eagle3Drafter, g: torch.Generator) -> Targets:
    draft_ids = torch.randint(0, cfg.draft_vocab_size, (B, T), generator=g)
    argmax = draft_ids + model.d2t[draft_ids]
    probs = torch.softmax(torch.randn(B, T, cfg.draft_vocab_size, generator=g), -1)
    return Targets(probs, argmax, model.t2d[argmax])


def make_drafter(cfg: DrafterConfig) -> Eagle3Drafter:
    used = torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    return Eagle3Drafter(cfg, torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), t2d)


def make_trainer() -> tuple[Eagle3Drafter, torch.optim.Optimizer]:
    model = make_drafter(DEMO)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def bench_loader_and_demo_step(tmp: Path, batch_tokens: int, steps: int) -> dict[str, float]:
    store = ArtifactStore(tmp / "store")
    keys = write_demo_shards(store, rows=400, shard_size=200)
    samples, _ = index_samples(store, keys)
    loader = BatchLoader(store, samples, batch_tokens=batch_tokens, seed=0)

    t0 = time.perf_counter()
    n_samples = n_tokens = 0
    batches = []
    for pos, batch in loader.iterate():
        if pos.epoch > 0:
            break
        n_samples += len(batch.samples)
        n_tokens += batch.num_tokens
        batches.append(batch)
    load_s = time.perf_counter() - t0

    step_s = {True: 0.0, False: 0.0}
    trainers = {skip: make_trainer() for skip in step_s}
    g = torch.Generator().manual_seed(0)
    targets = [random_targets(*b.input_ids.shape, DEMO, trainers[True][0], g) for b in batches[: steps + 1]]
    step_samples = step_tokens = 0
    for i, (b, tg) in enumerate(zip(batches, targets)):
        for skip, (model, opt) in trainers.items():
            t = time.process_time()
            out = ttt_forward(
                model, b.input_ids, b.aux, b.loss_mask, b.lengths, tg, num_steps=7, step_weight=0.8, skip_unscored=skip
            )
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            if i > 0:  # the first step warms allocators up
                step_s[skip] += time.process_time() - t
        if i > 0:
            step_samples += len(b.samples)
            step_tokens += b.num_tokens
    train_sps = step_samples / step_s[True]
    loader_sps = n_samples / load_s
    return {
        "loader_samples_per_s": loader_sps,
        "loader_tokens_per_s": n_tokens / load_s,
        "demo_train_samples_per_s": train_sps,
        "demo_train_tokens_per_s": step_tokens / step_s[True],
        "demo_step_cpu_s": step_s[True] / max(1, min(steps, len(batches) - 1)),
        "demo_step_every_index_over_skipping": step_s[False] / step_s[True],
        "P5_loader_over_training": loader_sps / train_sps,
        "demo_trainable_params": float(count_parameters(trainers[True][0])),
    }


def bench_kimi_layer(seq_len: int, intermediate: int) -> dict[str, float]:
    cfg = DrafterConfig(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=112,
        intermediate_size=intermediate, vocab_size=32000, draft_vocab_size=32000, rms_norm_eps=1e-6,
    )
    model = make_drafter(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=g)
    aux = torch.randn(1, seq_len, 3 * cfg.hidden_size, generator=g)
    targets = random_targets(1, seq_len, cfg, model, g)
    lengths, mask = torch.tensor([seq_len]), torch.ones(1, seq_len, dtype=torch.uint8)
    t = time.perf_counter()
    out = ttt_forward(model, ids, aux, mask, lengths, targets, num_steps=7, step_weight=0.8)
    fwd = time.perf_counter() - t
    out.loss.backward()
    total = time.perf_counter() - t
    return {
        "kimi_trainable_params": float(count_parameters(model)),
        "kimi_intermediate_size": float(intermediate),
        "kimi_seq_len": float(seq_len),
        "kimi_forward_s": fwd,
        "kimi_step_s": total,
        "kimi_tokens_per_s": seq_len / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads; on a busy 2-core machine 2 threads ran 6x slower than 1"
    )
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kimi-seq-len", type=int, default=64)
    ap.add_argument("--kimi-intermediate", type=int, default=18432)
    ap.add_argument("--skip-kimi", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        results = bench_loader_and_demo_step(Path(tmp), args.batch_tokens, args.steps)
    if not args.skip_kimi:
        results.update(bench_kimi_layer(args.kimi_seq_len, args.kimi_intermediate))
    for k, v in results.items():
        print(f"{k:32s} {v:,.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
