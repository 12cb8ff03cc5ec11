"""`drafter_release`: the released drafter is replaced only by an export that serves at least as well.

The gate is a plain function of `drafter_eval`'s report; the asset is run in a real Dagster instance
on reports as `drafter_eval` writes them (the vLLM test serves real drafters, `test_drafter_eval_beside.py`).
"""

from __future__ import annotations

import time

import pytest
import torch
from dagster import AssetKey, DagsterInstance, materialize
from safetensors.torch import save_file

from eagle3_assets.defs.drafter.assets import RELEASE_CHECK, drafter_release_asset
from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE, ServedReport
from eagle3_assets.drafter.evaluate import ReferenceDrafterMissing, beside_drafters
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.release import (
    RELEASE_DIR,
    RELEASED,
    export_digest,
    release_decision,
    release_digest,
)
from eagle3_assets.families import DFLASH
from eagle3_assets.project import Project
from eagle3_assets.provenance import Provenance, Record, write_record
from eagle3_assets.settings import EvaluationSettings
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings


def report_json(k3: float, k7: float, *, greedy: bool = True, **extra) -> dict:
    """A drafter_eval report's figures in the form `EvalReport.as_metadata` writes them."""
    return {"mean_acceptance_length_k3": k3, "mean_acceptance_length_k7": k7, "outputs_match_greedy": greedy, **extra}


def report(k3: float, k7: float, *, greedy: bool = True) -> ServedReport:
    return ServedReport.from_json(report_json(k3, k7, greedy=greedy))


def test_the_gate_promotes_the_first_release_and_a_drafter_at_least_as_good():
    first = release_decision(report(2.1, 2.6), None, 1.05)
    assert (first.promote, first.reason) == (True, "first release: k=3 2.100, k=7 2.600")
    better = release_decision(report(2.1, 2.7), {"k3": 2.1, "k7": 2.6}, 1.05)
    assert better.promote
    assert better.reason == "at least as good as the released drafter: k=3 2.100 >= 2.100, k=7 2.700 >= 2.600"


def test_the_gate_keeps_the_release_against_a_worse_drafter_naming_both_figures():
    worse = release_decision(report(2.3, 2.55), {"k3": 2.1, "k7": 2.6}, 1.05)
    assert not worse.promote
    assert worse.reason == (
        "the new export serves at mean acceptance length 2.550 at k=7, the released drafter at 2.600 (same prompts, "
        "k and engine): not promoted, the released drafter stays"
    )


def test_the_gate_never_releases_a_drafter_whose_drafts_are_not_accepted_or_that_changed_greedy_output():
    zeroed = release_decision(report(1.0, 1.0), None, 1.05)  # nothing to beat: still never released
    assert not zeroed.promote
    assert zeroed.reason.startswith("the new export serves at mean acceptance length 1.000 at k=3, below "
                                    "evaluation.release_min_acceptance 1.05")  # fmt: skip
    changed = release_decision(report(2.5, 3.0, greedy=False), {"k3": 2.1, "k7": 2.6}, 1.05)
    assert not changed.promote and "changed the greedy output" in changed.reason


SHORT, LONG = "0-1024", "4096-16384"  # context bins (`context_bins.bin_labels`)


def binned(bins: dict[str, tuple[int, float, float]]) -> dict:
    """A report's figures per context bin, as `EvalReport.as_metadata` writes them, from bin -> (prompts, k3, k7)."""
    return {
        "prompts_by_context_bin": {b: n for b, (n, _, _) in bins.items()},
        "mean_acceptance_length_by_context_bin": {b: {"k3": k3, "k7": k7} for b, (_, k3, k7) in bins.items()},
    }


