"""Appended prompts continue the released drafter (issue 45): continued vs from scratch, on the demo.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_continue.py --work /tmp/bench45 [--target-from .eagle3] \
        [--fractions 0.1 0.25] [--replay-rows 0 4000]

Through the real graph (`python -m eagle3_assets.start`, the demo's settings with `drafters: [eagle3]`, the demo's
prompts as a prompt file of their own and its held-out prompts beside it):

1. build on the first 3,600 demo prompts (9 shards of 400) and release (`drafter_release`'s first release);
2. append the last 400 prompts to the prompt file and run the same command again. It must generate only the 400
   new rows' responses, extract only the new shard (`rows_3600-4000`), continue the drafter from the release
   (`training.continue_fraction` of a from-scratch run's steps), evaluate it and decide its release: released only
   when it serves at least as well as the first release. The script checks each from the Dagster instance.

Then, in this process, on a copy of the store with the first release put back in `drafter/release/`: a from-scratch
drafter on all 4,000 rows (the demo recipe: 16 packed epochs), and continuations of the first release at each of
`--fractions` (and, with `--replay-rows N …`, at the default fraction with each `training.replay_rows`: 0 replays
nothing, 4,000 every old training row). Every drafter is exported and served by one vLLM interpreter (CPU build) on
the 64 held-out demo prompts, at k=3 and k=7; output must equal plain greedy. Printed: served mean acceptance at k=3
/ k=7, optimizer steps, training CPU-seconds, and whether the graph's continued drafter was released (BENCHMARKS.md,
`continue`). The in-process drafters' CPU-seconds are this process's (all threads); the graph's drafter trains under
torchrun, so for it the `drafter` step's wall seconds are given.

`--target-from STORE` copies a built demo target (`target_model/model`) from STORE instead of training it (the
asset reuses a target built with the same demo settings); each finished phase is recorded in `WORK/state.json`
and skipped when the script is run again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from drafter_runs import scratch_store, serve, shard_keys

from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.release import RELEASE_DIR
from eagle3_assets.drafter.run import train_and_export
from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project
from eagle3_assets.settings import CONFIG_ENV, TrainingSettings, load_settings
from eagle3_assets.storage import ArtifactStore

FIRST = 3600  # rows of the first build: 9 of the demo's 400-row shards
NEW_SHARD = "rows_3600-4000"


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


class State:
    """What finished, in WORK/state.json: each phase runs once."""

    def __init__(self, work: Path):
        self.path = work / "state.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, key: str, default: Any) -> Any:
        return self.data.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))


def demo_prompt_lines() -> tuple[list[str], list[str]]:
    """The demo's 4,000 training prompts and its held-out prompts, one JSON line each, as the `prompts` asset writes
    them for the demo."""
    from eagle3_assets.demo.prompts import demo_prompt_sets
    from eagle3_assets.settings import demo_settings

    train, heldout = demo_prompt_sets(demo_settings().demo)
    return [json.dumps(p) + "\n" for p in train], [json.dumps(p) + "\n" for p in heldout]


def setup(work: Path, target_from: str | None) -> dict[str, str]:
    """The prompt files (the first 3,600 rows), the settings and, with `target_from`, the built demo target."""
    from eagle3_assets.settings import demo_settings

    store, home = work / "store", work / "dagster_home"
    for d in (store, home):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    train, heldout = demo_prompt_lines()
    assert len(train) == 4000, len(train)
    (work / "prompts.jsonl").write_text("".join(train[:FIRST]))
    (work / "eval_prompts.jsonl").write_text("".join(heldout))
    (work / "appended.jsonl").write_text("".join(train[FIRST:]))
    settings = demo_settings().model_dump(mode="json")
    settings.update(
        drafters=["eagle3"], prompts=str(work / "prompts.jsonl"), eval_prompts=str(work / "eval_prompts.jsonl")
    )
    (work / "settings.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    if target_from:
        src = Path(target_from)
        shutil.copytree(src / DEMO_MODEL_DIR, store / DEMO_MODEL_DIR)
        shutil.copy2(src / DEMO_MODEL_SETTINGS, store / DEMO_MODEL_SETTINGS)
    return graph_env(work)


def graph_env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "EAGLE3_ROOT": str(work / "store"),
        "DAGSTER_HOME": str(work / "dagster_home"),
        "EAGLE3_CONFIG": str(work / "settings.yaml"),
    }


def start(work: Path, name: str, *, may_fail: bool = False, args: tuple[str, ...] = ()) -> dict[str, Any]:
    """`python -m eagle3_assets.start` once, its output in WORK/NAME.log; wall seconds and the time it began.
    `may_fail`: a release the gate refused fails its blocking check, and the command says so in its exit status."""
    began = time.time()
    with open(work / f"{name}.log", "w") as out:
        rc = subprocess.call([sys.executable, "-m", "eagle3_assets.start", *args], env=graph_env(work), stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
    wall = time.time() - began
    log(f"{name}: start exited {rc} after {wall:.0f} s (log {work / f'{name}.log'})")
    if rc != 0 and not may_fail:
        raise SystemExit(f"{name}: the start command failed (exit {rc}); see {work / f'{name}.log'}")
    return {"began": began, "wall_s": round(wall), "rc": rc}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/bench45")
    ap.add_argument("--target-from", help="a store holding a built demo target to copy (else the graph builds one)")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.1, 0.25])
    ap.add_argument(
        "--replay-rows",
        type=int,
        nargs="*",
        default=[],
        help="also continue with each training.replay_rows (default fraction)",
    )
    ap.add_argument(
        "--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also a continuation with these training settings (e.g. continue-lr1e-3:lr=1e-3)",
    )  # fmt: skip
    ap.add_argument("--redo-drafter", action="store_true", help="after the second start, `start --from drafter`")
    ap.add_argument("--until", choices=["first", "second", "train", "serve"], default="serve")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    state = State(work)
    if "first" not in state:
        setup(work, args.target_from)
        log(f"first build: {FIRST} prompts")
        state["first"] = start(work, "start1")
    if args.until == "first":
        return 0
    if "second" not in state:
        snapshot_first_release(work)
        with open(work / "prompts.jsonl", "a") as f:
            f.write((work / "appended.jsonl").read_text())
        log("appended 400 prompts; the same start command again")
        state["second"] = start(work, "start2", may_fail=True)
    if args.until == "second":
        return 0
    if "graph" not in state:
        state["graph"] = graph_figures(work, state["second"]["began"])
    if args.redo_drafter and "third" not in state:
        # The same store, `--from drafter`: the drafter continues the release again with this code's defaults, then
        # drafter_eval and drafter_release decide (for a run whose second start predates them).
        log("the same start command with --from drafter")
        state["third"] = start(work, "start3", may_fail=True, args=("--from", "drafter"))
        state["graph3"] = graph_figures(work, state["third"]["began"])
    project = Project(load_settings({CONFIG_ENV: str(work / "settings.yaml")}), ArtifactStore(str(work / "store")))
    variants: dict[str, dict[str, Any]] = {"scratch": {}} | {
        f"continue-{f:g}": {"continue_fraction": f} for f in args.fractions
    }
    variants |= {f"continue-replay{n}": {"replay_rows": n} for n in args.replay_rows}
    for spec in args.variant:  # NAME:KEY=VALUE,…: each value read as JSON (numbers, null)
        name, _, pairs = spec.partition(":")
        variants[name] = {k: json.loads(v) for k, v in (p.split("=", 1) for p in pairs.split(",") if p)}
    for name, training in variants.items():
        if name not in state:
            state[name] = train_variant(project, work, name, training, scratch=name == "scratch")
    if args.until == "train":
        return 0
    drafters = {
        "first release": work / "first_release",
        "graph continued": work / "store" / "drafter" / "export",
        **({"graph continued, --from drafter": work / "store" / "drafter" / "export"} if "third" in state else {}),
        **{name: Path(state[name]["export"]) for name in variants},
    }
    # Served in one interpreter; a later run with more variants serves only the new ones (greedy decoding and the
    # engine's counters are deterministic: the same drafter serves the same figures in another interpreter).
    served = state.get("served", {})
    if todo := {n: d for n, d in drafters.items() if n not in served}:
        served |= serve(project.target(), project, todo, project.settings.generation.max_new_tokens)
        state["served"] = served
    print(table(state, list(drafters)))
    return 0


def graph_figures(work: Path, since: float) -> dict[str, Any]:
    """What the second start did, from its Dagster instance: each asset (and shard) materialized since `since`, the
    responses it generated and reused, the drafter's `trained` line and steps, and the release decision."""
    from dagster import AssetRecordsFilter, DagsterInstance

    os.environ["DAGSTER_HOME"] = str(work / "dagster_home")
    made: dict[str, list[str]] = {}
    meta: dict[str, dict[str, Any]] = {}
    with DagsterInstance.get() as instance:
        for key in instance.get_asset_keys():
            records = instance.fetch_materializations(
                AssetRecordsFilter(asset_key=key, after_timestamp=since), limit=1000
            ).records
            for r in records:
                m = r.asset_materialization
                if key.to_user_string() == "drafter" and "drafter_wall_s" not in meta:
                    stats = instance.get_run_step_stats(r.run_id)
                    meta["drafter_wall_s"] = {
                        "s": round(sum((st.end_time or 0) - (st.start_time or 0) for st in stats))
                    }
                made.setdefault(key.to_user_string(), []).append(m.partition or "")
                meta.setdefault(key.to_user_string(), {k: v.value for k, v in m.metadata.items()})
    responses, drafter, release = meta.get("responses", {}), meta.get("drafter", {}), meta.get("drafter_release", {})
    out = {
        "materialized": {k: sorted(v) for k, v in made.items()},
        "responses_generated": responses.get("rows_generated"),
        "responses_reused": responses.get("rows_reused"),
        "drafter_trained": drafter.get("trained"),
        "drafter_steps": drafter.get("step"),
        "drafter_wall_s": meta.get("drafter_wall_s", {}).get("s"),
        "released": release.get("promoted"),
        "release_reason": release.get("reason"),
        "release_figures": {k: v for k, v in release.items() if k.startswith(("new_", "released_"))},
    }
    log(f"start since {time.strftime('%H:%M:%S', time.localtime(since))}: {json.dumps(out)}")
    return out


