"""A published drafter through the whole graph, as an operator runs it (issue 53): `start_from` names a drafter that a
real package wrote for the target, and the one start command installs it as the release and serves it alone by vLLM
(`release_baseline`), continues it on the store's data (the family's drafter asset), serves the continuation beside it
(its `drafter_eval`, which reads the baseline's passes) and releases whichever serves better (`drafter_release`),
naming both figures.

Two packages write the drafter: z-lab's `dflash` (PyPI 0.1.0; in `make test`) and speculators 0.9.0, which pins its
own torch stack and so runs from a venv of its own (`make test-peer-import` builds it and runs that leg; `make test`
skips it without the venv, and holds the speculators layout tensor for tensor in `test_drafter_import.py`).
The EAGLE-3 layout takes the same path; its pieces are held by `test_drafter_eval_beside.py` (served alone, then
beside, and gated) and `test_drafter_import_continue.py` (continued)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from dagster import AssetCheckKey, AssetKey

from eagle3_assets.drafter.eval_report import BASELINE_REPORT_FILE, EVAL_REPORT_FILE
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
from eagle3_assets.drafter.imported_release import imported_from
from eagle3_assets.defs.drafter.assets import RELEASE_CHECK
from eagle3_assets.drafter.release import RELEASED, export_digest
from eagle3_assets.families import DFLASH, EAGLE3, FamilySpec
from eagle3_assets.release_record import read_release_record
from eagle3_assets.settings import DFlashSettings, TrainingSettings
from eagle3_assets.start_from import StartFromSettings
from eagle3_assets.vocab_map import VocabMap

from .helpers import REPO, Operator, random_vocab_map, vllm_test_settings
from .test_drafter_import import SPECULATORS_PYTHON
from .test_dflash_import import published_dflash
from .vllm_helpers import confident_target

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

MASK = 5  # the DFlash drafter's mask token


def write_dflash(target_dir: Path, out: Path) -> FamilySpec:
    """z-lab's package saves a DFlash drafter for the target, its layers shaped like the target's (as the drafter
    the `dflash` settings build, so it continues from its weights) and reading its layers 0-2 (aux ids 1-3)."""
    pytest.importorskip("dflash")
    config = json.loads((target_dir / "config.json").read_text())
    shape = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    published_dflash(out, vocab=config["vocab_size"], mask=MASK, **{k: config[k] for k in shape})
    return DFLASH


def write_speculators(target_dir: Path, out: Path) -> FamilySpec:
    """speculators' own classes build and save an EAGLE-3 drafter for the target (reading its aux layers 1-3), on a
    draft vocabulary of its own."""
    if not SPECULATORS_PYTHON.exists():
        pytest.skip(f"no speculators venv at {SPECULATORS_PYTHON}: `make test-peer-import` builds it")
    vmap = random_vocab_map(vocab=json.loads((target_dir / "config.json").read_text())["vocab_size"], seed=3)
    np.save(out.with_name("d2t.npy"), vmap.d2t)
    np.save(out.with_name("t2d.npy"), vmap.t2d)
    subprocess.run(
        [str(SPECULATORS_PYTHON), str(REPO / "benchmarks/peer/write_speculators_drafter.py"), "--target",
         str(target_dir), "--out", str(out), "--d2t", str(out.with_name("d2t.npy")), "--t2d",
         str(out.with_name("t2d.npy")), "--aux-layer-ids", "1", "2", "3"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return EAGLE3


WRITERS = {"dflash": write_dflash, "speculators": write_speculators}


def metadata(event) -> dict:
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_a_published_drafter_is_served_first_continued_served_beside_and_gated(fmt, tmp_path, tiny_target_dir):
    published = tmp_path / "published" / fmt
    published.parent.mkdir()
    # Clear greedy margins: the target's head is also the DFlash drafter's, and an untrained one's near-flat logits
    # would make every draft a near tie.
    target_dir = confident_target(tiny_target_dir, tmp_path / "target")
    family = WRITERS[fmt](target_dir, published)
    op = Operator(
        tmp_path, target_dir,
        drafters=[family.name],
        start_from=StartFromSettings(drafter=str(published), format=fmt),
        dflash=DFlashSettings(num_layers=2, mask_token_id=MASK, epochs=2.0),
        # A continuation as long as a from-scratch run: the published drafters are random, and the gate is shown
        # replacing one with what the store's data taught it.
        training=TrainingSettings(batch_tokens=512, lr=3e-3, warmup_steps=2, epochs=6.0, continue_fraction=1.0,
                                  checkpoint_every=10, heldout_rows=4),  # fmt: skip
        vllm=vllm_test_settings(),
    )  # fmt: skip
    done = op.start()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    store = op.project.store
    with op.instance() as instance:
        events = {key: instance.get_latest_materialization_event(AssetKey(key))
                  for key in ("release_baseline", family.drafter_asset, "drafter_release")}  # fmt: skip
        check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [AssetCheckKey(AssetKey("drafter_release"), RELEASE_CHECK)]
        )[AssetCheckKey(AssetKey("drafter_release"), RELEASE_CHECK)]
    baseline, released = (metadata(events[k]) for k in ("release_baseline", "drafter_release"))
    report = store.child(family.root).read_json(EVAL_REPORT_FILE)
    trained_on = json.loads(store.child(family.root).read_text(f"{EXPORT_DIR}/{TRAINED_ON_FILE}"))
    imported = trained_on["imported"]

    # Installed and served alone before the first drafter trained: the baseline the gate holds.
    assert imported["source"] == published.resolve().as_uri() and imported["format"] == fmt
    assert events["release_baseline"].timestamp < events[family.drafter_asset].timestamp
    figures = {k: baseline[f"mean_acceptance_length_{k}"] for k in ("k3", "k7")}
    assert baseline["served"] is True and baseline["outputs_match_greedy"] is True
    assert baseline["reason"] == (
        f"{imported_from(imported)}; served alone on the held-out prompts before any export: k=3 {figures['k3']:.3f}, "
        f"k=7 {figures['k7']:.3f}"
    )
    # An EAGLE-3 import's own map is the store's (its head knows no other draft ids); a DFlash import drafts through
    # the target's head, so the store's map is a fresh one of draft_vocab_size.
    vmap = VocabMap.load(store)
    if family.adopts_import_map:
        assert vmap.d2t.tolist() == np.load(published.with_name("d2t.npy")).tolist()
    else:
        assert len(vmap.d2t) == op.project.settings.draft_vocab_size
    # Continued from its weights (not trained from scratch), on every shard.
    assert trained_on["family"] == family.name and trained_on["continued_from"] == report["beside"][RELEASED]["export_sha256"]
    assert sorted(trained_on["shards"]) == ["rows_0-20", "rows_20-40", "rows_40-45"]
    # Served beside the continuation: the baseline's own passes, read back, not served again.
    beside = report["beside"][RELEASED]
    assert {k: beside[f"mean_acceptance_length_{k}"] for k in figures} == figures
    kept = store.read_json(BASELINE_REPORT_FILE)["served_passes"]
    assert report["passes_reused"] == ["released k=3", "released k=7"]
    assert all(report["served_passes"][p] == kept[p] for p in report["passes_reused"])
    # Gated on both figures: the continuation serves better than the import and replaces it, which it names.
    new = {k: report[f"mean_acceptance_length_{k}"] for k in figures}
    assert new["k3"] > figures["k3"] and new["k7"] > figures["k7"], (new, figures)
    assert released["promoted"] is True and released["family"] == family.name and check.status.value == "SUCCEEDED"
    assert released["reason"] == (
        f"at least as good as the released drafter: k=3 {new['k3']:.3f} >= {figures['k3']:.3f}, k=7 {new['k7']:.3f} "
        f">= {figures['k7']:.3f}; and in each context bin of 5 or more prompts (0-1024)"
    )
    record = read_release_record(store)
    assert (record.family, record.imported, record.replaced) == (family.name, {}, figures)
    assert record.export_sha256 == export_digest(store.child(family.root)) == report["export_sha256"]