def test_the_gate_refuses_a_drafter_that_regresses_in_a_context_bin_with_enough_prompts_naming_it():
    """Issue 43, item 7: better on the whole set (mostly short prompts) and worse on long ones is a regression."""
    new = ServedReport.from_json(report_json(2.5, 3.2, **binned({SHORT: (40, 2.6, 3.4), LONG: (8, 1.7, 2.1)})))
    bar = ServedReport.from_json(report_json(2.4, 3.0, **binned({SHORT: (40, 2.5, 3.1), LONG: (8, 1.8, 2.3)}))).export
    worse = release_decision(new, bar.acceptance, 1.05, bar.bins, 5)
    assert (worse.promote, worse.reason) == (False, (
        "the new export serves at mean acceptance length 1.700 at k=3 on prompts of 4096-16384 tokens (8 prompts), the "
        "released drafter at 1.800 (same prompts, k and engine): not promoted, the released drafter stays"
    ))  # fmt: skip
    # The same long bin with too few prompts (in ours, or in the released drafter's figures) is not judged.
    assert release_decision(new, bar.acceptance, 1.05, bar.bins, 9).promote
    few = ServedReport.from_json(report_json(2.4, 3.0, **binned({SHORT: (40, 2.5, 3.1), LONG: (4, 1.8, 2.3)}))).export
    passed = release_decision(new, bar.acceptance, 1.05, few.bins, 5)
    assert (passed.promote, passed.reason) == (True, (
        "at least as good as the released drafter: k=3 2.500 >= 2.400, k=7 3.200 >= 3.000; and in each context bin "
        "of 5 or more prompts (0-1024); not judged, too few prompts or no released figures: 4096-16384 (8 prompts)"
    ))  # fmt: skip
    # The whole-set rule comes first, with its message as before.
    assert release_decision(new, {"k3": 2.6, "k7": 3.0}, 1.05, bar.bins, 5).reason.startswith(
        "the new export serves at mean acceptance length 2.500 at k=3, the released drafter at 2.600 (same prompts"
    )
    # A release served (or made) before bins existed has no bin figures: compared on the whole set, as before.
    before = release_decision(new, bar.acceptance, 1.05, ServedReport.from_json(report_json(2.4, 3.0)).export.bins, 5)
    assert (before.promote, before.reason) == (
        True, "at least as good as the released drafter: k=3 2.500 >= 2.400, k=7 3.200 >= 3.000"
    )  # fmt: skip


def write_export(store: ArtifactStore, scale: float) -> str:
    """An export's files (the gate never loads them: their digest ties the report to them); `store` is a family's
    directory (`store.child(family_spec(f).root)`)."""
    local = store.local_path(EXPORT_DIR)
    local.mkdir(parents=True, exist_ok=True)
    save_file({"fc.weight": torch.full((2, 2), scale)}, str(local / "model.safetensors"))
    (local / "config.json").write_text('{"scale": %s}\n' % scale)
    return export_digest(store)