def variant_store(project: Project, work: Path, name: str, *, scratch: bool) -> ArtifactStore:
    """The graph's store, linked, with a drafter directory of the variant's own: the first release in it for a
    continuation, nothing for a from-scratch run."""
    store = scratch_store(project, work / "variants" / name)
    if not scratch:
        shutil.copytree(work / "first_release", work / "variants" / name / RELEASE_DIR)
    return store


def train_variant(
    project: Project, work: Path, name: str, training: dict[str, Any], *, scratch: bool
) -> dict[str, Any]:
    """One drafter through `train_and_export` (the drafter asset's own path, in this process), timed."""
    settings = project.settings.model_copy(
        update={"training": TrainingSettings.model_validate(project.settings.training.model_dump() | training)}
    )
    store = variant_store(project, work, name, scratch=scratch)
    keys = shard_keys(store)
    lines: list[str] = []
    before, wall = cpu_seconds(), time.perf_counter()
    run = train_and_export(store, project.target(), settings, keys, log=lines.append)
    cpu, wall = cpu_seconds() - before, time.perf_counter() - wall
    (work / "variants" / f"{name}.log").write_text("\n".join(lines) + "\n")
    row = {
        "trained": run.summary["trained"], "steps": run.result.step, "train_cpu_s": round(cpu),
        "train_wall_s": round(wall), "export": str(store.local_path(EXPORT_DIR)),
        "heldout_acc_0": run.summary.get("heldout_acc_0"),
    }  # fmt: skip
    log(f"{name}: {json.dumps(row)}")
    return row


