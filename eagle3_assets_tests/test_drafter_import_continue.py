"""Continuing an imported release (issue 53, item 1): the store's vocab map is the import's own, the first drafter
starts from its weights exactly and trains on every shard, its provenance names where they were published, and an
import the family would not build is trained from scratch, the plan naming each difference with both values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from eagle3_assets.drafter.continuation import ContinuationPlan, continuation_plan, plan_continuation, read_release
from eagle3_assets.drafter.data import index_samples, split_heldout
from eagle3_assets.drafter.distributed import DistEnv
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
from eagle3_assets.drafter.family import Eagle3
from eagle3_assets.drafter.imported_release import adopted_vocab_map, import_differences, start_from
from eagle3_assets.drafter.release import RELEASE_DIR, target_version
from eagle3_assets.drafter.run import import_fit, run_plan, train_and_export
from eagle3_assets.drafter.sources import continued_data
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.families import EAGLE3
from eagle3_assets.hidden_states.integrity import check_shard
from eagle3_assets.release_record import IMPORTED, RELEASE_RECORD
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.shard_window import write_check_record
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import build_vocab_map, coverage, token_frequencies

from .conftest import tiny_settings
from .helpers import AUX_IDS, DRAFT_VOCAB, HIDDEN, VOCAB, random_rows, random_vocab_map, target_of, tiny_llama, write_shard
from .test_drafter_import import drafter, eagle_layout, speculators_layout

TRAINING = TrainingSettings(
    ttt_steps=3, lr=3e-3, warmup_steps=2, epochs=4.0, batch_tokens=96, checkpoint_every=100, heldout_rows=4,
    device="cpu",
)  # fmt: skip
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Llama target (aux layers [1, 2, 3]), its embedding, and 24 rows."""
    out = tmp_path_factory.mktemp("import-continue") / "target"
    model = tiny_llama(out)
    rows = random_rows(24, seed=0, min_len=8, max_len=16)
    return model, target_of(out), model.model.embed_tokens.weight.detach().clone(), rows


def shards(store: ArtifactStore, model, rows) -> list[str]:
    return [write_shard(store, model, rows[:12], 0), write_shard(store, model, rows[12:], 12)]


def test_the_first_drafter_continues_an_imported_release_from_its_weights_on_its_own_map(world, tmp_path):
    model, tgt, embed, rows = world
    store = ArtifactStore(tmp_path / "store")
    keys = shards(store, model, rows)
    source = speculators_layout(tmp_path / "published", drafter(tgt), embed)  # its norms on, as the settings'
    assert start_from(store, source, tgt, target_version=target_version(store)).installed
    record = store.read_json(RELEASE_RECORD)
    sha, src = record["export_sha256"], f"file://{source}"

    # The vocab_map asset adopts its map (the one `drafter` drew), whatever draft_vocab_size says, and names the cost.
    ids = np.concatenate([np.asarray(i) for i, _ in rows])
    freq = token_frequencies(ids, np.concatenate([np.asarray(m) for _, m in rows]), VOCAB)
    vmap, how = adopted_vocab_map(store, freq, 80)
    own = random_vocab_map(seed=1)
    assert np.array_equal(vmap.d2t, own.d2t) and np.array_equal(vmap.t2d, own.t2d)
    assert how == (
        f"adopted the imported release's own map ({src}): its {DRAFT_VOCAB} draft ids cover {coverage(own, freq):.6f} "
        f"of the loss tokens, a fresh map of 80 {coverage(build_vocab_map(freq, 80), freq):.6f} (not draft_vocab_size "
        f"80: its head has {DRAFT_VOCAB} rows)"
    )
    vmap.save(store)

    # Every shard is new; nothing is replayed; the held-out rows are those a from-scratch run holds out.
    now = {"family": "eagle3", "target": "none", "vocab_map": "none", "settings": {}, "shards": dict.fromkeys(keys)}
    plan = plan_continuation(store, now, "", rolling=False, import_differences=import_fit(Eagle3(TRAINING), tgt, vmap))
    imported = {"source": src, "format": "speculators", "sha256": record[IMPORTED]["sha256"]}
    assert plan == ContinuationPlan(True, "", sha, [], keys, imported=imported)
    _, loader, held, c = continued_data(store, [], keys, TRAINING, DistEnv(), data_workers=0)
    samples, _ = index_samples(store, keys)
    assert held == split_heldout(samples, 4, TRAINING.seed)[1]
    assert (c.new_rows, c.replayed, len(loader.samples)) == (20, 0, 20) and c.steps == c.scratch_steps // 4

    # Before its first step, the drafter is the imported weights exactly (bf16 as published, in float32).
    released = {k: v.float() for k, v in st_load(store.read_bytes(f"{RELEASE_DIR}/model.safetensors")).items()}
    start = train_drafter(store, keys, vmap=vmap, target=tgt, settings=TRAINING, continuation=plan, max_steps=0,
                          resume=False, log=lambda _: None)  # fmt: skip
    assert start.step == 0 and set(start.model.trainable_state_dict()) == set(released)
    for name, tensor in start.model.trainable_state_dict().items():
        assert torch.equal(tensor.float(), released[name]), name

    # The drafter asset's run: trained warm, and its summary and trained_on.json say from what.
    logs: list[str] = []
    run = train_and_export(store, tgt, tiny_settings(training=TRAINING), keys, log=logs.append)
    c = run.result.continued
    assert c is not None and run.result.step == c.steps
    assert run.summary["trained"] == (
        f"continued from the imported release ({src}, speculators format) ({sha[:12]}) with 20 new rows and 0 "
        f"replayed, {c.steps} steps"
    )
    on = store.read_json(f"{EXPORT_DIR}/{TRAINED_ON_FILE}")
    assert (list(on["shards"]), on["continued_from"], on["imported"]) == (keys, sha, imported)
    assert not any("from scratch" in line for line in logs)


