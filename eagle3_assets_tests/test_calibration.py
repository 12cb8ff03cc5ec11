"""The held-out estimate calibrated by served figures (`drafter/calibration.py`, issue 43 item 5): exact values."""

from __future__ import annotations

import pytest

from eagle3_assets.drafter.calibration import (
    HISTORY_FILE,
    EstimatePoint,
    correction,
    exported_estimate,
    leave_one_out,
    load_history,
    mean_ratio,
    measured_against,
    ranks,
    record,
    spearman,
)
from eagle3_assets.drafter.evaluate import EvalReport, calibrate
from eagle3_assets.drafter.run import DRAFTER_METRICS_FILE, calibrated_figures
from eagle3_assets.prompts import EVAL_PROMPTS_FILE
from eagle3_assets.storage import ArtifactStore

POINTS = [
    EstimatePoint("eagle3", 3, 3.0, 2.0, "a"),  # (2.0 - 1) / (3.0 - 1) = 0.5
    EstimatePoint("eagle3", 3, 4.0, 3.4, "b"),  # 2.4 / 3.0 = 0.8
    EstimatePoint("eagle3", 7, 5.0, 3.0, "a"),  # another k: its own correction
    EstimatePoint("dflash", 3, 3.0, 1.5, "c"),  # another family: never mixed in
]


def test_correction_is_the_family_mean_excess_ratio_at_k() -> None:
    c = correction(POINTS, "eagle3", 3)
    assert c is not None and (c.ratio, c.points) == (pytest.approx(0.65), 2)
    assert c.apply(5.0) == pytest.approx(1 + 0.65 * 4)  # 3.6
    assert c.apply(1.0) == 1.0  # nothing drafted is still nothing served
    assert correction(POINTS, "eagle3", 7).ratio == pytest.approx(0.5)
    assert correction(POINTS, "dflash", 3).ratio == pytest.approx(0.25)


def test_correction_leaves_out_the_export_being_judged_and_needs_a_point() -> None:
    c = correction(POINTS, "eagle3", 3, leave_out="a")
    assert (c.ratio, c.points) == (pytest.approx(0.8), 1)
    assert correction(POINTS, "dflash", 7) is None
    assert correction(POINTS, "dflash", 3, leave_out="c") is None
    assert correction([EstimatePoint("eagle3", 3, 1.0, 1.0)], "eagle3", 3) is None  # no excess to scale


def test_leave_one_out_predicts_each_point_from_the_others() -> None:
    got = leave_one_out(POINTS)
    assert got[0] == pytest.approx(1 + 0.8 * 2)  # point a by b's ratio: 2.6
    assert got[1] == pytest.approx(1 + 0.5 * 3)  # point b by a's: 2.5
    assert got[2:] == [None, None]  # alone in its family at its k


def test_ranks_and_spearman() -> None:
    assert ranks([10.0, 20.0, 20.0, 5.0]) == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 5]) == 0.0
    with pytest.raises(ValueError, match="spearman: needs two sequences of the same length >= 2, got 1 and 1"):
        spearman([1], [1])
    assert mean_ratio([2.0, 3.0], [1.0, 2.0]) == pytest.approx(1.75)


def test_history_is_kept_and_a_reevaluated_export_replaces_its_points(tmp_path) -> None:
    store = ArtifactStore(tmp_path)
    assert load_history(store) == []
    record(store, POINTS[:2])
    record(store, [EstimatePoint("eagle3", 3, 3.0, 2.2, "a")])
    assert load_history(store) == [POINTS[1], EstimatePoint("eagle3", 3, 3.0, 2.2, "a")]
    assert store.exists(HISTORY_FILE)


def test_exported_estimate_is_the_exported_steps() -> None:
    metrics = {"best_step": 1000, "exported_step": 1000, "best_accept_len_k3": 3.452, "heldout_accept_len_k3": 3.451}
    assert exported_estimate(metrics, 3) == 3.452
    assert exported_estimate({**metrics, "exported_step": 1057}, 3) == 3.451  # export_checkpoint: last
    assert exported_estimate({}, 3) is None