def table(state: State, names: list[str]) -> str:
    """The figures, one row per drafter (BENCHMARKS.md, `continue`)."""
    served = state["served"]
    scratch = served["scratch"]
    graph = state["graph"]
    third = state.get("graph3", {})
    steps = {
        "first release": "",
        "graph continued": graph["drafter_steps"],
        "graph continued, --from drafter": third.get("drafter_steps"),
    } | {n: state[n]["steps"] for n in names if n in state.data}
    cpu = {n: state[n]["train_cpu_s"] for n in names if n in state.data}
    cpu["graph continued"] = f"({graph['drafter_wall_s']} s wall, torchrun)"
    lines = [
        "| drafter | k=3 | k=7 | ÷ scratch k=3 | ÷ scratch k=7 | optimizer steps | training CPU-s | greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        k3, k7 = served[n]["k3"], served[n]["k7"]
        ratio3 = k3["mean_acceptance_length"] / scratch["k3"]["mean_acceptance_length"]
        ratio7 = k7["mean_acceptance_length"] / scratch["k7"]["mean_acceptance_length"]
        lines.append(
            f"| {n} | {k3['mean_acceptance_length']:.3f} | {k7['mean_acceptance_length']:.3f} | {ratio3:.3f} | "
            f"{ratio7:.3f} | {steps.get(n, '')} | {cpu.get(n, '')} | "
            f"{k3['outputs_match_greedy'] and k7['outputs_match_greedy']} |"
        )
    lines += [
        "",
        f"graph, second start: responses generated {graph['responses_generated']}, reused {graph['responses_reused']}",
        f"materialized: {json.dumps(graph['materialized'])}",
        f"drafter: {graph['drafter_trained']}",
        f"drafter_release: promoted {graph['released']}: {graph['release_reason']}",
        f"first start {state['first']['wall_s']} s, second start {state['second']['wall_s']} s",
    ]
    if third:
        lines += [
            f"--from drafter: {third['drafter_trained']} ({third['drafter_wall_s']} s wall)",
            f"drafter_release: promoted {third['released']}: {third['release_reason']}",
        ]
    return "\n".join(lines)


def snapshot_first_release(work: Path) -> None:
    """The first release's files, kept for the in-process continuations (the second start may replace it)."""
    dest = work / "first_release"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(work / "store" / "drafter" / "release", dest)


def cpu_seconds() -> float:
    """This process's CPU-seconds and its reaped children's (all threads)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
