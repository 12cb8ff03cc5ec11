"""Rolling-window training (`training.mode: rolling`): shards trained as they land on a store that
cannot hold them all, released only after a checkpoint has learnt them, and exactly once through
a kill anywhere, proved with the per-sample ledger the checkpoints carry."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load_file

from eagle3_assets.crash_points import CRASH_ENV
from eagle3_assets.drafter.checkpoint import list_checkpoints, read_checkpoint_state
from eagle3_assets.drafter.family import DFlash
from eagle3_assets.drafter.rolling import HELDOUT_DIR, RollingPlan, ShardFailedError, ShardWindow
from eagle3_assets.drafter.train import TrainResult, train_drafter
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.integrity import check_shard
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.sample_file import check_record_path, manifest_path, sample_path, shard_dir
from eagle3_assets.settings import DFlashSettings, ExtractionSettings, TrainingSettings
from eagle3_assets.shard_window import (
    Window,
    check_verdict,
    read_consumed,
    read_consumed_one,
    read_consumption,
    sample_files,
    write_check_record,
)
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet

from .helpers import AUX_IDS, greedy_vocab_map, random_rows, release_the_export, target_of, tiny_llama

pytestmark = pytest.mark.slow  # trains drafters

ROWS, SHARD_ROWS = 48, 6  # eight shards
EXTRACTION = ExtractionSettings(batch_tokens=256, storage_dtype="float32")
ROLLING = TrainingSettings(
    mode="rolling", window_shards=2, ttt_steps=3, lr=3e-3, warmup_steps=2, batch_tokens=24, checkpoint_every=3,
    heldout_rows=2, seed=0, sample_ledger=True,
)  # fmt: skip
DFLASH = DFlashSettings(block_size=3, anchors_per_row=4, num_layers=1)  # the second family, as small as the first
FAMILIES = ("eagle3", "dflash")


class CappedFileSystem(LocalFileSystem):
    """A local filesystem that refuses (ENOSPC) to open a file for writing under `hidden_states/` once the
    sample files there hold `cap` bytes: a disk that fits about three shards."""

    protocol = "capped"
    cap = 0

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and "/hidden_states/" in str(path):
            root = str(path).split("/hidden_states/")[0] + "/hidden_states"
            used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
            if used >= type(self).cap:
                raise OSError(errno.ENOSPC, f"capped store: {used} bytes of hidden states, the cap is {self.cap}", path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("capped", CappedFileSystem, clobber=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, 48 rows in eight 6-row shards, their tokenized set and a vocab map."""
    root = tmp_path_factory.mktemp("rolling")
    model = tiny_llama(root / "target")
    rows = random_rows(ROWS, seed=3, min_len=8, max_len=16)
    keys = [s.key for s in plan_shards(ROWS, SHARD_ROWS)]
    return root, model, rows, keys, greedy_vocab_map(model, rows)


def new_store(world, url: str) -> ArtifactStore:
    _, _, rows, _, _ = world
    store = ArtifactStore(url)
    TokenizedSet.from_rows(rows, list(range(ROWS))).save(store)
    return store


def check(store: ArtifactStore, tset: TokenizedSet, key: str) -> None:
    """The blocking check, as the `shard_integrity` asset check runs it, and its record."""
    report = check_shard(
        store, tset, Shard.parse(key), hidden_size=64, aux_layer_ids=AUX_IDS, dtype="float32", model="tiny-llama"
    )
    assert report.ok, report.summary()
    write_check_record(store, key, passed=True, problems=0)


def hidden_state_bytes(store: ArtifactStore, keys: list[str]) -> int:
    return sum(store.size(f) for k in keys for f in sample_files(store, k))