def release(project: Project, instance: DagsterInstance, eval_report: dict | None = None, families=("eagle3",)):
    if eval_report is not None:
        project.store.write_json(EVAL_REPORT_FILE, eval_report)
    asset = drafter_release_asset(list(families))
    result = materialize([asset], resources={"project": project}, instance=instance, raise_on_error=False)
    event = instance.get_latest_materialization_event(AssetKey("drafter_release"))
    evaluations = [
        e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return result, event.asset_materialization.metadata, evaluations[0] if evaluations else None


def test_drafter_release_promotes_keeps_and_refuses_as_the_gate_says(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    with DagsterInstance.ephemeral() as instance:
        first = write_export(store, 1.0)
        result, meta, check = release(project, instance, report_json(2.1, 2.6, export_sha256=first))
        assert result.success and check.passed and check.check_name == RELEASE_CHECK
        assert meta["promoted"].value is True and meta["reason"].value == "first release: k=3 2.100, k=7 2.600"
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'
        assert store.read_json(f"{RELEASE_DIR}/release.json")["acceptance"] == {"k3": 2.1, "k7": 2.6}

        # A worse retrain, served beside the released drafter: the blocking check fails naming both figures.
        worse = write_export(store, 2.0)
        beside = {RELEASED: report_json(2.1, 2.6, dir="release", export_sha256=first)}
        result, meta, check = release(project, instance, report_json(1.9, 2.6, export_sha256=worse, beside=beside))
        assert not result.success and not check.passed
        assert check.description == (
            "the new export serves at mean acceptance length 1.900 at k=3, the released drafter at 2.100 (same "
            "prompts, k and engine): not promoted, the released drafter stays"
        )
        assert (meta["new_k3"].value, meta["released_k3"].value) == (1.9, 2.1)
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'  # it stayed

        # A report of another export than the one in the store is no basis: not promoted, its eval named.
        result, _, check = release(project, instance, report_json(3.0, 3.5, export_sha256=first, beside=beside))
        assert not result.success and not check.passed
        assert check.description == (
            f"the drafter_eval report ({first}) is not of the export now at {store.url_of(EXPORT_DIR)}: not promoted; "
            "rematerialize drafter_eval first"
        )

        # A better one replaces it.
        better = write_export(store, 3.0)
        result, meta, check = release(project, instance, report_json(2.4, 2.9, export_sha256=better, beside=beside))
        assert result.success and check.passed and meta["promoted"].value is True
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 3.0}\n'
        assert store.read_json(f"{RELEASE_DIR}/release.json")["replaced"] == {"k3": 2.1, "k7": 2.6}


def test_the_gate_cannot_be_emptied_fooled_or_raced(tmp_path):
    """Issue 44, item 5: a released drafter that stopped serving greedily keeps the bar it was released at; an export
    rewritten after it was judged is not released; a second promotion waits for the one deciding."""
    from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR, NotComparable, promote
    from eagle3_assets.leases import Lease

    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    with DagsterInstance.ephemeral() as instance:
        released = write_export(store, 1.0)
        assert release(project, instance, report_json(2.9, 3.5, export_sha256=released))[0].success

        # Served beside a new export it no longer matches greedy (another engine): a baseline of 1.0 would let 1.30 in.
        weak = write_export(store, 2.0)
        beside = {RELEASED: report_json(1.0, 1.0, greedy=False, export_sha256=released)}
        result, meta, check = release(project, instance, report_json(1.3, 1.4, export_sha256=weak, beside=beside))
        assert not result.success and not check.passed
        assert (meta["new_k3"].value, meta["released_k3"].value) == (1.3, 2.9)  # the bar it was released at
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'

        # An export rewritten between drafter_eval and the promotion is not what was judged.
        judged = write_export(store, 3.0)
        write_export(store, 4.0)
        with pytest.raises(NotComparable, match=r"changed since drafter_eval served it .*: not released"):
            promote(store, release_decision(report(3.0, 3.6), None, 1.05), ServedReport.from_json(
                report_json(3.0, 3.6, export_sha256=judged)), "v1")  # fmt: skip
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'

        # One promotion at a time: another run deciding holds the lease, and this one refuses naming it.
        better = write_export(store, 5.0)
        with Lease(store, PROMOTION_LEASE_DIR, "run-deciding"):
            result, _, check = release(project, instance, report_json(3.0, 3.6, export_sha256=better, beside={
                RELEASED: report_json(2.9, 3.5, export_sha256=released)}))  # fmt: skip
        assert not result.success and check is None
        assert "run-deciding" in result.failure_data_for_node("drafter_release").error.message
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'


def test_drafter_release_records_each_bin_and_keeps_the_release_against_a_drafter_worse_on_long_prompts(tmp_path):
    """The asset: release.json keeps the figures per context bin; a retrain worse in a bin of enough prompts fails the
    check naming the bin, and is promoted once the bin counts as too small (`evaluation.min_prompts_per_bin`);
    a released drafter that stopped serving greedily keeps the per-bin bar it was released at."""
    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    with DagsterInstance.ephemeral() as instance:
        first = binned({SHORT: (40, 2.5, 3.1), LONG: (6, 1.8, 2.3)})
        digest = write_export(store, 1.0)
        result, _, _ = release(project, instance, report_json(2.4, 3.0, export_sha256=digest, **first))
        assert result.success
        record = store.read_json(f"{RELEASE_DIR}/release.json")
        assert (record["prompts_by_context_bin"], record["acceptance_by_context_bin"]) == (
            {SHORT: 40, LONG: 6}, {SHORT: {"k3": 2.5, "k7": 3.1}, LONG: {"k3": 1.8, "k7": 2.3}}
        )  # fmt: skip

        digest = write_export(store, 2.0)
        worse_long = report_json(2.5, 3.2, export_sha256=digest, **binned({SHORT: (40, 2.6, 3.4), LONG: (6, 1.8, 2.1)}))
        worse_long["beside"] = {RELEASED: report_json(2.4, 3.0, export_sha256=release_digest(store), **first)}
        result, _, check = release(project, instance, worse_long)
        assert not result.success and not check.passed
        assert check.description == (
            "the new export serves at mean acceptance length 2.100 at k=7 on prompts of 4096-16384 tokens (6 prompts), "
            "the released drafter at 2.300 (same prompts, k and engine): not promoted, the released drafter stays"
        )
        # Beside it, the released drafter no longer serves greedily: its recorded per-bin bar still holds.
        at_one = binned({SHORT: (40, 1.0, 1.0), LONG: (6, 1.0, 1.0)})
        not_greedy = {RELEASED: report_json(1.0, 1.0, greedy=False, export_sha256=release_digest(store), **at_one)}
        result, _, check = release(project, instance, worse_long | {"beside": not_greedy})
        assert not result.success and check.description.startswith(
            "the new export serves at mean acceptance length 2.100 at k=7 on prompts of 4096-16384 tokens (6 prompts), "
            "the released drafter at 2.300"
        )
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 1.0}\n'  # it stayed

        # With 7 prompts the least a bin is judged on, 6 long prompts are too few: the whole set decides.
        few = Project(tiny_settings(evaluation=EvaluationSettings(min_prompts_per_bin=7)), store)
        result, meta, check = release(few, instance, worse_long)
        assert result.success and check.passed and meta["reason"].value.endswith(
            f"in each context bin of 7 or more prompts ({SHORT}); not judged, too few prompts or no released figures: "
            f"{LONG} (6 prompts)"
        )
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 2.0}\n'


