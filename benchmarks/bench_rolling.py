"""Rolling window (W shards on disk) against extract-everything-then-train, on the demo (issue 22).

    .venv/bin/python benchmarks/bench_rolling.py --work /tmp/bench-rolling [--window 2]

Both runs take the demo's tokenized rows shuffled as the `tokenized` asset shuffles them in
rolling mode, cut into the demo's 400-row shards, and train one epoch of the demo recipe with
the same seed; every shard passes the integrity check (and its record) before training
touches it. Offline extracts and checks every shard, then trains. Rolling trains in one
thread while the other extracts only what the window admits, and releases each shard once a
checkpoint holds it. Reported, rolling ÷ offline: the peak hidden-state bytes in the store
over all shards' bytes (goal ≤ 3/N), served mean acceptance length at k=3 and k=7 (goal ≥ 0.98),
and the wall time from `tokenized` to the export (on 2 CPU cores the two sides share the
cores, so overlap gains little here; on a GPU node extraction and training run on different
devices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from drafter_runs import demo_store, log, serve

from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.integrity import check_shard
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.project import DEMO_MODEL_DIR, Project
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.shard_window import Window, sample_files, write_check_record
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VOCAB_MAP_FILE, VocabMap


class Side:
    """One contestant's store: the demo target and vocab map linked, the shuffled rows, its own shards."""

    def __init__(self, project: Project, rows: TokenizedSet, dest: Path, training: TrainingSettings):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        src = project.store.local_path("")
        for rel in (DEMO_MODEL_DIR, os.path.dirname(VOCAB_MAP_FILE)):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).symlink_to(src / rel)
        self.store = ArtifactStore(str(dest))
        rows.save(self.store)
        self.rows, self.project, self.training = rows, project, training
        self.target = project.target()
        self.keys = [s.key for s in plan_shards(rows.num_rows, project.settings.shard_size)]
        self.extractor = HFExtractor(self.target, batch_tokens=project.settings.extraction.batch_tokens, device="cpu")
        self.peak = 0

    def extract_and_check(self, key: str) -> None:
        settings = self.project.settings
        shard = Shard.parse(key)
        extract_shard(self.store, self.rows, shard, self.extractor, settings.extraction, model_name=self.project.model_name)
        report = check_shard(
            self.store, self.rows, shard, hidden_size=self.target.hidden_size, aux_layer_ids=self.target.aux_layer_ids,
            dtype=settings.extraction.storage_dtype, model=self.project.model_name,
        )  # fmt: skip
        if not report.ok:
            raise RuntimeError(report.summary())
        write_check_record(self.store, key, passed=True, problems=0)
        self.peak = max(self.peak, self.bytes_on_disk())

    def bytes_on_disk(self) -> int:
        return sum(self.store.size(f) for k in self.keys for f in sample_files(self.store, k))

    def train(self) -> Path:
        r = train_drafter(
            self.store, self.keys, vmap=VocabMap.load(self.store), target=self.target, settings=self.training,
            resume=False, log=lambda _m: None,
        )  # fmt: skip
        export_drafter(self.store, r.model.trainable_state_dict(), r.config, aux_layer_ids=r.aux_layer_ids)
        log(f"trained {r.step} steps; held-out acc_0 {r.heldout['acc_0']:.4f}")
        return self.store.local_path(EXPORT_DIR)


def run_offline(side: Side) -> tuple[Path, float, int]:
    start = time.monotonic()
    for key in side.keys:
        side.extract_and_check(key)
    total = side.bytes_on_disk()
    log(f"offline: {len(side.keys)} shards extracted, {total:,} bytes, {time.monotonic() - start:.0f} s; training")
    return side.train(), time.monotonic() - start, total


def run_rolling(side: Side, window: int) -> tuple[Path, float]:
    start = time.monotonic()
    out: dict = {}

    def trainer() -> None:
        try:
            out["export"] = side.train()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e

    thread = threading.Thread(target=trainer)
    thread.start()
    while thread.is_alive():
        for key in Window.read(side.store, side.keys, window).admitted():
            if not side.store.exists(f"hidden_states/{key}/_SUCCESS.json"):
                side.extract_and_check(key)
        side.peak = max(side.peak, side.bytes_on_disk())
        time.sleep(0.2)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["export"], time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-rolling"))
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160, help="decode length of the served comparison")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    project = demo_store(args.work / "demo")
    demo = project.settings.training
    offline_recipe = TrainingSettings.model_validate(demo.model_dump() | {"epochs": 1.0})
    rolling_recipe = TrainingSettings.model_validate(
        demo.model_dump() | {"epochs": 1.0, "mode": "rolling", "window_shards": args.window}
    )
    rows = TokenizedSet.load(project.store).shuffled(demo.seed)  # what `tokenized` writes in rolling mode

    offline = Side(project, rows, args.work / "offline", offline_recipe)
    offline_export, offline_wall, all_bytes = run_offline(offline)
    rolling = Side(project, rows, args.work / "rolling", rolling_recipe)
    rolling_export, rolling_wall = run_rolling(rolling, args.window)

    served = serve(project.target(), project, {"offline": offline_export, "rolling": rolling_export}, args.max_tokens)
    n = len(offline.keys)
    result = {
        "shards": n,
        "window": args.window,
        "all_shards_bytes": all_bytes,
        "rolling_peak_bytes": rolling.peak,
        "peak_over_all": round(rolling.peak / all_bytes, 4),
        "goal_peak_over_all": round((args.window + 1) / n, 4),
        "offline_wall_s": round(offline_wall, 1),
        "rolling_wall_s": round(rolling_wall, 1),
        "wall_rolling_over_offline": round(rolling_wall / offline_wall, 3),
        **{
            f"acceptance_{k}_rolling_over_offline": round(
                served["rolling"][k]["mean_acceptance_length"] / served["offline"][k]["mean_acceptance_length"], 4
            )
            for k in ("k3", "k7")
        },
        "served": served,
    }
    print(json.dumps(result, indent=2))
    (args.work / "result.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