def test_rolling_window_trains_eight_shards_on_a_store_capped_at_three(world, tmp_path):
    root, _, _, keys, vmap = world
    target = target_of(root / "target")
    extraction = EXTRACTION
    extractor = HFExtractor(target, batch_tokens=256, device="cpu")

    # Each shard's bytes, measured on a scratch store, size the cap: the three largest shards.
    scratch = new_store(world, str(tmp_path / "scratch"))
    tset = TokenizedSet.load(scratch)
    for key in keys:
        extract_shard(scratch, tset, Shard.parse(key), extractor, extraction, model_name="tiny-llama")
    sizes = [hidden_state_bytes(scratch, [k]) for k in keys]
    CappedFileSystem.cap = sum(sorted(sizes)[-3:])
    assert CappedFileSystem.cap < sum(sizes) / 2

    # The cap is real: extracting everything up front fails halfway.
    full = new_store(world, f"capped://{tmp_path / 'up-front'}")
    with pytest.raises(Exception, match="cannot write") as refused:
        for key in keys:
            extract_shard(full, tset, Shard.parse(key), extractor, extraction, model_name="tiny-llama")
    assert any(k in str(refused.value) for k in keys[3:6]), str(refused.value)

    store = new_store(world, f"capped://{tmp_path / 'rolling'}")
    events: list[dict] = []
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = train_drafter(
                store, keys, vmap=vmap, target=target, settings=ROLLING, log=lambda _: None, on_shard=events.append
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            outcome["error"] = e

    trainer = threading.Thread(target=train)
    trainer.start()
    peak, extracted = 0, []
    deadline = time.monotonic() + 600
    # The extraction side, as the backfill automation drives it: only shards the window admits.
    while trainer.is_alive() and time.monotonic() < deadline:
        for key in Window.read(store, keys, ROLLING.window_shards).admitted():
            if not store.exists(manifest_path(key)):
                extract_shard(store, tset, Shard.parse(key), extractor, extraction, model_name="tiny-llama")
                check(store, tset, key)
                extracted.append(key)
                peak = max(peak, hidden_state_bytes(store, keys))
        time.sleep(0.05)
    trainer.join(timeout=60)

    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.finished and result.step == result.total_steps
    assert extracted == keys  # in training order, each once
    # At most W complete shards on disk (measured after each shard is written): the cap was never reached.
    assert peak <= max(a + b for a, b in zip(sizes, sizes[1:], strict=False)) < CappedFileSystem.cap
    consumed = read_consumed(store)
    assert sorted(consumed) == sorted(keys) and all(c.released for c in consumed.values())
    assert [c.step for c in sorted(consumed.values(), key=lambda c: keys.index(c.shard))] == sorted(
        c.step for c in consumed.values()
    )
    assert consumed[keys[-1]].step == result.total_steps
    assert hidden_state_bytes(store, keys) == 0  # every shard released; its manifest and check record stay
    assert all(store.exists(manifest_path(k)) for k in keys)
    assert sorted(os.listdir(tmp_path / "rolling" / HELDOUT_DIR)) == sorted(
        f"{r.row}.safetensors" for r in RollingPlan.from_tokenized(tset, keys, heldout_rows=2, seed=0).heldout
    )
    assert [(e["shard"], e["state"]) for e in events] == [(k, s) for k in keys for s in ("training", "released")]
    assert set(result.heldout) >= {"loss", "acc_0"}


RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from eagle3_assets.drafter.train import train_drafter
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.storage import ArtifactStore
    from eagle3_assets.target import TargetModel
    from eagle3_assets.vocab_map import VocabMap

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # exact across processes: see test_drafter_train.train_in_subprocess
    settings = TrainingSettings(**args["settings"])
    family = None
    if args["family"] == "dflash":
        from eagle3_assets.drafter.family import DFlash
        from eagle3_assets.settings import DFlashSettings

        family = DFlash(settings, DFlashSettings(**args["dflash"]), mask_token_id=0)
    r = train_drafter(
        ArtifactStore(args["store"]), args["keys"], vmap=VocabMap(np.array(args["d2t"]), np.array(args["t2d"])),
        target=TargetModel.read(args["target"], aux_layer_ids=[1, 2, 3]), settings=settings,
        log=lambda _: None, family=family, window_families=args["families"],
    )
    print(json.dumps({"step": r.step, "total": r.total_steps, "resumed_from": r.resumed_from}))
    """
)


def run_trainer(
    world, tmp_path: Path, store_dir: Path, crash_at: str | None = None, family: str = "eagle3",
    families: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:  # fmt: skip
    """`family`'s rolling trainer in a process of its own; a shard is released once every one of `families` consumed
    it (`family` alone when empty)."""
    root, _, _, keys, vmap = world
    script = tmp_path / "rolling_run.py"
    script.write_text(RUN)
    args = {
        "store": str(store_dir), "keys": keys, "d2t": vmap.d2t.tolist(), "t2d": vmap.t2d.tolist(),
        "target": str(root / "target"), "settings": ROLLING.model_dump(), "family": family,
        "dflash": DFLASH.model_dump(), "families": list(families),
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV} | ({CRASH_ENV: crash_at} if crash_at else {})
    return subprocess.run(
        [sys.executable, str(script), json.dumps(args)], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.fixture(scope="module")
def extracted(world, tmp_path_factory):
    """All eight shards written and checked (the trainer's side is what these tests kill)."""
    root, _, _, keys, _ = world
    out = tmp_path_factory.mktemp("extracted")
    store = new_store(world, str(out))
    tset = TokenizedSet.load(store)
    extractor = HFExtractor(target_of(root / "target"), batch_tokens=256, device="cpu")
    for key in keys:
        extract_shard(store, tset, Shard.parse(key), extractor, EXTRACTION, model_name="tiny-llama")
        check(store, tset, key)
    return out


def assert_release_invariants(store: ArtifactStore, keys: list[str]) -> None:
    """A shard is never deleted without its record; a record never exists without its checkpoint."""
    consumed = read_consumed(store)
    newest = max(list_checkpoints(store), default=0)
    for k, key in enumerate(keys):
        if len(sample_files(store, key)) < SHARD_ROWS:
            assert key in consumed, f"{key} lost files without a consumed record"
    for record in consumed.values():
        assert record.step <= newest, f"{record.shard} recorded at step {record.step}, newest checkpoint {newest}"


def final_ledger(store_dir: Path, root: str = "") -> tuple[list[list], dict[str, torch.Tensor]]:
    """The newest checkpoint's ledger and weights, of the family whose outputs are under `root`."""
    store = ArtifactStore(store_dir).child(root)
    newest = list_checkpoints(store)[-1]
    rel = f"drafter/checkpoints/step_{newest}"
    return read_checkpoint_state(store, rel).state["ledger"], load_file(str(store.local_path(f"{rel}/model.safetensors")))


def test_every_sample_is_trained_exactly_once_through_kills_anywhere(world, extracted, tmp_path):
    import shutil

    _, _, _, keys, _ = world
    clean_dir, killed_dir = tmp_path / "clean", tmp_path / "killed"
    shutil.copytree(extracted, clean_dir)
    shutil.copytree(extracted, killed_dir)

    clean = run_trainer(world, tmp_path, clean_dir)
    assert clean.returncode == 0, clean.stderr[-3000:]
    total = json.loads(clean.stdout.strip().splitlines()[-1])["total"]

    bounds = {c.shard: c.step for c in read_consumed(ArtifactStore(clean_dir)).values()}
    # Mid-shard: a step inside the second shard, past a periodic checkpoint, so the rerun resumes inside it.
    mid = next(
        s for s in range(bounds[keys[0]] + 2, bounds[keys[1]]) if (s - 1) % ROLLING.checkpoint_every == 0
    )
    store = ArtifactStore(killed_dir)
    # Then between the second shard's last checkpoint and its record, and between the third's record and
    # its deletion.
    for crash in (f"step:{mid}", f"checkpointed:{keys[1]}", f"recorded:{keys[2]}"):
        proc = run_trainer(world, tmp_path, killed_dir, crash_at=crash)
        assert proc.returncode == -9, (crash, proc.returncode, proc.stderr[-2000:])
        assert_release_invariants(store, keys)
    consumed = read_consumed(store)
    assert keys[2] in consumed and not consumed[keys[2]].released  # killed between record and delete
    assert len(sample_files(store, keys[2])) == SHARD_ROWS

    done = run_trainer(world, tmp_path, killed_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["step"] == out["total"] == total and out["resumed_from"] is not None
    assert all(c.released for c in read_consumed(store).values()) and len(read_consumed(store)) == len(keys)

    ledger, weights = final_ledger(killed_dir)
    clean_ledger, clean_weights = final_ledger(clean_dir)
    assert [s for s, _ in ledger] == list(range(1, total + 1))  # every step once, in order
    trained = Counter(r for _, rows in ledger for r in rows)
    tset = TokenizedSet.load(store)
    held = {r.row for r in RollingPlan.from_tokenized(tset, keys, heldout_rows=2, seed=0).heldout}
    assert trained == Counter(r for r in range(ROWS) if r not in held)  # each training sample exactly once
    assert ledger == clean_ledger  # the same batches at the same steps as a run never killed
    assert clean_weights.keys() == weights.keys()
    for name, t in clean_weights.items():
        assert torch.equal(weights[name], t), name  # bit for bit: nothing lost, repeated or reset


def test_sample_files_lost_after_the_check_stop_training_at_their_shard_before_it_is_trained(world, extracted, tmp_path):
    import shutil

    _, _, _, keys, _ = world
    shutil.copytree(extracted, tmp_path / "store")
    store = ArtifactStore(tmp_path / "store")
    plan = RollingPlan.from_tokenized(TokenizedSet.load(store), keys, heldout_rows=2, seed=0)
    window = ShardWindow(store, plan, True, poll_s=0.01, wait_s=5.0, log=lambda _: None)
    assert window.wait_for(1).hidden_size == 64
    store.remove(sample_path(keys[1], 8))
    with pytest.raises(ShardFailedError) as e:
        window.wait_for(1)
    assert str(e.value) == (
        f"shard rows_6-12 (#2 of 8 in training order) lost sample files after its integrity check passed: 1 of 6 "
        f"sample files are gone, the first {store.url_of('hidden_states/rows_6-12/8.safetensors')}. It now reads as "
        "failed: training stops at it, and no later shard is trained before it. Materialize the shard again (its "
        "missing rows are extracted), then materialize `drafter`"
    )
    assert not e.value.retryable and check_verdict(store, keys[1]) == "failed"
    # A file cut short: the sizes no longer add up to the manifest's.
    recorded = store.read_json(manifest_path(keys[2]))["bytes"]
    store.write_bytes(sample_path(keys[2], 12), store.read_bytes(sample_path(keys[2], 12))[:-10])
    with pytest.raises(ShardFailedError, match=rf"its sample files hold {recorded - 10:,} bytes, its manifest recorded {recorded:,}: "):
        window.wait_for(2)


# -- two drafter families from one window (issue 43) ----------------------------------------------------------------


def copy_shard(source: ArtifactStore, store: ArtifactStore, key: str) -> None:
    """Extraction and its check, standing in: the shard as the `extracted` fixture made it, its sample files first,
    then its manifest, then its check record (the order extraction and the check write them)."""
    last = [manifest_path(key), check_record_path(key)]
    for name in source.sizes(shard_dir(key)):
        if (rel := f"{shard_dir(key)}/{name}") not in last:
            store.write_bytes(rel, source.read_bytes(rel))
    for rel in last:
        store.write_bytes(rel, source.read_bytes(rel))


def assert_released_only_once_both_consumed(store: ArtifactStore, keys: list[str]) -> None:
    """No shard lost a file before both families recorded it; no family's record without its checkpoint."""
    for key in keys:
        if len(sample_files(store, key)) < SHARD_ROWS:
            assert [f for f in FAMILIES if read_consumed_one(store, key, f) is None] == [], key
    for family, root in zip(FAMILIES, ("", "families/dflash"), strict=True):
        newest = max(list_checkpoints(store.child(root)), default=0)
        for record in read_consumed(store, family).values():
            assert record.step <= newest, (family, record)


def assert_each_row_trained_once_per_family(store_dir: Path, keys: list[str], totals: dict[str, int]) -> None:
    held = {
        r.row for r in RollingPlan.from_tokenized(TokenizedSet.load(ArtifactStore(store_dir)), keys, heldout_rows=2, seed=0).heldout
    }
    for family, root in zip(FAMILIES, ("", "families/dflash"), strict=True):
        ledger, _ = final_ledger(store_dir, root)
        assert [s for s, _ in ledger] == list(range(1, totals[family] + 1)), family  # every step once, in order
        assert Counter(r for _, rows in ledger for r in rows) == Counter(r for r in range(ROWS) if r not in held), family


def test_two_families_train_at_once_from_one_window_each_shard_released_once_both_consumed_it(world, extracted, tmp_path):
    root, _, _, keys, vmap = world
    target = target_of(root / "target")
    source = ArtifactStore(extracted)
    store = new_store(world, str(tmp_path / "store"))
    family = {"eagle3": None, "dflash": DFlash(ROLLING, DFLASH, mask_token_id=0)}
    events: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    outcome: dict[str, TrainResult | BaseException] = {}

    # A trainer left waiting by a failed assertion gives up soon, and dies with the test process.
    settings = ROLLING.model_copy(update={"shard_wait_s": 60.0})

    def train(name: str) -> None:
        try:
            outcome[name] = train_drafter(
                store, keys, vmap=vmap, target=target, settings=settings, log=lambda _: None,
                on_shard=events[name].append, family=family[name], window_families=FAMILIES,
            )  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            outcome[name] = e

    trainers = [threading.Thread(target=train, args=(f,), daemon=True) for f in FAMILIES]
    for t in trainers:
        t.start()
    copied: list[str] = []
    most_on_disk = 0
    deadline = time.monotonic() + 900
    # The extraction side, as the backfill automation drives it: only shards the window of both families admits.
    while any(t.is_alive() for t in trainers) and time.monotonic() < deadline:
        for key in Window.read(store, keys, ROLLING.window_shards, FAMILIES).admitted():
            if key not in copied:
                copy_shard(source, store, key)
                copied.append(key)
        on_disk = [k for k in keys if sample_files(store, k)]
        assert_released_only_once_both_consumed(store, copied)
        # The window bound: the shards on disk that some family has still to consume are at most W, and beside
        # them at most the one being released.
        window = Window.read(store, keys, ROLLING.window_shards, FAMILIES)
        assert len([k for k in on_disk if not window.done(k)]) <= ROLLING.window_shards, on_disk
        most_on_disk = max(most_on_disk, len(on_disk))
        time.sleep(0.02)
    for t in trainers:
        t.join(timeout=60)

    assert not [e for e in outcome.values() if isinstance(e, BaseException)], outcome
    assert copied == keys  # in training order, each once
    assert most_on_disk <= ROLLING.window_shards + 1
    consumption = read_consumption(store, FAMILIES)
    assert sorted(consumption) == sorted(keys)
    assert all(c.complete and c.released for c in consumption.values())
    assert hidden_state_bytes(store, keys) == 0  # every shard released; its manifest and check record stay
    assert store.exists("families/dflash/drafter/window/rows_0-6.json") and store.exists("drafter/window/rows_0-6.json")
    for name in FAMILIES:
        result = outcome[name]
        assert result.finished and result.step == result.total_steps and set(result.heldout) >= {"loss", "acc_0"}
        assert [e["shard"] for e in events[name] if e["state"] == "training"] == keys
    # Each shard was released by whichever family consumed it last (both, when they finished it at the same moment).
    for key in keys:
        states = {e["state"] for f in FAMILIES for e in events[f] if e["shard"] == key and e["state"] != "training"}
        assert "released" in states and states <= {"consumed", "released"}, (key, states)
    # The held-out copies served both families: one copy of each held-out row.
    assert sorted(os.listdir(tmp_path / "store" / HELDOUT_DIR)) == sorted(
        f"{r.row}.safetensors"
        for r in RollingPlan.from_tokenized(TokenizedSet.load(store), keys, heldout_rows=2, seed=0).heldout
    )
    totals = {name: outcome[name].total_steps for name in FAMILIES}
    assert_each_row_trained_once_per_family(tmp_path / "store", keys, totals)


def test_two_families_killed_anywhere_train_every_sample_once_each_and_nothing_is_released_before_both_consumed_it(
    world, extracted, tmp_path
):
    import shutil

    _, _, _, keys, _ = world
    store_dir = tmp_path / "store"
    shutil.copytree(extracted, store_dir)
    store = ArtifactStore(store_dir)

    def trainer(name: str, crash: str | None = None) -> subprocess.CompletedProcess:
        return run_trainer(world, tmp_path, store_dir, crash_at=crash, family=name, families=FAMILIES)

    def whole() -> list[bool]:
        return [len(sample_files(store, k)) == SHARD_ROWS for k in keys]

    # DFlash first, killed after recording the second shard, before it looked for EAGLE-3's records: EAGLE-3 has
    # consumed nothing, so nothing is released.
    proc = trainer("dflash", f"recorded:{keys[1]}")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(read_consumed(store, "dflash")) == keys[:2] and read_consumed(store, "eagle3") == {}
    assert whole() == [True] * 8
    # EAGLE-3, killed between the third shard's checkpoint and its record: it released the two shards DFlash had
    # consumed as it consumed them, and nothing after.
    proc = trainer("eagle3", f"checkpointed:{keys[2]}")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(read_consumed(store, "eagle3")) == keys[:2] and all(c.released for c in read_consumed(store).values())
    assert whole() == [False] * 2 + [True] * 6
    assert_released_only_once_both_consumed(store, keys)
    # The runs that are not killed train here (a process each costs more than their training).
    root, _, _, _, vmap = world
    target = target_of(root / "target")

    def resumed(name: str) -> TrainResult:
        family = DFlash(ROLLING, DFLASH, mask_token_id=0) if name == "dflash" else None
        return train_drafter(
            store, keys, vmap=vmap, target=target, settings=ROLLING, log=lambda _: None, family=family,
            window_families=FAMILIES,
        )  # fmt: skip

    # EAGLE-3 to the end: DFlash has not consumed the rest, so every one of them stays on disk.
    eagle3 = resumed("eagle3")
    assert eagle3.resumed_from is not None and eagle3.finished
    assert sorted(read_consumed(store, "eagle3")) == sorted(keys)
    assert whole() == [False] * 2 + [True] * 6
    assert_released_only_once_both_consumed(store, keys)
    # DFlash resumes after its second shard (released meanwhile: it reads the held-out copies) and releases each
    # shard as it consumes it.
    dflash = resumed("dflash")
    assert dflash.resumed_from is not None and dflash.finished and set(dflash.heldout) >= {"loss", "acc_0"}
    consumption = read_consumption(store, FAMILIES)
    assert sorted(consumption) == sorted(keys) and all(c.complete and c.released for c in consumption.values())
    assert hidden_state_bytes(store, keys) == 0
    assert_each_row_trained_once_per_family(
        store_dir, keys, {"eagle3": eagle3.total_steps, "dflash": dflash.total_steps}
    )


# -- appended rows continue the release, with no hand work (issue 45, item 3) ----------------------------------------


def train_beside_extraction(
    store: ArtifactStore, source: ArtifactStore, keys: list[str], train
) -> tuple[object, list[str]]:
    """`train()` in a thread while the extraction side, as the backfill drives it, puts in each shard of `keys` the
    window admits and that has no manifest (copied from `source`); the window bound is checked at every look.
    Returns what `train()` returned and the shards put in, in order."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = train()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    trainer = threading.Thread(target=run, daemon=True)
    trainer.start()
    copied: list[str] = []
    deadline = time.monotonic() + 600
    while trainer.is_alive() and time.monotonic() < deadline:
        window = Window.read(store, keys, ROLLING.window_shards)
        for key in window.admitted():
            if not store.exists(manifest_path(key)):
                copy_shard(source, store, key)
                copied.append(key)
        window = Window.read(store, keys, ROLLING.window_shards)
        assert len([k for k in keys if sample_files(store, k) and not window.done(k)]) <= ROLLING.window_shards
        time.sleep(0.02)
    trainer.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    return outcome["result"], copied


def test_a_rolling_append_continues_the_release_on_the_new_shards_once_and_a_model_change_retrains_by_itself(
    world, extracted, tmp_path
):

    from eagle3_assets.drafter.continuation import continuation_plan, read_release
    from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
    from eagle3_assets.drafter.rolling import REPLAY_DIR
    from eagle3_assets.drafter.run import train_and_export

    from .conftest import tiny_settings

    root, _, _, keys, vmap = world
    target = target_of(root / "target")
    source = ArtifactStore(extracted)
    store = new_store(world, str(tmp_path / "store"))
    vmap.save(store)
    bound = 8
    training = ROLLING.model_copy(update={"replay_reservoir_rows": bound, "shard_wait_s": 60.0, "device": "cpu"})
    settings = tiny_settings(shard_size=SHARD_ROWS, training=training)
    old, new = keys[:6], keys[6:]  # the release's 36 rows, then 12 appended rows in two new shards
    tset = TokenizedSet.load(store)

    def ledger_rows(result: TrainResult) -> Counter:
        return Counter(r for _, rows in read_checkpoint_state(store, result.checkpoint).state["ledger"] for r in rows)

    first, copied = train_beside_extraction(
        store, source, old, lambda: train_and_export(store, target, settings, old, log=lambda _: None)
    )
    assert first.summary["trained"] == "from scratch: nothing is released" and copied == old
    plan = RollingPlan.from_tokenized(tset, old, heldout_rows=2, seed=0, reservoir_rows=bound)
    held = {r.row for r in plan.heldout}
    # The reservoir: `bound` rows in all, a share of each released shard, none held out.
    kept = {r.row for rows in plan.keep for r in rows}
    assert len(kept) == bound and not kept & held
    assert sorted(os.listdir(tmp_path / "store" / REPLAY_DIR)) == sorted(f"{r}.safetensors" for r in kept)
    assert hidden_state_bytes(store, old) == 0  # every old shard released

    sha, released = release_the_export(store)

    # Before its first step, the continuation's model is the release's weights (its first new shard put in, as the
    # window admits it).
    on = store.read_json(f"{EXPORT_DIR}/{TRAINED_ON_FILE}")
    cont = continuation_plan(*read_release(store), {**on, "shards": {k: "none" for k in keys}})
    assert (cont.continues, cont.old_shards, cont.new_shards) == (True, old, new)
    assert Window.read(store, keys, ROLLING.window_shards).admitted() == new
    copy_shard(source, store, new[0])
    start = train_drafter(store, keys, vmap=vmap, target=target, settings=training, continuation=cont, max_steps=0,
                          resume=False, log=lambda _: None)  # fmt: skip
    for name, tensor in start.model.trainable_state_dict().items():
        assert torch.equal(tensor.float(), released[name]), name

    logs: list[str] = []
    second, copied = train_beside_extraction(
        store, source, keys, lambda: train_and_export(store, target, settings, keys, log=logs.append)
    )
    assert copied == new[1:]  # the old shards are not extracted again
    c = second.result.continued
    continued_plan = RollingPlan.from_tokenized(tset, new, heldout_rows=2, seed=0, reservoir_rows=bound, after=old)
    replayed = {r.row for r in continued_plan.kept_before}
    assert c is not None and (c.release_sha256, c.new_rows, c.replayed) == (sha, 12, len(replayed))
    assert 0 < len(replayed) < bound and replayed <= kept
    assert second.summary["trained"] == (
        f"continued from the release ({sha[:12]}) with 12 new rows and {len(replayed)} replayed, {c.steps} steps"
    )
    assert c.steps == second.result.total_steps == second.result.step < c.scratch_steps
    # Every new row once, every replayed row once: read from the reservoir, as the ledger of the pass shows.
    assert ledger_rows(second.result) == Counter([*range(36, 48), *replayed])
    assert hidden_state_bytes(store, keys) == 0 and all(r.released for r in read_consumed(store).values())
    # The reservoir still holds `bound` rows at most: the old shards' shares shrank, the new shards' were added.
    assert len(os.listdir(tmp_path / "store" / REPLAY_DIR)) <= bound

    # A loss change retrains from scratch: the run clears the window records itself, and every shard is extracted
    # again, in order, within the window; each training row is trained once.
    lk = settings.model_copy(update={"training": training.model_copy(update={"loss": "kl"})})
    logs.clear()
    third, copied = train_beside_extraction(
        store, source, keys, lambda: train_and_export(store, target, lk, keys, log=logs.append)
    )
    assert third.summary["trained"] == "from scratch: settings.training.loss: release 'soft_ce', now 'kl'"
    assert copied == keys
    cleared = "8 of its shards were consumed by another run"
    assert any(cleared in line and "window records are cleared" in line for line in logs), logs
    assert ledger_rows(third.result) == Counter(r for r in range(ROWS) if r not in held)
    assert hidden_state_bytes(store, keys) == 0 and all(r.released for r in read_consumed(store).values())
