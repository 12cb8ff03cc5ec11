"""A published drafter adapted to traffic (issue 53), on the demo world: imported as is, continued on the traffic, or
replaced by one trained on the traffic alone (BENCHMARKS.md `import + traffic`).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_import_traffic.py --work /tmp/bench53

The demo store (4,000 rows on the demo target, built in WORK/store by the project's own graph the first time: ~20 min
on 2 cores) is split by the world's training entities. Half of them (A), with half of the template rows, are what a
team elsewhere trained the "published" drafter on; the other half (B), with the other template rows, are this team's
traffic; rows asking about one entity of each half go to neither. 64 traffic rows (fact and template, seeded) are the
traffic's held-out prompts, trained on by no drafter. Each side is a store of its own whose shards hold only its rows
(the sample files linked) and whose vocab map is built from its own loss tokens.

Drafters, each by the demo recipe (`demo_settings().training`):
- (a) `published`: from scratch on A, exported, then imported into the traffic store by `start_from` (the EAGLE-3
  layout vLLM reads), which installs it as the release and adopts its map (`adopted_vocab_map`);
- (b) `continued`: the drafter asset's continuation of that import (`plan_continuation` with the family's
  `import_differences`): its weights exactly, every traffic row new, `training.continue_fraction` of a from-scratch
  run's steps;
- (c) `scratch`: from scratch on the traffic alone (its own map), at its full recipe, and `scratch@b` at (b)'s steps.

All four are served by one vLLM interpreter (CPU build) per prompt set, at k=3 and k=7, output checked equal to
greedy: on the traffic's held-out prompts and on the demo's 64 original held-out prompts (held-out entities). Printed
as one JSON line and written to WORK/results.json; a finished drafter is not trained again when the script is rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.drafter_runs import demo_store, log, serve, shard_keys
from eagle3_assets.demo.prompts import demo_references
from eagle3_assets.demo.world import demo_world
from eagle3_assets.drafter.continuation import plan_continuation
from eagle3_assets.drafter.evaluate import eval_max_tokens
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.family import Eagle3
from eagle3_assets.drafter.imported_release import adopted_vocab_map, start_from
from eagle3_assets.drafter.run import import_fit
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.project import Project
from eagle3_assets.prompts import Prompt
from eagle3_assets.responses import read_responses
from eagle3_assets.sample_file import HIDDEN_STATES_DIR, manifest_path, sample_path
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VocabMap, build_vocab_map, token_frequencies

TRAFFIC_HELDOUT = 64
TARGET_VERSION = "bench"  # the release's target, as `start_from` records it and the plan compares it
LINKED = ("target_model", "prompts", "responses", "tokenized", "token_freq")  # the inputs every side store shares


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def split_rows(project: Project) -> tuple[list[int], list[int], list[int], list[dict]]:
    """(A rows, B training rows, B held-out rows, every response record): by the entities each prompt asks about."""
    world = demo_world(project.settings.demo.seed)
    half = {e.name for i, e in enumerate(sorted(world.train, key=lambda e: e.name)) if i % 2 == 0}
    refs = demo_references(project.settings.demo)
    records = read_responses(project.store)
    a, b = [], []
    for row, record in enumerate(records):
        names = set(refs[record["id"]].entities)
        if not names:
            (a if row % 2 == 0 else b).append(row)
        elif names <= half:
            a.append(row)
        elif not names & half:
            b.append(row)
    held = set(random.Random(0).sample(b, TRAFFIC_HELDOUT))
    return a, [r for r in b if r not in held], sorted(held), records


def side_store(project: Project, dest: Path, rows: list[int]) -> tuple[ArtifactStore, list[str]]:
    """A store holding the project's inputs (linked) and shards with only `rows` (their sample files linked), its vocab
    map built from those rows' loss tokens. Returns it and its shard keys."""
    src = project.store.local_path("")
    if dest.exists():
        shutil.rmtree(dest)
    (dest / HIDDEN_STATES_DIR).mkdir(parents=True)
    for name in LINKED:
        if (src / name).exists():
            (dest / name).symlink_to(src / name)
    wanted, keys = set(rows), []
    for key in shard_keys(project.store):
        lo, hi = (int(x) for x in key.removeprefix("rows_").split("-"))
        mine = [r for r in range(lo, hi) if r in wanted]
        if not mine:
            continue
        (dest / HIDDEN_STATES_DIR / key).mkdir()
        shutil.copy(src / manifest_path(key), dest / manifest_path(key))
        for r in mine:
            os.link(src / sample_path(key, r), dest / sample_path(key, r))
        keys.append(key)
    store = ArtifactStore(str(dest))
    tokenized = TokenizedSet.load(project.store)
    ids = np.concatenate([tokenized.row(r)[0] for r in rows])
    mask = np.concatenate([tokenized.row(r)[1] for r in rows])
    freq = token_frequencies(ids, mask, project.target().vocab_size)
    build_vocab_map(freq, project.settings.draft_vocab_size).save(store)
    np.save(dest / "freq.npy", freq)
    return store, keys


