"""FP8 hidden-state storage against bfloat16 on the demo: bytes per token, and served acceptance.

    .venv/bin/python benchmarks/bench_fp8.py --store /tmp/recipe-demo-store --out /tmp/fp8-bench

The bfloat16 store is the demo's (built into `--store` the first time, as `make demo` builds
it). The float8_e4m3fn store beside it shares its data assets (linked) and gets its own
shards, extracted from the same tokenized rows by the same backend through the shard code the
`hidden_states` asset runs. It reports stored bytes per token of each (every sample file,
its token ids, mask and metadata included) and their ratio; then it trains our drafter on each
store for `--steps` steps and `--seeds`, with the demo's training settings, and serves all of
them in one vLLM script on the held-out prompts: mean acceptance length at k=3 and k=7 of the
FP8-trained drafters over the bf16-trained ones. Writes `<out>/report.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_runs import KS, demo_store, log, serve, shard_keys, train  # noqa: E402

from eagle3_assets.hidden_states import open_extractor  # noqa: E402
from eagle3_assets.hidden_states.shard import completed_shard, plan_shard, run_shard  # noqa: E402
from eagle3_assets.project import Project  # noqa: E402
from eagle3_assets.sample_file import SampleSpec, shard_dir  # noqa: E402
from eagle3_assets.shards import Shard  # noqa: E402
from eagle3_assets.storage import ArtifactStore  # noqa: E402
from eagle3_assets.tokenized import TokenizedSet  # noqa: E402

FP8 = "float8_e4m3fn"


def fp8_store(project: Project, dest: Path) -> Project:
    """The project's data assets (linked) with shards of its own in float8_e4m3fn."""
    src = project.store.local_path("")
    dest.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("hidden_states", "drafter", "drafter_eval") and not (dest / name).exists():
            (dest / name).symlink_to(src / name)
    settings = project.settings.model_copy(
        update={"extraction": project.settings.extraction.model_copy(update={"storage_dtype": FP8})}
    )
    fp8 = Project(settings, ArtifactStore(str(dest)))
    target, tset = fp8.target(), TokenizedSet.load(fp8.store)
    spec = SampleSpec(target.hidden_size, target.aux_layer_ids, FP8, fp8.model_name)
    extractor = open_extractor(settings, target)
    try:
        for key in shard_keys(project.store):
            plan = plan_shard(fp8.store, tset, Shard.parse(key), spec, settings.extraction, max_context=1 << 30)
            if completed_shard(fp8.store, tset, plan) is None:
                result = run_shard(fp8.store, tset, plan, extractor, settings.extraction)
                log(f"{FP8} shard {key}: {result.rows_computed} rows in {result.seconds:.0f} s")
    finally:
        extractor.close()
    return fp8


def bytes_per_token(project: Project) -> float:
    store, root = project.store, project.store.local_path("")
    total = 0
    for key in shard_keys(store):
        folder = root / shard_dir(key)
        total += sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return total / TokenizedSet.load(store).num_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/recipe-demo-store"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/fp8-bench"))
    ap.add_argument("--steps", type=int, default=155)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    out = args.out.resolve()
    torch.set_num_threads(1)  # like the training runs: one core per process
    bf16 = demo_store(args.store)
    fp8 = fp8_store(bf16, out / "fp8-store")
    sizes = {"bfloat16": bytes_per_token(bf16), FP8: bytes_per_token(fp8)}
    log(f"bytes per token: bf16 {sizes['bfloat16']:.1f}, fp8 {sizes[FP8]:.1f}, ratio {sizes[FP8] / sizes['bfloat16']:.4f}")

    trained = {}
    for dtype, project in (("bfloat16", bf16), (FP8, fp8)):
        base = project.settings.training.model_copy(update={"steps": args.steps, "device": "cpu"})
        for seed in args.seeds:
            settings = base.model_copy(update={"seed": seed})
            trained[f"{dtype}/s{seed}"] = train(project, settings, f"{dtype}-s{seed}", out / "runs")
    served = serve(bf16.target(), bf16, {k: t.export_dir for k, t in trained.items()}, bf16.settings.generation.max_new_tokens)

    def mean_al(dtype: str, k: int) -> float:
        return statistics.fmean(served[f"{dtype}/s{s}"][f"k{k}"]["mean_acceptance_length"] for s in args.seeds)

    acceptance = {d: {f"k{k}": mean_al(d, k) for k in KS} for d in ("bfloat16", FP8)}
    report = {
        "bytes_per_token": sizes,
        "bytes_ratio": sizes[FP8] / sizes["bfloat16"],
        "acceptance": acceptance,
        "acceptance_ratio": {f"k{k}": acceptance[FP8][f"k{k}"] / acceptance["bfloat16"][f"k{k}"] for k in KS},
        "outputs_match_greedy": all(v[f"k{k}"]["outputs_match_greedy"] for v in served.values() for k in KS),
        "runs": {k: t.as_json() | {"served": served[k]} for k, t in trained.items()},
        "steps": args.steps,
        "seeds": args.seeds,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    for d in ("bfloat16", FP8):
        print(f"{d:14s} {sizes[d]:8.1f} B/token  k3 {acceptance[d]['k3']:.3f}  k7 {acceptance[d]['k7']:.3f}")
    print(f"FP8 / bf16: bytes {report['bytes_ratio']:.4f}, acceptance " + ", ".join(
        f"{k} {v:.3f}" for k, v in report["acceptance_ratio"].items()))  # fmt: skip
    return 0 if report["outputs_match_greedy"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
