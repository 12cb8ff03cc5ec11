"""Peer benchmark: our EAGLE-3 drafter against speculators' (PyPI 0.9.0) and against vLLM's n-gram
prompt lookup, same data, same steps, same prompts, same server.

One command (tens of minutes on 2 cores, on the demo):

    .venv/bin/python benchmarks/bench_peer_speculators.py --store /tmp/recipe-demo-store --out /tmp/peer-bench

Any configured run instead: its settings file (`--config`, or $EAGLE3_CONFIG) and its store
(`--root`, or $EAGLE3_ROOT; a local directory), with `hidden_states` materialized there:

    .venv/bin/python benchmarks/bench_peer_speculators.py --config eagle3.yaml --root /data/eagle3 \
        --eval-prompts /data/heldout.jsonl --max-tokens 256 --out /tmp/peer-bench

Without a config, `--store` is the demo store (built there the first time: the project's demo
graph through the shards, `drafter_runs.demo_store`); both backends store the pre-norm last
state speculators needs. The peer venv (`.peer/speculators/`) is created on first use by
`benchmarks/peer/setup_speculators_venv.sh`. Ours trains with the run's training settings,
`--recipe` overriding any of them. `--max-tokens` is the decode length (default:
`generation.max_new_tokens`), `--eval-prompts` a JSONL prompt file (default: the store's
held-out prompts, `eval_prompts`); prompts render with the run's chat-template kwargs, as
`drafter_eval` renders them. `--contestants` picks any of ours, speculators, ngram
(`--contestants ngram` serves n-gram drafting alone: no training, no shards needed). Figures go
to stdout (a table) and `<out>/report.json`.

What it does
------------
1. Converts the shards into speculators' layout (`benchmarks/peer/convert_shards.py`): the
   same training rows as ours (`index_samples` + `split_heldout(training.heldout_rows, seed)`),
   the same vocab map (d2t/t2d), the held-out rows as speculators' validation split.
2. Trains OUR drafter for `--steps` optimizer steps (`training.steps`: the schedule is exactly
   that long) into a scratch store beside the demo's (`drafter_runs.train`) and exports it.
3. Trains SPECULATORS' drafter for the same `--steps` in the peer venv
   (`benchmarks/peer/speculators_cpu.py`, a CPU wrapper around its own trainer), with the
   same lr, warmup, cosine schedule, TTT steps, step weight (speculators'
   `ttt_step_loss_decay`), seed, AdamW and weight decay, and a packed token budget per step
   equal to the real (unpadded) tokens per step our run averages (`--spec-total-seq-len
   match`: read off our batch plan before either trains), so both see about the same tokens
   per step; `--concurrent` trains it beside ours, one core each. Everything else is speculators'
   default recipe (norm_before_fc / norm_output / norm_before_residual, KL loss, frozen
   lm_head, grad clip 1.0, AdamW betas (0.9, 0.999)).
4. Equal CPU-seconds (method): the CPU time speculators spent on its `--steps` training
   steps buys ours M = round(spec CPU seconds / our CPU seconds per step) steps; ours is
   trained again, from scratch, with its schedule spanning M steps (same lr, warmup,
   everything else), exported, and served like the others.
   The equal-CPU ratio is that run's acceptance over speculators' `--steps` run. (Not the
   other way round: speculators is the slower one per step, so cutting it down to our CPU
   budget would compare a few dozen of its steps with our full run.) `--equal-cpu speculators`
   goes that other way when training time is short: speculators again, from scratch, for the
   steps our run's CPU-seconds buy at its CPU per step so far (read from its running log when
   ours is done; with `--concurrent` on the core ours freed); the report gives both CPU totals.
   `--equal-cpu none` skips it.
5. Serves every drafter with the same script (`drafter_runs.serve`: one vLLM interpreter):
   the held-out eval prompts, greedy, plain and with each drafter at k=3 and k=7, and with
   vLLM's `ngram` speculative method at the same k (`prompt_lookup_min`/`max` =
   `--ngram-min`/`--ngram-max`: the k tokens that followed the latest earlier occurrence of
   the longest suffix n-gram, n between min and max; nothing trained, the floor a drafter
   must beat), and checks that every speculative output equals the plain greedy output.
   vLLM counts a draft only where one was proposed, and n-gram lookup proposes only where the
   text repeats, so its mean acceptance length skips the steps it could not draft: ours ÷
   n-gram is taken on tokens per target forward (generated ÷ (generated − accepted)), which
   counts every forward.

CPU seconds are process time (`time.process_time()`: every thread of the training process,
data loading included; validation, checkpoints and export excluded), per optimizer step,
first step excluded (it carries one-off setup in our run), mean over the rest. Both trainers
run with the same torch thread count (`--threads`, default 1: with 2 shared cores, more
threads make OpenMP spin-waits count as CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parent / "peer"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(PEER_DIR))

from convert_shards import convert  # noqa: E402
from speculators_runs import cpu_per_step_so_far, ensure_peer_venv, planned_tokens_per_step, train_speculators  # noqa: E402
from drafter_runs import KS, curve, log, open_project, serve, shard_keys, train  # noqa: E402

from eagle3_assets.prompts import parse_prompts  # noqa: E402
from eagle3_assets.settings import CONFIG_ENV, ROOT_ENV, TrainingSettings  # noqa: E402


# -- speculators -----------------------------------------------------------------------


def spec_flags(args, total_seq_len: int, steps: int) -> list[str]:
    """The wrapper's flags for speculators' EAGLE-3 run: our schedule and recipe (`args`, set from ours)."""
    return [
        "--steps", str(steps), "--lr", repr(args.lr), "--warmup-steps", str(args.warmup_steps),
        "--ttt-steps", str(args.ttt_steps), "--step-weight", repr(args.step_weight),
        "--total-seq-len", str(total_seq_len), "--optimizer", args.spec_optimizer,
        "--weight-decay", repr(args.weight_decay), "--attn-impl", args.spec_attn_impl,
        "--dtype", args.spec_dtype, "--seed", str(args.seed),
    ]  # fmt: skip


def spec_report(spec: dict) -> dict:
    """The wrapper's result for the report: per-step lists folded into means and the learning curve."""
    return {k: v for k, v in spec.items() if k not in ("cpu_s_per_step", "train_metrics")} | {
        "cpu_s_per_step": spec["cpu_s_per_step_mean"],
        "tokens_per_step": spec["tokens_per_step_mean"] or 0.0,
        # Speculators' training accuracy of the first draft position, the statistic of ours' acc_0; its
        # global_step counts from 0, ours from 1.
        "acc_0_curve": curve(
            [(int(m["step"]) + 1, float(m["full_acc_0"])) for m in spec.get("train_metrics", []) if "full_acc_0" in m]
        ),
    }