@pytest.mark.parametrize("k3", [1.0, 1.04])
def test_an_export_serving_at_acceptance_one_is_never_released_even_first(tmp_path, k3):
    store = ArtifactStore(tmp_path / "store")
    with DagsterInstance.ephemeral() as instance:
        digest = write_export(store, 0.0)
        result, meta, check = release(Project(tiny_settings(), store), instance, report_json(k3, 1.0, export_sha256=digest))
    assert not result.success and not check.passed and meta["promoted"].value is False
    assert not store.exists(RELEASE_DIR)


def made_target(store: ArtifactStore, version: str) -> None:
    """The store's `target_model` record, as the asset leaves it: `version` names the target."""
    write_record(store, Record(Provenance("target_model", {}, {}, 1), version))


def test_a_drafter_released_for_another_target_is_no_baseline_and_the_new_targets_first_release_replaces_it(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    where = store.url_of(RELEASE_DIR)
    with DagsterInstance.ephemeral() as instance:
        made_target(store, "target-a")
        first = write_export(store, 1.0)
        result, _, _ = release(project, instance, report_json(3.0, 4.0, export_sha256=first))
        assert result.success and store.read_json(f"{RELEASE_DIR}/release.json")["target"] == "target-a"
        assert beside_drafters(store, EvaluationSettings(), tmp_path) == {
            RELEASED: (tmp_path / "release", "eagle3")
        }

        # Another target: its drafter is judged alone (the old release is not served beside it) ...
        made_target(store, "target-b")
        other = (
            f"the drafter released at {where} was released for another target (target_model version target-a, "
            "now target-b)"
        )
        lines: list[str] = []
        assert beside_drafters(store, EvaluationSettings(), tmp_path, log=lines.append) == {}
        assert lines == [f"drafter_eval: {other}: not served beside the new export"]
        # ... one whose drafts are not accepted releases nothing, and says nothing is released for this target ...
        zeroed = write_export(store, 0.0)
        result, meta, check = release(project, instance, report_json(1.0, 1.0, export_sha256=zeroed))
        assert not result.success and not check.passed
        assert check.description.endswith(f"never released; {other}: nothing is released for this target")
        assert store.read_json(f"{RELEASE_DIR}/release.json")["target"] == "target-a"
        # ... and one that serves is its first release, but the old release is dropped only by a person's approval
        # (issue 52, item 5): a target changes by accident too. The refusal names the setting and the version ...
        second = write_export(store, 2.0)
        result, meta, check = release(project, instance, report_json(1.5, 1.6, export_sha256=second))
        assert not result.success and not check.passed and meta["promoted"].value is False
        assert check.description == (
            f"first release: k=3 1.500, k=7 1.600; {other}: kept: a release for another target is replaced only by a "
            "person's approval; set evaluation.replace_release_for_target: target-b to release this export in its place"
        )
        assert store.read_json(f"{RELEASE_DIR}/release.json")["target"] == "target-a"
        # ... an approval of another version approves nothing; the one named replaces it, even below its figures.
        for approved, replaced in (("target-c", False), ("target-b", True)):
            evaluation = EvaluationSettings(replace_release_for_target=approved)
            result, meta, check = release(
                Project(tiny_settings(evaluation=evaluation), store), instance, report_json(1.5, 1.6, export_sha256=second)
            )
            assert result.success is replaced and check.passed is replaced
        assert meta["reason"].value == (
            f"first release: k=3 1.500, k=7 1.600; {other}: replaced, as approved (evaluation.replace_release_for_target)"
        )
        assert "released_k3" not in meta
        record = store.read_json(f"{RELEASE_DIR}/release.json")
        assert (record["target"], record["acceptance"], record["replaced"]) == ("target-b", {"k3": 1.5, "k7": 1.6}, None)
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 2.0}\n'

    # A release made before releases named their target stays the baseline (replacing one cannot be undone).
    store.write_json(f"{RELEASE_DIR}/release.json", {"acceptance": {"k3": 2.0}})
    assert beside_drafters(store, EvaluationSettings(), tmp_path) == {
        RELEASED: (tmp_path / "release", "eagle3")
    }


