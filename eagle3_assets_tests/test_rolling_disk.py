"""Rolling mode on a disk that fills (issue 52, item 10): the preflight counts all a rolling run will write before a
release frees anything, and a release on a full disk frees the shard before it writes more than its record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_assets.drafter.data import SampleRef
from eagle3_assets.drafter.rolling import HELDOUT_DIR, REPLAY_DIR, RollingPlan, ShardWindow, rolling_disk_needs
from eagle3_assets.hidden_states.shard import InsufficientSpaceError, plan_shard
from eagle3_assets.sample_file import SampleSpec, sample_path
from eagle3_assets.shard_window import Window, read_consumed, sample_files
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore

from .test_hidden_states import AUX, H, LENGTHS, MODEL_NAME, make_tokenized, settings


def test_rolling_disk_preflight_counts_the_other_admitted_shards_the_reservoir_and_a_checkpoint(tmp_path: Path):
    """A rolling run's disk must take more than the shard at hand before a release frees any of it: the preflight
    that checked the one shard let extraction fill the disk (issue 52, item 10)."""
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    keys = [s.key for s in plan_shards(len(LENGTHS), 4)]  # rows_0-4, rows_4-8, rows_8-12
    spec = SampleSpec(H, tuple(AUX), "bfloat16", MODEL_NAME)
    store.write_bytes(sample_path(keys[1], 5), b"x")  # of rows_4-8, rows 4, 6, 7 are missing; all of rows_8-12
    store.write_bytes(f"{REPLAY_DIR}/3.safetensors", b"x")  # 1 of 3 reservoir rows kept
    store.write_bytes("drafter/checkpoints/step_4/model.safetensors", b"w" * 1000)
    store.write_bytes("drafter/checkpoints/step_4/state.json", b"s" * 24)
    window = Window.read(store, keys, 3)
    beside = rolling_disk_needs(store, tok, window, keys[0], spec, reservoir_rows=3)
    rows = [4, 6, 7, 8, 9, 10, 11]
    shards = spec.projected_bytes(sum(LENGTHS[r] for r in rows), len(rows))
    reservoir = spec.projected_bytes(sum(LENGTHS) * 2 // len(LENGTHS), 2)
    assert beside == [
        ("7 rows of the other admitted shards (rows_4-8, rows_8-12)", shards),
        ("2 rows drafter/replay/ has yet to keep (training.replay_reservoir_rows=3, 1 kept)", reservoir),
        ("a checkpoint of eagle3 (as large as drafter/checkpoints/step_4)", 1024),
    ]
    projected = spec.projected_bytes(55, 4)
    total = projected + shards + reservoir + 1024
    with pytest.raises(InsufficientSpaceError) as e:
        plan_shard(store, tok, Shard(0, 4), spec, settings(disk_margin=0.0), max_context=64, free_bytes=total - 1, beside=beside)
    assert str(e.value) == (
        f"shard rows_0-4: not enough free space on {store.url_of('hidden_states/rows_0-4')}: needs 0.00 GB ({total:,} "
        f"bytes: 55 remaining tokens x {spec.bytes_per_token} bytes (4 x hidden 64 in bfloat16, ids, mask) + 4 files x "
        f"{spec.file_overhead(13)} header bytes = {projected:,} bytes; + {shards:,} bytes for 7 rows of the other "
        f"admitted shards (rows_4-8, rows_8-12); + {reservoir:,} bytes for 2 rows drafter/replay/ has yet to keep "
        f"(training.replay_reservoir_rows=3, 1 kept); + 1,024 bytes for a checkpoint of eagle3 (as large as "
        f"drafter/checkpoints/step_4); = {total:,} bytes, plus 0% margin), free 0.00 GB ({total - 1:,} bytes)"
    )
    plan = plan_shard(store, tok, Shard(0, 4), spec, settings(disk_margin=0.0), max_context=64, free_bytes=total, beside=beside)
    assert plan.todo == [0, 1, 2, 3]


def test_a_consumed_shard_on_a_full_disk_is_released_its_kept_rows_moved_not_copied(small_tmpfs: Path):
    """The disk filled by extraction, one page left: the releasing trainer's copies of the reservoir and held-out rows
    failed there every time, before the release that frees the shard; they are moved now."""
    store = ArtifactStore(small_tmpfs)
    key = "rows_0-6"
    refs = [SampleRef(key, r, 8) for r in range(6)]
    for r in range(6):
        store.write_bytes(sample_path(key, r), bytes([r]) * 8192)
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize - 4096))
    plan = RollingPlan(
        keys=(key,), train=(tuple(refs[1:]),), heldout=(SampleRef(key, 0, 8, copied_to=HELDOUT_DIR),),
        keep=((refs[2], refs[4]),),
    )  # fmt: skip
    lines: list[str] = []
    window = ShardWindow(store, plan, is_main=True, poll_s=0.01, wait_s=1.0, log=lines.append)
    window.consumed(0, 3)
    assert sample_files(store, key) == []
    assert store.read_bytes(f"{HELDOUT_DIR}/0.safetensors") == bytes([0]) * 8192
    assert {n: store.read_bytes(f"{REPLAY_DIR}/{n}") for n in store.listdir(REPLAY_DIR)} == {
        "2.safetensors": bytes([2]) * 8192, "4.safetensors": bytes([4]) * 8192
    }
    record = read_consumed(store)[key]
    assert (record.released, record.bytes_released, record.step) == (True, 3 * 8192, 3)
    assert lines == [f"drafter: shard {key} consumed at step 3; released 24,576 bytes"]