# -- report ----------------------------------------------------------------------------------


def ratios(served: dict, a: str, b: str, figure: str = "mean_acceptance_length") -> dict:
    return {f"k{k}": served[a][f"k{k}"][figure] / served[b][f"k{k}"][figure] for k in KS}


def print_table(report: dict) -> None:
    s = report["served"]
    print(f"\n{'drafter':<22}{'steps':>7}{'CPU s/step':>12}{'tok/step':>10}{'acc.len k3':>12}{'acc.len k7':>12}"
          f"{'tok/fwd k3':>12}{'tok/fwd k7':>12}  per position k7")  # fmt: skip
    for name in s:
        k3, k7 = s[name]["k3"], s[name]["k7"]
        pos = " ".join(f"{x:.3f}" for x in k7["acceptance_per_position"])
        t = report.get(name)  # none: not trained here (ngram, or an export given by --serve-export)
        trained = f"{t['steps']:>7}{t['cpu_s_per_step']:>12.3f}{t['tokens_per_step']:>10.0f}" if t else f"{'-':>7}{'-':>12}{'-':>10}"
        print(
            f"{name:<22}{trained}{k3['mean_acceptance_length']:>12.3f}{k7['mean_acceptance_length']:>12.3f}"
            f"{k3['tokens_per_forward']:>12.3f}{k7['tokens_per_forward']:>12.3f}  {pos}"
        )
    for name in ("ours", "speculators", "ours_equal_cpu", "speculators_equal_cpu"):
        if points := report.get(name, {}).get("acc_0_curve"):
            print(f"{name} training acc_0 by step: " + " ".join(f"{step}:{acc:.3f}" for step, acc in points))
    r = report["ratios"]
    if "equal_steps" in r:
        print(f"\nours / speculators, equal steps:        k3 {r['equal_steps']['k3']:.3f}  k7 {r['equal_steps']['k7']:.3f}")
    if "equal_cpu_seconds" in r:
        e, rerun = r["equal_cpu_seconds"], "ours_equal_cpu" if "ours_equal_cpu" in report else "speculators_equal_cpu"
        print(
            f"ours / speculators, equal CPU-seconds:  k3 {e['k3']:.3f}  k7 {e['k7']:.3f}  ({rerun} {report[rerun]['steps']} "
            f"steps; CPU-seconds ours / speculators {r['equal_cpu_seconds_cpu_ratio']:.3f})"
        )
    if "cpu_per_step_spec_over_ours" in r:
        print(f"CPU s/step speculators / ours:          {r['cpu_per_step_spec_over_ours']:.2f}x")
    if "ours_over_ngram_tokens_per_forward" in r:
        g = r["ours_over_ngram_tokens_per_forward"]
        print(f"ours / ngram, tokens per target forward: k3 {g['k3']:.3f}  k7 {g['k7']:.3f}")
    ok = all(v["outputs_match_greedy"] for n in s for v in s[n].values())
    print(f"speculative output == plain greedy for every drafter and k: {ok}\n")