def test_drafter_eval_serves_the_released_drafter_and_the_reference_beside_ours_and_refuses_a_missing_reference(
    tmp_path,
):
    store = ArtifactStore(tmp_path / "store")
    assert beside_drafters(store, EvaluationSettings(), tmp_path) == {}
    made_target(store, "target-a")
    store.write_json(f"{RELEASE_DIR}/release.json", {"target": "target-a", "acceptance": {"k3": 2.0}})
    reference = tmp_path / "published"
    reference.mkdir()
    (reference / "config.json").write_text("{}")
    with pytest.raises(ReferenceDrafterMissing) as e:
        beside_drafters(store, EvaluationSettings(reference_drafter=str(reference)), tmp_path)
    assert str(e.value) == (
        f"evaluation.reference_drafter {reference}: no model.safetensors there; name a local EAGLE-3 export "
        "directory (download a published drafter first) or remove the setting"
    )
    (reference / "model.safetensors").write_bytes(b"")
    assert beside_drafters(store, EvaluationSettings(reference_drafter=str(reference)), tmp_path) == {
        RELEASED: (tmp_path / "release", "eagle3"), "reference": (reference, "eagle3")
    }


def test_the_release_takes_the_better_family_and_the_other_stays_unreleased_naming_both_figures(tmp_path):
    """Issue 43: one release per target, across families, by the same rules; release.json names the family."""
    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    eagle3, dflash = store, store.child(DFLASH.root)
    with DagsterInstance.ephemeral() as instance:
        eagle3.write_json(EVAL_REPORT_FILE, report_json(2.5, 3.2, export_sha256=write_export(eagle3, 1.0)))
        dflash.write_json(EVAL_REPORT_FILE, report_json(2.6, 3.9, export_sha256=write_export(dflash, 2.0)))
        result, meta, check = release(project, instance, families=("eagle3", "dflash"))
        assert result.success and check.passed and meta["family"].value == "dflash"
        assert check.description == (
            "first release: k=3 2.600, k=7 3.900; eagle3 serves at mean acceptance length 3.200 at k=7, dflash at "
            "3.900 (same prompts, k and engine): dflash is released, eagle3 is not"
        )
        record = store.read_json(f"{RELEASE_DIR}/release.json")
        assert record["family"] == "dflash" and record["export"] == dflash.url_of(EXPORT_DIR)
        assert (tmp_path / "store" / RELEASE_DIR / "config.json").read_text() == '{"scale": 2.0}\n'
        assert beside_drafters(store, EvaluationSettings(), tmp_path)[RELEASED][1] == "dflash"  # served as DFlash

        # Both retrained, each served beside the released DFlash drafter: EAGLE-3 now beats it, DFlash does not.
        beside = {RELEASED: report_json(2.6, 3.9, dir="release", export_sha256=release_digest(store))}
        eagle3.write_json(EVAL_REPORT_FILE, report_json(2.7, 4.0, export_sha256=write_export(eagle3, 3.0), beside=beside))
        dflash.write_json(EVAL_REPORT_FILE, report_json(2.5, 3.8, export_sha256=write_export(dflash, 4.0), beside=beside))
        result, meta, check = release(project, instance, families=("eagle3", "dflash"))
        assert result.success and meta["family"].value == "eagle3"
        assert "the new export serves at mean acceptance length 2.500 at k=3, the released drafter at 2.600" in (
            check.description
        )
        assert store.read_json(f"{RELEASE_DIR}/release.json")["family"] == "eagle3"

        # Neither beats the release: nothing is promoted, and the check names each family's figures.
        beside = {RELEASED: report_json(2.7, 4.0, dir="release", export_sha256=release_digest(store))}
        eagle3.write_json(EVAL_REPORT_FILE, report_json(2.6, 3.9, export_sha256=write_export(eagle3, 5.0), beside=beside))
        dflash.write_json(EVAL_REPORT_FILE, report_json(2.7, 3.95, export_sha256=write_export(dflash, 6.0), beside=beside))
        result, meta, check = release(project, instance, families=("eagle3", "dflash"))
        assert not result.success and not check.passed and meta["promoted"].value is False
        assert (meta["eagle3_k7"].value, meta["dflash_k7"].value, meta["released_k7"].value) == (3.9, 3.95, 4.0)
        assert "3.950 at k=7, the released drafter at 4.000" in check.description
        assert store.read_json(f"{RELEASE_DIR}/release.json")["family"] == "eagle3"  # it stayed


