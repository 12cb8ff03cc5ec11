"""The held-out acceptance estimate, calibrated by what vLLM served (issue 43, item 5).

The estimate (`acceptance.py`) scores teacher-forced held-out *training* rows: prompts about entities the drafter
saw. vLLM serves prompts it never saw (the demo's eval prompts name other entities), so the estimate overstates
what is served, and by a different factor per family (BENCHMARKS.md, `estimate vs served`: EAGLE-3 1.32x at k=3,
DFlash 1.6-1.7x). It still ranks drafters. Every `drafter_eval` measures both figures for the export it serves, so
this store keeps them (`HISTORY_FILE`, one point per family, k and export) and corrects a new estimate by them:

    calibrated = 1 + ratio * (estimate - 1),  ratio = mean over the family's past points at this k of
                                                       (served - 1) / (estimate - 1)

on the tokens beyond the one every target forward gives (a drafter estimated at 1.0 serves 1.0, whatever the
ratio). A point whose estimate is within `MIN_EXCESS` of 1.0 says nothing of the ratio (1.001 would multiply it by a
thousand): it is kept, never used. A family with no past point at that k has no calibrated figure: it is reported as not calibrated, never
borrowed from another family (their ratios differ), nor from points served against another target, other eval
prompts or another engine (`measured_against`). `leave_one_out` is how the correction is judged (BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from eagle3_assets.drafter.release import target_version
from eagle3_assets.leases import RUN_ID_ENV, Lease, LeaseHeld
from eagle3_assets.prompts import EVAL_PROMPTS_FILE
from eagle3_assets.provenance import digest
from eagle3_assets.storage import ArtifactStore

HISTORY_FILE = "drafter_eval/estimate_history.json"  # at the store's top: every family's points in one list
# Every family's eval adds to the one history: one rewrite at a time, under this lease (two evals at once kept both).
HISTORY_LEASE_DIR = "drafter_eval/history"
HISTORY_WAIT_S = 300.0
MIN_EXCESS = 0.05  # the least estimate - 1 a point must have to calibrate


@dataclass(frozen=True)
class EstimatePoint:
    """One served export at one k: its held-out estimate and the mean acceptance length vLLM served."""

    family: str
    k: int
    estimate: float
    served: float
    export_sha256: str = ""  # which export (`release.export_digest`): a re-evaluation replaces its points
    against: str = ""  # what it was served against (`measured_against`): only points of the same calibrate


@dataclass(frozen=True)
class Correction:
    family: str
    k: int
    ratio: float  # mean (served - 1) / (estimate - 1) over the points
    points: int  # past evaluations it rests on

    def apply(self, estimate: float) -> float:
        return 1.0 + self.ratio * (estimate - 1.0)


def measured_against(store: ArtifactStore, engine: str) -> str:
    """What a served figure of this store is measured against: the target, the eval prompts' bytes and the engine.
    Another of any serves other figures for the same estimate."""
    prompts = store.read_bytes(EVAL_PROMPTS_FILE) if store.exists(EVAL_PROMPTS_FILE) else b""
    return digest({"target": target_version(store), "eval_prompts": hashlib.sha256(prompts).hexdigest(), "engine": engine})


def correction(
    points: Sequence[EstimatePoint], family: str, k: int, *, against: str = "", leave_out: str = ""
) -> Correction | None:
    """The family's correction at k from `points` served `against` the same (those of export `leave_out` left out);
    None without any."""
    usable = [
        p for p in points
        if p.family == family and p.k == k and p.against == against and p.estimate - 1.0 >= MIN_EXCESS
        and not (leave_out and p.export_sha256 == leave_out)
    ]  # fmt: skip
    if not usable:
        return None
    ratio = sum((p.served - 1.0) / (p.estimate - 1.0) for p in usable) / len(usable)
    return Correction(family, k, ratio, len(usable))


def leave_one_out(points: Sequence[EstimatePoint]) -> list[float | None]:
    """Each point's calibrated estimate from the others (None where its family has no other point at its k)."""
    out: list[float | None] = []
    for i, p in enumerate(points):
        others = [q for j, q in enumerate(points) if j != i]
        c = correction(others, p.family, p.k, against=p.against)
        out.append(None if c is None else c.apply(p.estimate))
    return out


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for m in range(i, j + 1):
            r[order[m]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); 0.0 when either side is constant."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman: needs two sequences of the same length >= 2, got {len(xs)} and {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return 0.0 if vx == 0 or vy == 0 else cov / (vx * vy) ** 0.5


def mean_ratio(predicted: Sequence[float], served: Sequence[float]) -> float:
    """Mean of predicted / served (1.0: right on average)."""
    if not predicted or len(predicted) != len(served):
        raise ValueError(
            f"mean_ratio: needs two non-empty sequences of the same length, got {len(predicted)} and {len(served)}"
        )
    return sum(p / s for p, s in zip(predicted, served)) / len(predicted)


def load_history(store: ArtifactStore) -> list[EstimatePoint]:
    """This store's past (estimate, served) points, [] before the first drafter_eval that kept them."""
    if not store.exists(HISTORY_FILE):
        return []
    return [EstimatePoint(**p) for p in store.read_json(HISTORY_FILE)["points"]]


def record(store: ArtifactStore, new: Sequence[EstimatePoint], wait_s: float = HISTORY_WAIT_S) -> list[EstimatePoint]:
    """Add `new` to the history (an export evaluated again replaces its own points at those k); the history. One
    writer at a time (`HISTORY_LEASE_DIR`): another family's eval recording now is waited for, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with Lease(store, HISTORY_LEASE_DIR, os.environ.get(RUN_ID_ENV, "")) as lease:
                replaced = {(p.family, p.k, p.export_sha256) for p in new if p.export_sha256}
                kept = [p for p in load_history(store) if (p.family, p.k, p.export_sha256) not in replaced]
                points = [*kept, *new]
                store.guarded(lease.check).write_json(HISTORY_FILE, {"points": [asdict(p) for p in points]})
                return points
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def exported_estimate(metrics: dict[str, object], k: int) -> float | None:
    """The held-out estimate at k of the weights the drafter exported (`drafter/metrics.json`): the best
    evaluation's when that step was exported, else the last step's; None when the run evaluated nothing."""
    best_step, exported = metrics.get("best_step"), metrics.get("exported_step")
    key = f"best_accept_len_k{k}" if best_step is not None and best_step == exported else f"heldout_accept_len_k{k}"
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else None