CONTESTANTS = ("ours", "speculators", "ngram")


def contestants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONTESTANTS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(CONTESTANTS)}, comma-separated")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, help=f"the run's settings file (default ${CONFIG_ENV}; neither: the demo)")
    ap.add_argument("--root", help=f"the run's store, a local directory (default ${ROOT_ENV}); with --config")
    ap.add_argument("--store", type=Path, default=Path("/tmp/recipe-demo-store"), help="demo store (built if missing)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "peer-bench", help="scratch + report dir")
    ap.add_argument("--eval-prompts", type=Path, help="JSONL prompts to decode (default: the store's held-out prompts)")
    ap.add_argument("--max-tokens", type=int, help="decode length per prompt (default: generation.max_new_tokens)")
    ap.add_argument("--contestants", type=contestants, default=list(CONTESTANTS), help="any of ours,speculators,ngram")
    ap.add_argument(
        "--serve-export", action="append", default=[], metavar="LABEL=DIR",
        help="also serve an existing export (not trained here), e.g. ours=.eagle3/drafter/export",
    )  # fmt: skip
    ap.add_argument("--ngram-min", type=int, default=2, help="vLLM ngram prompt_lookup_min")
    ap.add_argument("--ngram-max", type=int, default=5, help="vLLM ngram prompt_lookup_max")
    ap.add_argument("--steps", type=int, default=155, help="optimizer steps for both trainers")
    ap.add_argument("--recipe", default="{}", help="our training options as JSON, over the run's training settings")
    ap.add_argument("--spec-total-seq-len", default="match", help="speculators' packed tokens per step; 'match' = ours")
    ap.add_argument("--spec-optimizer", default="adamw", choices=["adamw", "muon"], help="speculators' default is muon")
    ap.add_argument("--spec-attn-impl", default="sdpa", choices=["sdpa", "eager"], help="flex attention: no CPU backward")
    ap.add_argument("--spec-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each trainer")
    ap.add_argument(
        "--equal-cpu", choices=["ours", "speculators", "none"], default="ours",
        help="which trainer runs again at the other's CPU-seconds: ours (more steps at speculators' budget), "
        "speculators (fewer steps at ours'; cheaper when it is the slower), none",
    )  # fmt: skip
    ap.add_argument(
        "--concurrent", action="store_true",
        help="train speculators beside ours (one core each at --threads 1) instead of one after the other",
    )  # fmt: skip
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trains = {"ours", "speculators"} & set(args.contestants)
    if (args.equal_cpu == "speculators" or args.concurrent) and len(trains) < 2:
        flag = "--equal-cpu speculators" if args.equal_cpu == "speculators" else "--concurrent"
        raise SystemExit(f"{flag} needs both ours and speculators in --contestants (given: {','.join(args.contestants)})")
    project = open_project(args.config, args.root, args.store, demo_shards=bool(trains))
    store = project.store
    max_tokens = args.max_tokens or project.settings.generation.max_new_tokens
    eval_prompts = None
    if args.eval_prompts is not None:
        eval_prompts = parse_prompts(args.eval_prompts.read_text(encoding="utf-8-sig"), str(args.eval_prompts))
    if trains and not shard_keys(store):
        raise SystemExit(
            f"{store.url_of('')}: no complete hidden-state shards to train {' and '.join(sorted(trains))} on; "
            "materialize the graph through hidden_states with this config and root first"
        )
    base: TrainingSettings = project.settings.training.model_validate(
        project.settings.training.model_dump() | json.loads(args.recipe) | {"steps": args.steps, "device": "cpu"}
    )
    # speculators' flags come from ours, so both see the same schedule and data.
    args.lr, args.warmup_steps, args.ttt_steps, args.step_weight = base.lr, base.warmup_steps, base.ttt_steps, base.step_weight
    args.weight_decay, args.seed = base.weight_decay, base.seed
    timings: dict[str, float] = {}
    report: dict = {}
    drafters: dict[str, Path] = {}

    ours = spec_job = None
    if "speculators" in args.contestants:
        t = time.perf_counter()
        py = ensure_peer_venv()
        timings["peer_venv_s"] = time.perf_counter() - t
        t = time.perf_counter()
        data_dir = out / "speculators_data"
        manifest = convert(store.local_path(""), data_dir, heldout_rows=base.heldout_rows, seed=base.seed)
        timings["convert_s"] = time.perf_counter() - t
        log(f"converted {manifest['n_train']} training + {manifest['n_heldout']} held-out rows into {data_dir}")
        report["data"] = {k: v for k, v in manifest.items() if k != "rows"}
        # Our batch plan says, before training, the real tokens per step ours will average: speculators'
        # budget matches it whether or not ours trains first.
        match = args.spec_total_seq_len == "match"
        seq_len = round(planned_tokens_per_step(store, shard_keys(store), base)) if match else int(args.spec_total_seq_len)

        def run_speculators(name: str, steps: int) -> dict:
            t = time.perf_counter()
            flags = spec_flags(args, seq_len, steps)
            spec = train_speculators(py, data_dir, project.target_dir(), out / name, flags, threads=args.threads)
            timings[f"{name}_s"] = time.perf_counter() - t
            return spec

        pool = ThreadPoolExecutor(2)
        spec_job = pool.submit(run_speculators, "speculators_run", args.steps)
        if not args.concurrent:
            spec_job.result()
    if "ours" in args.contestants:
        t = time.perf_counter()
        ours = train(project, base, "ours", out, threads=args.threads)
        timings["ours_s"] = time.perf_counter() - t
        report["ours"], drafters["ours"] = ours.as_json(), ours.export_dir
    equal_spec_job = None
    if ours is not None and spec_job is not None and args.equal_cpu == "speculators":
        # Speculators again, from scratch, for as many steps as ours' CPU-seconds buy at its CPU per step
        # (read off the running speculators log when ours is done; the report gives both totals).
        n = max(1, round(sum(ours.cpu_s) / cpu_per_step_so_far(out / "speculators_run.log")))
        equal_spec_job = pool.submit(run_speculators, "speculators_equal_cpu_run", n)
    if spec_job is not None:
        spec = spec_job.result()
        report["speculators"] = spec_report(spec)
        drafters["speculators"] = Path(spec["export_dir"])
        if ours is not None and args.equal_cpu == "ours":
            m = max(1, round(spec["cpu_s_train_steps"] / ours.cpu_s_per_step))
            t = time.perf_counter()
            equal = train(project, base.model_copy(update={"steps": m}), "ours_equal_cpu", out, threads=args.threads)
            timings["ours_equal_cpu_s"] = time.perf_counter() - t
            report["ours_equal_cpu"] = equal.as_json()
            drafters["ours_equal_cpu"] = equal.export_dir
    if equal_spec_job is not None:
        spec_equal = equal_spec_job.result()
        report["speculators_equal_cpu"] = spec_report(spec_equal)
        drafters["speculators_equal_cpu"] = Path(spec_equal["export_dir"])
    if spec_job is not None:
        pool.shutdown()

    for given in args.serve_export:
        label, _, path = given.partition("=")
        if not path or label in drafters:
            raise SystemExit(f"--serve-export {given!r}: expected LABEL=DIR with a label not trained here")
        drafters[label] = Path(path).resolve()
    t = time.perf_counter()
    ngram = (args.ngram_min, args.ngram_max) if "ngram" in args.contestants else None
    report["served"] = served = serve(project.target(), project, drafters, max_tokens, prompts=eval_prompts, ngram=ngram)
    timings["serve_s"] = time.perf_counter() - t
    report["ratios"] = ratios_of(report, served)
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = timings
    report["recipe"] = base.model_dump()
    report["run"] = {
        "config": str(args.config or os.environ.get(CONFIG_ENV) or "demo"),
        "store": store.url_of(""),
        "eval_prompts": str(args.eval_prompts or store.url_of("prompts/eval_prompts.jsonl")),
        "max_tokens": max_tokens,
        "contestants": args.contestants,
        "served_exports": args.serve_export,
        "ngram_prompt_lookup": list(ngram) if ngram else None,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print_table(report)
    log(f"report: {out / 'report.json'} ({timings['total_s'] / 60:.1f} min)")
    return 0


def ratios_of(report: dict, served: dict) -> dict:
    r: dict = {}
    if "ours" in served and "speculators" in served:
        r["equal_steps"] = ratios(served, "ours", "speculators")
        r["cpu_per_step_spec_over_ours"] = report["speculators"]["cpu_s_per_step"] / report["ours"]["cpu_s_per_step"]
    if "ours_equal_cpu" in served:
        r["equal_cpu_seconds"] = ratios(served, "ours_equal_cpu", "speculators")
        r["equal_cpu_seconds_cpu_ratio"] = report["ours_equal_cpu"]["cpu_s_train_steps"] / report["speculators"]["cpu_s_train_steps"]
    if "speculators_equal_cpu" in served:
        r["equal_cpu_seconds"] = ratios(served, "ours", "speculators_equal_cpu")
        r["equal_cpu_seconds_cpu_ratio"] = report["ours"]["cpu_s_train_steps"] / report["speculators_equal_cpu"]["cpu_s_train_steps"]
    if "ours" in served and "ngram" in served:
        # n-gram lookup drafts only where the text repeats: compared per target forward, undrafted steps included.
        r["ours_over_ngram_tokens_per_forward"] = ratios(served, "ours", "ngram", "tokens_per_forward")
    return r


if __name__ == "__main__":
    if "--help" not in sys.argv and "-h" not in sys.argv:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