def test_a_target_moved_or_linked_with_the_same_bytes_keeps_its_release_as_the_baseline(tmp_path):
    """Issue 44: the release recorded a digest of the target's settings, path included, so a model moved, linked or
    named as `file://` was "another target": its release was dropped and a worse export replaced it."""
    from eagle3_assets.defs.provenance import Staleness, materialized

    from .test_target_identity import make_model

    store = ArtifactStore(tmp_path / "store")
    model = make_model(tmp_path / "models" / "a")
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)

    def project_for(target: str, trust_remote_code: bool = False) -> Project:
        """The project once `target_model` was made for a target named so (its record, as the asset writes it)."""
        project = Project(tiny_settings(target_model=target, trust_remote_code=trust_remote_code), store)
        materialized(project, Staleness(project).expected("target_model"))
        return project

    with DagsterInstance.ephemeral() as instance:
        first = write_export(store, 1.0)
        result, _, _ = release(project_for(str(model)), instance, report_json(2.9, 3.4, export_sha256=first))
        assert result.success
        # Linked; named as `file://` with `trust_remote_code` flipped (it has no code of its own: the flag runs nothing).
        for name, trust in ((str(link), False), (f"file://{model}", True)):
            project = project_for(name, trust)
            assert beside_drafters(store, EvaluationSettings(), tmp_path) == {
                RELEASED: (tmp_path / "release", "eagle3")
            }
            worse = write_export(store, 2.0)
            beside = {RELEASED: report_json(2.9, 3.4, dir="release", export_sha256=release_digest(store))}
            result, _, check = release(project, instance, report_json(1.3, 1.5, export_sha256=worse, beside=beside))
            assert not result.success and check.description == (
                "the new export serves at mean acceptance length 1.300 at k=3, the released drafter at 2.900 (same "
                "prompts, k and engine): not promoted, the released drafter stays"
            )
        assert store.read_json(f"{RELEASE_DIR}/release.json")["acceptance"] == {"k3": 2.9, "k7": 3.4}