def test_an_import_the_family_would_not_build_trains_from_scratch_naming_each_difference(world, tmp_path):
    model, tgt, embed, _ = world
    store = ArtifactStore(tmp_path / "store")
    # The EAGLE layout with no norm flags: vLLM reads them as off; the training settings' defaults are on.
    source = eagle_layout(tmp_path / "published", drafter(tgt, norms=False), embed)
    start_from(store, source, tgt, target_version="none")
    own, training = random_vocab_map(seed=1), TrainingSettings()

    def differences(target=tgt, vmap=own, training=training, aux=tgt.aux_layer_ids) -> list[str]:
        return import_differences(store, Eagle3(training).drafter_config(target, vmap), aux, vmap)

    norms = [f"{f}: release False, now True (training.{f})" for f in NORM_FLAGS]
    assert differences() == norms
    assert differences(training=TrainingSettings(**dict.fromkeys(NORM_FLAGS, False))) == []
    assert differences(vmap=random_vocab_map(seed=2)) == [
        f"vocab map: release its own ({DRAFT_VOCAB} draft ids), now the store's vocab_map ({DRAFT_VOCAB} draft ids; "
        "re-materialize vocab_map, which adopts an imported release's map)", *norms,
    ]  # fmt: skip
    wider = replace(tgt, intermediate_size=2 * tgt.intermediate_size)
    assert differences(target=wider)[0] == (
        f"intermediate_size: release {tgt.intermediate_size}, now {2 * tgt.intermediate_size} (the target's)"
    )
    assert differences(aux=(1, 2, 4))[-1] == "aux layer ids: release [1, 2, 3], now [1, 2, 4] (aux_layer_ids)"

    what = f"the release is imported from file://{source} (eagle3 format)"
    now = {"family": "eagle3", "target": "none", "vocab_map": "v", "settings": {}, "shards": {"rows_0-12": "r"}}
    assert continuation_plan(*read_release(store), now, differences()) == ContinuationPlan(
        False, f"{what}, and its weights do not load into the drafter trained now: " + "; ".join(norms)
    )
    assert continuation_plan(*read_release(store), {**now, "family": "dflash"}) == ContinuationPlan(
        False, f"family: release 'eagle3', now 'dflash' ({what})"
    )
    assert continuation_plan(*read_release(store), {**now, "target": "t2"}, []) == ContinuationPlan(
        False, f"target: release 'none', now 't2' ({what})"
    )


def test_a_rolling_pass_continues_an_imported_release_from_its_weights_on_every_shard(world, tmp_path):
    """In rolling mode the first pass starts from the import's weights and is the pass a from-scratch run makes:
    every row new, none replayed (there is no reservoir of rows it trained on)."""
    model, tgt, embed, rows = world
    store = ArtifactStore(tmp_path / "store")
    tset = TokenizedSet.from_rows(rows, list(range(len(rows))))
    tset.save(store)
    keys = shards(store, model, rows)
    for key in keys:  # checked, as the shard_integrity check records it: the window trains a shard once it passed
        assert check_shard(store, tset, Shard.parse(key), hidden_size=HIDDEN, aux_layer_ids=AUX_IDS, dtype="float32",
                           model="tiny-llama").ok  # fmt: skip
        write_check_record(store, key, passed=True, problems=0)
    source = speculators_layout(tmp_path / "published", drafter(tgt), embed)
    assert start_from(store, source, tgt, target_version=target_version(store)).installed
    vmap = random_vocab_map(seed=1)  # its own, as the vocab_map asset adopts it
    vmap.save(store)
    training = TRAINING.model_copy(update={"mode": "rolling", "window_shards": 2, "shard_wait_s": 60.0, "epochs": 1.0})
    settings = tiny_settings(shard_size=12, training=training)
    plan = run_plan(store, tgt, settings, keys, EAGLE3)[2]
    assert (plan.continues, plan.old_shards, plan.new_shards) == (True, [], keys)

    # It starts from the import's weights as an offline run does (`train._prepare` warm-starts either).
    run = train_and_export(store, tgt, settings, keys, log=lambda _: None)
    c = run.result.continued
    assert c is not None and (c.new_rows, c.replayed) == (24 - TRAINING.heldout_rows, 0)
    assert c.steps == c.scratch_steps == run.result.total_steps == run.result.step
    assert run.summary["trained"].startswith(f"continued from the imported release (file://{source}, speculators ")