def test_drafter_eval_reports_the_calibrated_estimate_and_keeps_its_own_point(tmp_path) -> None:
    store = ArtifactStore(tmp_path)
    store.write_text(EVAL_PROMPTS_FILE, '{"id": "q1", "prompt": "Where is Avalon?"}\n')
    here = measured_against(store, "")  # EvalReport's engine is "" here
    record(store, [EstimatePoint("eagle3", 3, 3.0, 2.0, "old", here), EstimatePoint("eagle3", 7, 5.0, 3.0, "old", here)])
    # Served against other eval prompts: it would pull the ratio to 0.9, but it measured something else.
    record(store, [EstimatePoint("eagle3", 3, 3.0, 2.8, "elsewhere", "other prompts")])
    store.write_json(DRAFTER_METRICS_FILE, {"best_step": 400, "exported_step": 400, "best_accept_len_k3": 4.0,
                                            "best_accept_len_k7": 6.0})  # fmt: skip
    report = EvalReport(prompts=64, max_tokens=160, export_sha256="new", acceptance={"k3": 2.6, "k7": 3.4})
    lines: list[str] = []
    calibrate(store, store, report, "eagle3", lines.append)
    assert report.estimate == {"k3": 4.0, "k7": 6.0}
    assert report.calibrated_estimate == {"k3": pytest.approx(2.5), "k7": pytest.approx(3.5)}  # 1 + 0.5 * (est - 1)
    assert report.calibration_points == {"k3": 1, "k7": 1}
    assert lines[0] == (
        "drafter_eval: k=3 held-out estimate 4.000, calibrated 2.500 (by 1 past eagle3 evaluation(s) of this store), "
        "served 2.600"
    )
    assert load_history(store)[-2:] == [
        EstimatePoint("eagle3", 3, 4.0, 2.6, "new", here),
        EstimatePoint("eagle3", 7, 6.0, 3.4, "new", here),
    ]
    # Other eval prompts are another measure: no past point calibrates it.
    store.write_text(EVAL_PROMPTS_FILE, '{"id": "q2", "prompt": "Where is Kamivel?"}\n')
    assert measured_against(store, "") != here and measured_against(store, "vllm 0.33") != measured_against(store, "")
    again = EvalReport(prompts=64, max_tokens=160, export_sha256="next", acceptance={"k3": 2.6, "k7": 3.4})
    calibrate(store, store, again, "eagle3", lines.append)
    assert again.calibrated_estimate == {} and again.calibration_points == {"k3": 0, "k7": 0}
    # A family with no past evaluation: reported as not calibrated, and its point kept for the next.
    dflash = EvalReport(prompts=64, max_tokens=160, export_sha256="d", acceptance={"k3": 1.8, "k7": 2.0})
    lines.clear()
    calibrate(store, store, dflash, "dflash", lines.append)
    assert dflash.calibrated_estimate == {} and dflash.calibration_points == {"k3": 0, "k7": 0}
    assert lines[0] == (
        "drafter_eval: k=3 held-out estimate 4.000, served 1.800 (not calibrated: no past dflash evaluation in this store)"
    )


def test_the_drafter_materialization_gives_the_calibrated_estimate() -> None:
    summary = {"best_step": 400, "exported_step": 400, "best_accept_len_k3": 4.0, "best_accept_len_k7": 6.0}
    got = calibrated_figures(POINTS, "eagle3", summary)
    assert got == {
        "estimate_k3": 4.0, "calibration_evals_k3": 2, "calibrated_estimate_k3": pytest.approx(1 + 0.65 * 3),
        "estimate_k7": 6.0, "calibration_evals_k7": 1, "calibrated_estimate_k7": pytest.approx(1 + 0.5 * 5),
    }  # fmt: skip
    assert calibrated_figures([], "dflash", summary) == {
        "estimate_k3": 4.0, "calibration_evals_k3": 0, "estimate_k7": 6.0, "calibration_evals_k7": 0,
    }  # fmt: skip


def test_the_history_barely_above_one_locked_or_on_a_full_disk_never_misleads_or_fails_the_eval(small_tmpfs, tmp_path):
    """Issue 52, item 11: an estimate of 1.001 multiplied the ratio by a thousand; two evals rewrote the history at
    once with no lock; a full disk there failed an hours-long eval with nothing kept."""
    from eagle3_assets.drafter.calibration import HISTORY_LEASE_DIR
    from eagle3_assets.leases import Lease, LeaseHeld

    barely = [EstimatePoint("eagle3", 3, 1.001, 1.5, "x"), EstimatePoint("eagle3", 3, 3.0, 2.0, "y")]
    c = correction(barely, "eagle3", 3)
    assert c is not None and (c.ratio, c.points) == (pytest.approx(0.5), 1)

    store = ArtifactStore(tmp_path / "store")
    record(store, POINTS[:1])
    with Lease(store, HISTORY_LEASE_DIR, "the other family's eval"):
        with pytest.raises(LeaseHeld, match=r"drafter_eval/history is held by another process \(.*run the other "):
            record(store, POINTS[1:2], wait_s=0.0)
        assert load_history(store) == POINTS[:1]  # nothing rewritten under the other's lease
    assert record(store, POINTS[1:2]) == POINTS[:2]

    full = ArtifactStore(small_tmpfs / "store")
    full.write_text(EVAL_PROMPTS_FILE, '{"id": "q1", "prompt": "Where is Avalon?"}\n')
    full.write_json(DRAFTER_METRICS_FILE, {"heldout_accept_len_k3": 3.0})
    with open(small_tmpfs / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"x" * 512)
    report = EvalReport(prompts=64, max_tokens=160, export_sha256="new", acceptance={"k3": 2.6, "k7": 3.4})
    lines: list[str] = []
    calibrate(full, full, report, "eagle3", lines.append)
    assert report.estimate == {"k3": 3.0}
    assert lines[-1].startswith(
        f"drafter_eval: this evaluation's points are not kept in {full.url_of(HISTORY_FILE)} ("
    ) and "No space left on device" in lines[-1]