def trained(store: ArtifactStore, keys: list[str], project: Project, label: str, *, steps: int | None = None,
            continuation=None) -> dict:  # fmt: skip
    """One drafter trained on `store`'s shards by the demo recipe (at `steps` when given), exported there."""
    training = project.settings.training.model_copy(update={"steps": steps})
    log(f"{label}: training on {len(keys)} shards" + (f", {steps} steps" if steps else ""))
    before, wall = cpu_seconds(), time.perf_counter()
    result = train_drafter(
        store, keys, vmap=VocabMap.load(store), target=project.target(), settings=training, resume=False,
        continuation=continuation, log=lambda _: None,
    )  # fmt: skip
    export_drafter(store, result.model.trainable_state_dict(), result.config, aux_layer_ids=result.aux_layer_ids)
    row = {
        "steps": result.step, "train_cpu_s": round(cpu_seconds() - before), "train_wall_s": round(time.perf_counter() - wall),
        "heldout_acc_0": round(result.heldout.get("acc_0", float("nan")), 4), "export": str(store.local_path(EXPORT_DIR)),
    }  # fmt: skip
    log(f"{label}: {json.dumps(row)}")
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_file = work / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}

    def keep(name: str, row: dict) -> None:
        results[name] = row
        results_file.write_text(json.dumps(results, indent=1))

    project = demo_store(work / "store")
    a, b, held, records = split_rows(project)
    log(f"rows: A {len(a)}, traffic {len(b)} + {len(held)} held out, neither {len(records) - len(a) - len(b) - len(held)}")

    # (a): a team elsewhere trains it on A and publishes its export.
    published = work / "published"
    if "published" not in results:
        store, keys = side_store(project, work / "a", a)
        keep("published", trained(store, keys, project, "published"))
        shutil.rmtree(published, ignore_errors=True)
        shutil.copytree(store.local_path(EXPORT_DIR), published)

    # (b): imported into the traffic store as its release and continued there, as the drafter asset does.
    if "continued" not in results:
        store, keys = side_store(project, work / "b", b)
        installed = start_from(store, str(published), project.target(), target_version=TARGET_VERSION)
        assert installed.installed, installed.reason
        vmap, how = adopted_vocab_map(store, np.load(work / "b" / "freq.npy"), project.settings.draft_vocab_size)
        vmap.save(store)
        log(f"continued: {how}")
        family = Eagle3(project.settings.training)
        now = {"family": "eagle3", "target": TARGET_VERSION, "vocab_map": "adopted", "settings": {},
               "shards": dict.fromkeys(keys)}  # fmt: skip
        plan = plan_continuation(
            store, now, "", rolling=False, import_differences=import_fit(family, project.target(), vmap)
        )  # fmt: skip
        assert plan.continues, plan.reason
        keep("continued", trained(store, keys, project, "continued", continuation=plan) | {"map": how})

    # (c): from scratch on the traffic alone, its full recipe and (b)'s steps.
    for name, steps in (("scratch", None), ("scratch@b", results["continued"]["steps"])):
        if name not in results:
            store, keys = side_store(project, work / name.replace("@", "_at_"), b)
            keep(name, trained(store, keys, project, name, steps=steps))

    drafters = {n: Path(results[n]["export"]) for n in ("published", "continued", "scratch", "scratch@b")}
    drafters["published"] = published
    traffic = [
        Prompt(id=records[r]["id"], messages=records[r]["messages"][:-1], extra={"kind": records[r].get("kind")})
        for r in held
    ]  # fmt: skip
    s = project.settings
    target, tokens = project.target(), eval_max_tokens(s)
    for name, prompts in (("served_traffic", traffic), ("served_original", None)):
        if name not in results:
            keep(name, serve(target, project, drafters, tokens, prompts=prompts))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