def test_a_release_made_before_targets_were_known_by_their_bytes_stays_the_baseline_of_the_same_target(
    tmp_path, tiny_target_dir
):
    """The upgrade to content identities changes the target's version; a release made before names the version the
    target's record had then (`sampled_version`, checked equal to the old code's on this target): the `target_model`
    asset keeps that beside the new one, so the upgrade never drops the release as another target's."""
    from eagle3_assets.defs.data.assets import target_model
    from eagle3_assets.defs.provenance import Staleness
    from eagle3_assets.drafter.release import other_target, target_version
    from eagle3_assets.provenance import sampled_version, target_identity

    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(target_model=str(tiny_target_dir)), store)
    then = sampled_version(Staleness(project).expected("target_model"), str(tiny_target_dir))
    store.write_json(f"{RELEASE_DIR}/release.json", {"target": then, "acceptance": {"k3": 2.9, "k7": 3.4}})
    with DagsterInstance.ephemeral() as instance:
        assert materialize([target_model], resources={"project": project}, instance=instance).success
    assert target_version(store) == target_identity(str(tiny_target_dir)) != then
    assert beside_drafters(store, EvaluationSettings(), tmp_path) == {
        RELEASED: (tmp_path / "release", "eagle3")
    }
    # A release made then for another target is still another target's.
    store.write_json(f"{RELEASE_DIR}/release.json", {"target": "0123456789abcdef", "acceptance": {"k3": 2.9}})
    assert other_target(store, target_version(store)) == (
        f"the drafter released at {store.url_of(RELEASE_DIR)} was released for another target (target_model version "
        f"0123456789abcdef, now {target_identity(str(tiny_target_dir))})"
    )


# --- the release is decided only against the release that is current now (issue 52, item 1) -------------------------

TWO = ("eagle3", "dflash")


def served(store: ArtifactStore, family_dir: ArtifactStore, scale: float, k3: float, k7: float, beside=None) -> str:
    """A family's export (of `scale`) and its drafter_eval report, served beside `beside` ((k3, k7) of the drafter
    released now) when given; returns the export's digest."""
    digest = write_export(family_dir, scale)
    also = {"beside": {RELEASED: report_json(*beside, export_sha256=release_digest(store))}} if beside else {}
    family_dir.write_json(EVAL_REPORT_FILE, report_json(k3, k7, export_sha256=digest, **also))
    return digest


def test_a_report_served_beside_an_older_release_never_replaces_the_release_and_its_eval_is_due(tmp_path):
    """The probe: both families served beside E1; E2 released (DFlash's D2 below E2, above E1); then only an EAGLE-3
    setting changed and E3 serves worse. D2's old report said it beat E1, and D2 replaced E2."""
    from eagle3_assets.defs.provenance import Staleness, materialized

    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(drafters=list(TWO)), store)
    eagle3, dflash = store, store.child(DFLASH.root)
    with DagsterInstance.ephemeral() as instance:
        e1 = served(store, eagle3, 1.0, 2.0, 2.4)
        served(store, dflash, 2.0, 1.9, 2.3)
        assert release(project, instance, families=TWO)[0].success and release_digest(store) == e1
        e2 = served(store, eagle3, 3.0, 2.5, 2.9, beside=(2.0, 2.4))
        served(store, dflash, 4.0, 2.4, 2.8, beside=(2.0, 2.4))
        materialized(project, Staleness(project).expected("drafter_eval_dflash"))  # D2's eval, served beside E1
        assert Staleness(project).problem("drafter_eval_dflash") is None
        result, meta, _ = release(project, instance, families=TWO)
        assert result.success and meta["family"].value == "eagle3" and release_digest(store) == e2
        # A change of release makes every family's eval due: D2 was judged beside E1, not E2.
        assert Staleness(project).problem("drafter_eval_dflash") == f"made from other inputs: input release: {e1} -> {e2}"

        served(store, eagle3, 5.0, 2.3, 2.6, beside=(2.5, 2.9))  # only an EAGLE-3 setting changed: E3 serves worse
        result, meta, check = release(project, instance, families=TWO)
        assert not result.success and not check.passed and meta["promoted"].value is False
        assert check.description == (
            "the new export serves at mean acceptance length 2.300 at k=3, the released drafter at 2.500 (same prompts, "
            f"k and engine): not promoted, the released drafter stays; the drafter_eval_dflash report was served beside "
            f"another release (sha256 {e1}) than the one at {store.url_of(RELEASE_DIR)} now (sha256 {e2}): not "
            "promoted; rematerialize drafter_eval_dflash, which serves both"
        )
        assert release_digest(store) == e2 and store.read_json(f"{RELEASE_DIR}/release.json")["acceptance"] == {
            "k3": 2.5, "k7": 2.9
        }  # fmt: skip

        # D2 served again, beside E2: below it, it stays unreleased by the same rule as any.
        served(store, dflash, 4.0, 2.4, 2.8, beside=(2.5, 2.9))
        result, _, check = release(project, instance, families=TWO)
        assert not result.success and release_digest(store) == e2
        assert "the new export serves at mean acceptance length 2.400 at k=3, the released drafter at 2.500" in (
            check.description
        )


