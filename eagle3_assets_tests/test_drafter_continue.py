"""New rows continue the released drafter instead of restarting it (issue 45): the decision over its cases, and one
continuation at the smallest size, through `train_and_export` and a real `promote`."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest
import torch

from eagle3_assets.drafter.checkpoint import read_checkpoint_state
from eagle3_assets.drafter.continuation import ContinuationPlan, continuation_plan, read_release
from eagle3_assets.drafter.distributed import DistEnv
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
from eagle3_assets.drafter.release import RELEASE_DIR
from eagle3_assets.drafter.run import train_and_export
from eagle3_assets.drafter.sources import continuation_steps, continued_data
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.release_record import ReleaseRecord
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings
from .helpers import greedy_vocab_map, random_rows, release_the_export, target_of, tiny_llama, write_shard

SETTINGS = {"family": {}, "training": {"loss": "soft_ce", "ttt_steps": 3}, "aux_layer_ids": [1, 2, 3]}
RELEASED_ON = {
    "family": "eagle3", "target": "t1", "vocab_map": "v1", "settings": SETTINGS,
    "shards": {"rows_0-16": "a", "rows_16-32": "b"}, "continued_from": None,
}  # fmt: skip
RELEASE = ReleaseRecord(family="eagle3", target="t1", export_sha256="f" * 64)


def now(**changes) -> dict:
    return {**RELEASED_ON, "shards": {**RELEASED_ON["shards"], "rows_32-48": "c"}, **changes}


def test_an_append_continues_and_every_other_difference_trains_from_scratch_naming_it():
    assert continuation_plan(RELEASE, RELEASED_ON, now()) == ContinuationPlan(
        True, "", "f" * 64, ["rows_0-16", "rows_16-32"], ["rows_32-48"]
    )
    cases = {
        "nothing is released": (None, None, now()),
        "the release has no trained_on.json (released before exports recorded what they were trained on)": (
            RELEASE, None, now()
        ),
        "family: release 'eagle3', now 'dflash'": (RELEASE, RELEASED_ON, now(family="dflash")),
        "target: release 't1', now 't2'": (RELEASE, RELEASED_ON, now(target="t2")),
        "vocab_map: release 'v1', now 'v2' (a head is never continued on a map it was not trained with)": (
            RELEASE, RELEASED_ON, now(vocab_map="v2")
        ),
        "settings.training.loss: release 'soft_ce', now 'kl'": (
            RELEASE, RELEASED_ON, now(settings={**SETTINGS, "training": {"loss": "kl", "ttt_steps": 3}})
        ),
        "settings.family.dflash: release None, now {'block_size': 8}": (
            RELEASE, RELEASED_ON, now(settings={**SETTINGS, "family": {"dflash": {"block_size": 8}}})
        ),
        # A prompt file edited in place changes the rows of a shard the release trained on: never an append.
        "shard rows_16-32: rows changed, not appended (rows digest: release b, now B)": (
            RELEASE, RELEASED_ON, now(shards={"rows_0-16": "a", "rows_16-32": "B", "rows_32-48": "c"})
        ),
        "shard rows_16-32: the release trained on it, it is no longer a shard": (
            RELEASE, RELEASED_ON, now(shards={"rows_0-16": "a", "rows_32-48": "c"})
        ),
        "no shard was added since the release": (RELEASE, RELEASED_ON, RELEASED_ON),
    }  # fmt: skip
    for reason, (release, released_on, current) in cases.items():
        assert continuation_plan(release, released_on, current) == ContinuationPlan(False, reason)


def test_in_rolling_mode_the_family_not_released_continues_its_own_export_and_extracts_nothing_again(tmp_path):
    """Issue 52, item 6: with two families in rolling mode, after an append the family that did not win the release
    trained from scratch: it cleared its window records, every released shard was extracted again, and the window
    (it admits a shard once every family consumed those before it) kept the continuing family's new shard out until
    that family failed after training.shard_wait_s. It now continues its own last export on the new shards alone."""
    from eagle3_assets.drafter.continuation import plan_continuation
    from eagle3_assets.release_record import RELEASE_RECORD
    from eagle3_assets.shard_window import Window, consumed_path, record_consumed

    store = ArtifactStore(tmp_path / "store")
    dflash_on = {**RELEASED_ON, "family": "dflash", "settings": {**SETTINGS, "family": {"dflash": {"block_size": 8}}}}
    store.write_json(RELEASE_RECORD, RELEASE.to_json())
    store.write_json(f"{RELEASE_DIR}/{TRAINED_ON_FILE}", RELEASED_ON)
    dflash_export = f"families/dflash/{EXPORT_DIR}"
    store.write_json(f"{dflash_export}/{TRAINED_ON_FILE}", dflash_on)
    store.write_bytes(f"{dflash_export}/model.safetensors", b"dflash weights")
    keys = [*RELEASED_ON["shards"], "rows_32-48"]
    for family in ("eagle3", "dflash"):  # the pass before the append: both consumed (and released) the old shards
        for key in keys[:2]:
            record_consumed(store, key, step=1, checkpoint="checkpoints/step_1", family=family)

    eagle3 = plan_continuation(store, now(), "", rolling=True)
    assert (eagle3.continues, eagle3.base, eagle3.old_shards, eagle3.new_shards) == (
        True, RELEASE_DIR, keys[:2], keys[2:]
    )  # fmt: skip
    dflash_now = {**dflash_on, "shards": now()["shards"]}
    dflash = plan_continuation(store, dflash_now, "families/dflash", rolling=True)
    assert dflash == ContinuationPlan(
        True, "", hashlib.sha256(b"dflash weights").hexdigest(), keys[:2], keys[2:], base=dflash_export
    )
    # Neither pass trains (nor clears the records of) an old shard: the window admits the new shard for both.
    assert all(store.exists(consumed_path(k, f)) for k in keys[:2] for f in ("eagle3", "dflash"))
    assert Window.read(store, keys, 2, ("eagle3", "dflash")).admitted() == keys[2:]
    # Offline, the shards are all on disk, and any other difference is as before: from scratch, naming the release.
    assert plan_continuation(store, dflash_now, "families/dflash", rolling=False) == ContinuationPlan(
        False, "family: release 'eagle3', now 'dflash'"
    )
    other = {**dflash_now, "settings": {**SETTINGS, "family": {"dflash": {"block_size": 4}}}}
    assert plan_continuation(store, other, "families/dflash", rolling=True) == ContinuationPlan(
        False, "family: release 'eagle3', now 'dflash'"
    )


@pytest.mark.slow  # trains three tiny drafters
def test_appended_shards_continue_the_released_drafter_on_new_and_replayed_rows_for_a_share_of_the_steps(tmp_path):
    model = tiny_llama(tmp_path / "target")
    target = target_of(tmp_path / "target")
    store = ArtifactStore(tmp_path / "store")
    rows = random_rows(32, seed=0, min_len=8, max_len=16)
    keys = [write_shard(store, model, rows[:16], 0), write_shard(store, model, rows[16:], 16)]
    greedy_vocab_map(model, rows).save(store)
    training = TrainingSettings(
        ttt_steps=3, lr=3e-3, warmup_steps=2, epochs=4.0, batch_tokens=96, checkpoint_every=100, heldout_rows=4,
        replay_rows=6, sample_ledger=True, device="cpu",
    )  # fmt: skip
    settings = tiny_settings(training=training)
    logs: list[str] = []

    first = train_and_export(store, target, settings, keys[:1], log=lambda _: None)
    assert first.summary["trained"] == "from scratch: nothing is released"
    on = store.read_json(f"{EXPORT_DIR}/{TRAINED_ON_FILE}")
    assert (on["family"], list(on["shards"]), on["continued_from"]) == ("eagle3", keys[:1], None)

    # The gate releases it (first release), copying every file of the export, trained_on.json too.
    sha, released = release_the_export(store)
    assert read_release(store)[1] == on

    # Before its first step, the continuation's model is the release's weights.
    plan = continuation_plan(*read_release(store), {**on, "shards": {k: "none" for k in keys}})
    assert plan.continues and plan.new_shards == keys[1:]
    start = train_drafter(store, keys, vmap=greedy_vocab_map(model, rows), target=target, settings=training,
                          continuation=plan, max_steps=0, resume=False, log=lambda _: None)  # fmt: skip
    # Issue 52, item 11: a release promoted since the plan was made is never warm-started from.
    with pytest.raises(TrainingError, match=rf"changed since this run planned to continue it \(sha256 {'0' * 64} then, "
                       rf"{sha} now\): not warm-started; a retry plans again"):  # fmt: skip
        train_drafter(store, keys, vmap=greedy_vocab_map(model, rows), target=target, settings=training,
                      continuation=replace(plan, release_sha256="0" * 64), max_steps=0, resume=False, log=lambda _: None)  # fmt: skip
    assert start.step == 0 and set(start.model.trainable_state_dict()) == set(released)
    for name, tensor in start.model.trainable_state_dict().items():
        assert torch.equal(tensor.float(), released[name]), name

    second = train_and_export(store, target, settings, keys, log=logs.append)
    c = second.result.continued
    assert c is not None and (c.release_sha256, c.new_rows, c.replayed) == (sha, 16, 6)
    assert c.steps == math.floor(0.25 * c.scratch_steps) == second.result.total_steps == second.result.step
    assert second.summary["trained"] == f"continued from the release ({sha[:12]}) with 16 new rows and 6 replayed, {c.steps} steps"
    assert f"drafter: {second.summary['trained']}" in " ".join(logs)
    # Its checkpoints (a from-scratch run's were removed, naming why) record every row it trained: the new shard's
    # rows and 6 old ones, never one the release held out (the release's held-out rows are this run's too).
    assert any("not resuming" in line and "continued_from" in line for line in logs)
    ledger = read_checkpoint_state(store, second.result.checkpoint).state["ledger"]
    trained_rows = {row for _, step_rows in ledger for row in step_rows}
    old = {r for r in trained_rows if r < 16}
    assert trained_rows - old == set(range(16, 32)) and len(old) == 6
    assert {(ref.shard, ref.row) for ref in first_heldout(store, keys, training)}.isdisjoint(
        (keys[0], r) for r in old
    )
    exported = store.read_json(f"{EXPORT_DIR}/{TRAINED_ON_FILE}")
    assert (list(exported["shards"]), exported["continued_from"]) == (keys, sha)

    # The scratch figure is what a from-scratch run on all rows takes: nothing released, it says so.
    store.remove(RELEASE_DIR, recursive=True)
    scratch = train_and_export(store, target, settings, keys, log=lambda _: None, max_steps=1)
    assert scratch.summary["trained"] == "from scratch: nothing is released"
    assert scratch.result.total_steps == c.scratch_steps


def test_a_continuation_never_takes_more_than_its_share_of_the_steps():
    # The demo's from-scratch run takes 1,057 steps: 0.25 of it is 264.25, and 265 steps would be 25.07%.
    assert [continuation_steps(0.25, n) for n in (1057, 1056, 3, 1)] == [264, 264, 1, 1]
    assert continuation_steps(0.1, 1057) == 105 and continuation_steps(1.0, 1057) == 1057


def test_a_continuation_replays_every_old_training_row_unless_replay_rows_bounds_it(tmp_path):
    model = tiny_llama(tmp_path / "target")
    store = ArtifactStore(tmp_path / "store")
    rows = random_rows(20, seed=1, min_len=8, max_len=12)
    old, new = write_shard(store, model, rows[:16], 0), write_shard(store, model, rows[16:], 16)
    training = TrainingSettings(heldout_rows=4, batch_tokens=96, device="cpu")
    _, loader, held, c = continued_data(store, [old], [new], training, DistEnv(), data_workers=0)
    # 16 old rows less the release's 4 held out: all 12 replayed beside the 4 new ones, none held out among them.
    assert (c.new_rows, c.replayed, len(held), len(loader.samples)) == (4, 12, 4, 16)
    assert {(s.shard, s.row) for s in held}.isdisjoint((s.shard, s.row) for s in loader.samples)
    bounded = training.model_copy(update={"replay_rows": 5})
    assert continued_data(store, [old], [new], bounded, DistEnv(), data_workers=0)[3].replayed == 5


def first_heldout(store: ArtifactStore, keys: list[str], training: TrainingSettings):
    """The rows the first (released) run held out: drawn from its one shard with the run's seed."""
    from eagle3_assets.drafter.data import index_samples, split_heldout

    samples, _ = index_samples(store, keys[:1])
    return split_heldout(samples, training.heldout_rows, training.seed)[1]
