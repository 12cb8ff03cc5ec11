"""Recipe ablation: each training option alone, and combinations, at the same budget, served in vLLM.

    .venv/bin/python benchmarks/bench_recipe.py --store /tmp/recipe-demo-store --out /tmp/recipe-bench

On the demo's shards (built into `--store` the first time), every configuration trains our
drafter for `--steps` optimizer steps from the same baseline (the demo's training settings,
with `--steps` in place of its epochs, and `BASELINE`: the recipe before the ablations) with
one option changed, for each of `--seeds`,
and all of them are served by one vLLM script on the demo's held-out prompts (greedy,
k=3 and k=7; outputs checked equal to plain greedy). It prints mean acceptance length per
configuration (mean over seeds, and each seed), its ratio to the baseline, held-out loss and
acc_0 (the training objective on the held-out rows), and CPU seconds per step (process time,
1 thread), and writes `<out>/report.json` (with each run's acc_0 learning curve).
`--configs a,b` picks configurations by name (`--list` shows them).

Any configured run instead (`--config`/`--root`, as `bench_peer_speculators.py` takes them):
the baseline is then that run's training settings, `--base` (JSON) over them. A screen of
the optimizer settings on a real target, held-out figures only, two trainings at a time:

    .venv/bin/python benchmarks/bench_recipe.py --config /tmp/rt/eagle3.yaml --root /tmp/rt/store \
        --out /tmp/rt-screen --steps 40 --seeds 0 --parallel 2 --no-serve --configs '' \
        --extra '{"lr1e-3": {"lr": 0.001, "warmup_steps": 20}, "lr3e-3": {"lr": 0.003, "warmup_steps": 20}}'
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_runs import KS, Trained, log, open_project, serve, train  # noqa: E402

from eagle3_assets.settings import CONFIG_ENV, TrainingSettings  # noqa: E402

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
HELDOUT = ("loss", "acc_0", "acc_3", "acc_6")


def train_all(project, jobs: dict[str, TrainingSettings], out: Path, parallel: int) -> dict[str, Trained]:
    """Every job trained (one torch thread each), `parallel` at a time in spawned processes."""
    if parallel <= 1:
        return {label: train(project, settings, label.replace("/", "-"), out) for label, settings in jobs.items()}
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {label: pool.submit(train, project, settings, label.replace("/", "-"), out) for label, settings in jobs.items()}
        return {label: f.result() for label, f in futures.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, help="a run's settings file (default $EAGLE3_CONFIG; neither: the demo)")
    ap.add_argument("--root", help="that run's store, a local directory (default $EAGLE3_ROOT)")
    ap.add_argument("--store", type=Path, default=Path("/tmp/recipe-demo-store"), help="demo store (built if missing)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/recipe-bench"))
    ap.add_argument("--base", type=json.loads, help="the baseline's options as JSON over the run's training settings "
                    "(default: BASELINE on the demo, none on a configured run)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=155)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names ('' for --extra alone)")
    ap.add_argument("--extra", type=json.loads, default={}, help="more configurations as JSON: {name: {option: value}}")
    ap.add_argument("--parallel", type=int, default=1, help="trainings at a time (one torch thread each)")
    ap.add_argument("--no-serve", action="store_true", help="held-out figures only: no vLLM serving")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    configs = dict(CONFIGS) | args.extra
    if args.list:
        print(json.dumps(configs, indent=1))
        return 0
    names = [n for n in args.configs.split(",") if n] + list(args.extra)
    if unknown := [n for n in names if n not in configs]:
        raise SystemExit(f"--configs: unknown {unknown}; --list shows the names")
    started = time.perf_counter()
    out = args.out.resolve()
    project = open_project(args.config, args.root, args.store, demo_shards=True)
    configured = bool(args.config or os.environ.get(CONFIG_ENV))
    base_options = args.base if args.base is not None else ({} if configured else BASELINE)
    base = project.settings.training.model_copy(update={"steps": args.steps, "device": "cpu"})
    jobs: dict[str, TrainingSettings] = {}
    runs_of: dict[str, list[str]] = {}
    for name in names:
        options = base_options | configs[name]
        if any(options.get(f) for f in ARCHITECTURE):
            options["serve_with"] = ["vllm"]  # SGLang cannot serve these norm placements
        # A configuration's own seed wins over --seeds (a second seed of one configuration).
        seeded = [base.model_validate(base.model_dump() | {"seed": s} | options) for s in args.seeds]
        for settings in {t.seed: t for t in seeded}.values():
            runs_of.setdefault(name, []).append(label := f"{name}/s{settings.seed}")
            jobs[label] = settings
    trained = train_all(project, jobs, out, args.parallel)
    served = {}
    if not args.no_serve:
        exports = {k: t.export_dir for k, t in trained.items()}
        served = serve(project.target(), project, exports, project.settings.generation.max_new_tokens)

    rows = {}
    for name in names:
        runs = runs_of[name]
        rows[name] = {
            "cpu_s_per_step": statistics.fmean(trained[r].cpu_s_per_step for r in runs),
            "tokens_per_step": statistics.fmean(trained[r].tokens_per_step for r in runs),
            **{f"heldout_{m}": statistics.fmean(trained[r].heldout.get(m, float("nan")) for r in runs) for m in HELDOUT},
            "heldout_acc_0_seeds": [trained[r].heldout.get("acc_0", float("nan")) for r in runs],
            "options": configs[name],
        }
        if served:
            rows[name] |= {
                **{f"k{k}": statistics.fmean(served[r][f"k{k}"]["mean_acceptance_length"] for r in runs) for k in KS},
                **{f"k{k}_seeds": [served[r][f"k{k}"]["mean_acceptance_length"] for r in runs] for k in KS},
                "greedy_equal": all(served[r][f"k{k}"]["outputs_match_greedy"] for r in runs for k in KS),
            }
    print_table(rows, {label: t.as_json()["acc_0_curve"] for label, t in trained.items()}, served=bool(served))
    report = {
        "steps": args.steps, "seeds": args.seeds, "base": base_options, "rows": rows,
        "runs": {k: t.as_json() for k, t in trained.items()}, "served": served,
        "minutes": (time.perf_counter() - started) / 60,
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"report: {out / 'report.json'} ({report['minutes']:.1f} min)")
    return 0


def print_table(rows: dict[str, dict], curves: dict[str, list], *, served: bool) -> None:
    base_row = rows.get("baseline")
    head = f"\n{'configuration':<22}{'CPU s/step':>11}{'tok/step':>9}{'loss':>7}{'acc_0':>7}{'acc_3':>7}{'acc_6':>7}"
    print(head + (f"{'k=3':>8}{'k=7':>8}{'÷base k3':>10}{'÷base k7':>10}  seeds k3 / k7" if served else "  acc_0 seeds"))
    for name, r in rows.items():
        line = f"{name:<22}{r['cpu_s_per_step']:>11.2f}{r['tokens_per_step']:>9.0f}{r['heldout_loss']:>7.3f}"
        line += "".join(f"{r[f'heldout_acc_{k}']:>7.3f}" for k in (0, 3, 6))
        if served:
            ratio = [r[f"k{k}"] / base_row[f"k{k}"] if base_row else float("nan") for k in KS]
            seeds = " ".join(f"{a:.3f}" for a in r["k3_seeds"]) + " / " + " ".join(f"{a:.3f}" for a in r["k7_seeds"])
            line += f"{r['k3']:>8.3f}{r['k7']:>8.3f}{ratio[0]:>10.3f}{ratio[1]:>10.3f}  {seeds}"
            line += "" if r["greedy_equal"] else "  OUTPUT DIFFERS FROM GREEDY"
        else:
            line += "  " + " ".join(f"{a:.3f}" for a in r["heldout_acc_0_seeds"])
        print(line)
    print("\ntraining acc_0 by tenth of the run (last step: mean over the tenth)")
    for label, points in curves.items():
        print(f"{label:<26}" + " ".join(f"{v:.3f}" for _, v in points))


if __name__ == "__main__":
    sys.exit(main())
