"""Data-parallel drafter training on the CPU: tokens/s of N gloo ranks over 1 rank, the same global batch.

    .venv/bin/python benchmarks/bench_data_parallel.py [--ranks 2] [--threads 2] [--steps 12] [--batch-tokens 4096]

The demo-shaped drafter (`bench_training.DEMO`: H 128, draft vocab 512, 7 TTT steps) on demo-like
shards (`bench_training.write_demo_shards`), trained by `train_drafter` under torchrun as the
`drafter` asset launches it: first 1 rank with all `--threads`, then `--ranks` ranks sharing them
(threads / ranks each), each run with the same `batch_tokens` per optimizer step over all ranks.
tokens/s counts every rank's tokens over the median step time after `--warmup` steps.
On a CPU the ranks share the cores one rank already uses, so this measures what the split
costs (the gradient all-reduce, smaller matmuls) or gains (processes in place of threads), not
more hardware; the GPU figure is the data-parallel case of `gpu_check.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_training import DEMO, write_demo_shards  # noqa: E402
from eagle3_assets.sample_file import manifest_path  # noqa: E402
from eagle3_assets.settings import DemoSettings, TrainingSettings  # noqa: E402
from eagle3_assets.storage import ArtifactStore  # noqa: E402


def prepare(work: Path, rows: int) -> dict:
    """A demo-shaped target, its shards and a vocab map of the first draft_vocab_size ids."""
    from eagle3_assets.demo.target import build_demo_target

    target = work / "target"
    build_demo_target(target, DemoSettings(hidden_size=DEMO.hidden_size, vocab_size=DEMO.vocab_size, train_steps=0), log=print)
    store = ArtifactStore(work / "store")
    keys = write_demo_shards(store, rows, shard_size=rows // 2)
    for key in keys:
        store.write_json(manifest_path(key), {"shard": key})  # the loader only asks that the shard is complete
    return {"store": str(work / "store"), "target": str(target), "keys": keys}


def worker(args_file: Path) -> int:
    """One torchrun rank: train, and rank 0 writes its per-step figures."""
    import torch

    from eagle3_assets.drafter.train import train_drafter
    from eagle3_assets.target import TargetModel
    from eagle3_assets.vocab_map import VocabMap

    a = json.loads(args_file.read_text())
    torch.set_num_threads(a["threads"])
    d = DEMO.draft_vocab_size
    vmap = VocabMap(np.zeros(d, dtype=np.int64), np.arange(DEMO.vocab_size) < d)
    steps: list[tuple[int, float, float]] = []
    train_drafter(
        ArtifactStore(a["store"]), a["keys"], vmap=vmap, target=TargetModel.read(a["target"], aux_layer_ids=[1, 2, 3]),
        settings=TrainingSettings(**a["settings"]), log=lambda _: None, data_workers=1, resume=False,
        on_metrics=lambda step, m: steps.append((step, m["seconds"], m["tokens"])),
    )  # fmt: skip
    if os.environ.get("RANK", "0") == "0":
        Path(a["out"]).write_text(json.dumps(steps))
    return 0


def run(prepared: dict, work: Path, ranks: int, threads: int, settings: TrainingSettings, warmup: int) -> dict:
    out = work / f"ranks_{ranks}.json"
    args = {**prepared, "threads": max(1, threads // ranks), "settings": settings.model_dump(), "out": str(out)}
    (work / f"args_{ranks}.json").write_text(json.dumps(args))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
        "--worker", str(work / f"args_{ranks}.json"),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args["threads"])})
    timed = json.loads(out.read_text())[warmup:]
    step_s = statistics.median(s for _, s, _ in timed)
    tokens = statistics.median(t for _, _, t in timed)
    return {"ranks": ranks, "threads_per_rank": args["threads"], "step_s": step_s, "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the whole job")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    settings = TrainingSettings(
        steps=args.steps, batch_tokens=args.batch_tokens, warmup_steps=2, heldout_rows=0, checkpoint_every=10**6,
        device="cpu",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        work = Path(tmp)
        prepared = prepare(work, args.rows)
        one = run(prepared, work, 1, args.threads, settings, args.warmup)
        many = run(prepared, work, args.ranks, args.threads, settings, args.warmup)
    report = {"one": one, "many": many, "ratio": many["tokens_per_s"] / one["tokens_per_s"], "settings": vars(args)}
    print(json.dumps(report, indent=1, default=str))
    print(
        f"\n{args.ranks} ranks / 1 rank, {args.batch_tokens} tokens per step, {args.threads} threads in all: "
        f"{many['tokens_per_s']:.0f} / {one['tokens_per_s']:.0f} tokens/s = {report['ratio']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
