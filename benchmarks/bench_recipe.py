"""Recipe ablation: each training option alone, and combinations, at the same budget, served in vLLM.

    .venv/bin/python benchmarks/bench_recipe.py --store /tmp/recipe-demo-store --out /tmp/recipe-bench

On the demo's shards (built into `--store` the first time), every configuration trains our
drafter for `--steps` optimizer steps from the same baseline (the demo's training settings,
with `--steps` in place of its epochs, and `BASELINE`: the recipe before the ablations) with
one option changed, for each of `--seeds`,
and all of them are served by one vLLM script on the demo's held-out prompts (greedy,
k=3 and k=7; outputs checked equal to plain greedy). It prints mean acceptance length per
configuration (mean over seeds, and each seed), its ratio to the baseline, and CPU
seconds per step (process time, 1 thread), and writes `<out>/report.json`.
`--configs a,b` picks configurations by name (`--list` shows them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_runs import KS, demo_store, log, serve, train  # noqa: E402

from eagle3_assets.settings import demo_settings  # noqa: E402

# The recipe before the ablations; every configuration is it with its options changed.
BASELINE = {"norm_before_fc": False, "norm_output": False, "norm_before_residual": False, "batch_order": "by_length"}
NORMS = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}
# One option changed from the baseline per configuration, then combinations of them.
CONFIGS: dict[str, dict] = {
    "baseline": {},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
    "frozen_lm_head": {"train_lm_head": False},
    "input_positions": {"loss_positions": "input"},
    "kl": {"loss": "kl"},
    "lk": {"loss": "lk"},
    "fc+output": {"norm_before_fc": True, "norm_output": True},
    "random_batches": {"batch_order": "random"},
    "packed_batches": {"batch_order": "packed"},
    "norms": NORMS,
    "norms+random_batches": NORMS | {"batch_order": "random"},
    "defaults": NORMS | {"batch_order": "packed"},
    "speculators_recipe": {
        "norm_before_fc": True, "norm_output": True, "norm_before_residual": True, "train_lm_head": False,
        "loss_positions": "input", "loss": "kl", "grad_clip": 1.0,
    },
}  # fmt: skip
ARCHITECTURE = ("norm_before_fc", "norm_output", "norm_before_residual")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/recipe-demo-store"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/recipe-bench"))
    ap.add_argument("--steps", type=int, default=155)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    ap.add_argument("--extra", default="", help="one more configuration as JSON: {name: {option: value}}")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    configs = dict(CONFIGS) | (json.loads(args.extra) if args.extra else {})
    if args.list:
        print(json.dumps(configs, indent=1))
        return 0
    started = time.perf_counter()
    out = args.out.resolve()
    project = demo_store(args.store)
    base = project.settings.training.model_copy(update={"steps": args.steps, "device": "cpu"})
    names = args.configs.split(",") + list(json.loads(args.extra)) if args.extra else args.configs.split(",")
    trained = {}
    for name in names:
        options = BASELINE | configs[name]
        if any(options.get(f) for f in ARCHITECTURE):
            options["serve_with"] = ["vllm"]  # SGLang cannot serve these norm placements
        for seed in args.seeds:
            settings = base.model_validate(base.model_dump() | options | {"seed": seed})
            trained[f"{name}/s{seed}"] = train(project, settings, f"{name}-s{seed}", out)
    served = serve(project.target(), project, {k: t.export_dir for k, t in trained.items()}, demo_settings().generation.max_new_tokens)

    rows = {}
    for name in names:
        runs = [f"{name}/s{seed}" for seed in args.seeds]
        rows[name] = {
            **{f"k{k}": statistics.fmean(served[r][f"k{k}"]["mean_acceptance_length"] for r in runs) for k in KS},
            **{f"k{k}_seeds": [served[r][f"k{k}"]["mean_acceptance_length"] for r in runs] for k in KS},
            "cpu_s_per_step": statistics.fmean(trained[r].cpu_s_per_step for r in runs),
            "heldout_acc_0": statistics.fmean(trained[r].heldout.get("acc_0", 0.0) for r in runs),
            "greedy_equal": all(served[r][f"k{k}"]["outputs_match_greedy"] for r in runs for k in KS),
            "options": configs[name],
        }
    base_row = rows.get("baseline")
    print(f"\n{'configuration':<22}{'k=3':>8}{'k=7':>8}{'÷base k3':>10}{'÷base k7':>10}{'CPU s/step':>12}{'acc_0':>8}  seeds k3 / k7")
    for name, r in rows.items():
        ratio = [r[f"k{k}"] / base_row[f"k{k}"] if base_row else float("nan") for k in KS]
        seeds = " ".join(f"{a:.3f}" for a in r["k3_seeds"]) + " / " + " ".join(f"{a:.3f}" for a in r["k7_seeds"])
        print(
            f"{name:<22}{r['k3']:>8.3f}{r['k7']:>8.3f}{ratio[0]:>10.3f}{ratio[1]:>10.3f}{r['cpu_s_per_step']:>12.3f}"
            f"{r['heldout_acc_0']:>8.3f}  {seeds}{'' if r['greedy_equal'] else '  OUTPUT DIFFERS FROM GREEDY'}"
        )
    report = {
        "steps": args.steps, "seeds": args.seeds, "rows": rows,
        "runs": {k: t.as_json() for k, t in trained.items()}, "served": served,
        "minutes": (time.perf_counter() - started) / 60,
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"report: {out / 'report.json'} ({report['minutes']:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