def test_a_report_made_before_the_first_release_does_not_keep_the_better_family_from_being_released(tmp_path):
    """The variant: DFlash's report predated the first release, `decide` raised for it, and the asset failed, so the
    better EAGLE-3 was not released either; the message named drafter_eval, the wrong asset."""
    store = ArtifactStore(tmp_path / "store")
    eagle3, dflash = store, store.child(DFLASH.root)
    with DagsterInstance.ephemeral() as instance:
        e1 = served(store, eagle3, 1.0, 2.0, 2.4)
        assert release(Project(tiny_settings(), store), instance)[0].success  # E1, while only EAGLE-3 was trained
        served(store, dflash, 2.0, 2.2, 2.5)  # served before E1 was released: nothing beside it
        e2 = served(store, eagle3, 3.0, 2.5, 2.9, beside=(2.0, 2.4))
        result, meta, check = release(Project(tiny_settings(drafters=list(TWO)), store), instance, families=TWO)
        assert result.success and check.passed and meta["family"].value == "eagle3" and release_digest(store) == e2
        assert check.description == (
            "at least as good as the released drafter: k=3 2.500 >= 2.000, k=7 2.900 >= 2.400; a drafter is released "
            f"({store.url_of(RELEASE_DIR)}, sha256 {e1}) but the drafter_eval_dflash report has no figures of it served "
            "beside the new export (made before it was released): not promoted; rematerialize drafter_eval_dflash, "
            "which serves both"
        )


def test_a_promotion_that_lost_its_lease_while_it_uploads_publishes_nothing(tmp_path, monkeypatch):
    """Issue 52, item 2: `decide`/`promote` wrote through the unguarded store, so a promoter whose lease was taken
    over still replaced the release with its stale decision."""
    from dataclasses import asdict

    from eagle3_assets import storage
    from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR
    from eagle3_assets.leases import READ_EVERY_S, Lease

    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(), store)
    with DagsterInstance.ephemeral() as instance:
        released = served(store, store, 1.0, 2.0, 2.4)
        assert release(project, instance)[0].success
        served(store, store, 2.0, 2.5, 2.9, beside=(2.0, 2.4))

        def taken_over(name: str) -> None:  # another promoter takes the lease while this one uploads
            if name == f"put_dir:{RELEASE_DIR}:uploaded":
                time.sleep(READ_EVERY_S)
                other = Lease(store, PROMOTION_LEASE_DIR, "run-took-over")
                store.write_json(f"{PROMOTION_LEASE_DIR}/_LEASE.json", asdict(other.me))

        monkeypatch.setattr(storage, "crash_point", taken_over)
        result, _, _ = release(project, instance)
    assert not result.success
    assert "lost its lease: taken over by host" in result.failure_data_for_node("drafter_release").error.message
    assert release_digest(store) == released and store.listdir("drafter") == ["export", "promotion", "release"]
