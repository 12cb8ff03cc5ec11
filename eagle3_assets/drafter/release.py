"""The released drafter: the export meant to be served, replaced only by one that serves at least as well.

`drafter_eval` serves the new export and, beside it, the released one (same prompts, same k,
same engine: `evaluate.py`); its report decides. The new export is promoted (copied to
`drafter/release/` with `release.json`, the figures it was released on) only when
  - its output equals greedy decoding,
  - it serves at `evaluation.release_min_acceptance` or more at every k: an export whose drafts
    are never accepted (a zeroed or misloaded head serves at 1.0) is never released, not even first,
  - and it serves at least the released drafter's mean acceptance length at every k,
  - also in every context-length bin (`context_bins`) holding at least `evaluation.min_prompts_per_bin` prompts
    in both reports: a drafter that gained on short prompts must not buy it with long ones. A bin with fewer is
    not judged, and a release made before bins existed is compared on the whole set alone, as before.
Otherwise the released drafter stays and the decision's reason names both figures (and the bin).

With `traffic` set, `drafter_eval` serves the traffic's held-out split beside the original held-out prompts
(`prompt_sets.py`), and the gate judges where it matters (`traffic_decision`): the new export must beat the released
drafter on the traffic's prompts (at least its figure at every k, above it at one, and at least its figure in each
context bin judged there) and serve at least `1 - evaluation.original_regression_margin` of its figure on the original
prompts at every k; the reason names both drafters' figures on both sets.

A report is a basis for promotion only against the release it was served beside (`beside["released"]` names the
digest of the weights it served, `release_digest`): served beside another release, or before anything was released,
its family is not promoted and its eval is named to rematerialize (a change of release makes every family's eval due,
`artifacts.Artifact.beside_release`); the other families are still judged. The family whose export is the release
already was judged when it was promoted (its eval stays current, `artifacts.RELEASE_JUDGED`): it stays, unless another
family serves at least as well beside it.

A release belongs to the target it was released for (`release.json` keeps the version of the store's
`target_model`, docs/DESIGN.md §9). A drafter released for another target is no baseline: it is not served
beside the new export, and the new export is judged as a first release, which replaces it only once a person
approved that for this target (`evaluation.replace_release_for_target`); until then the release stays.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from eagle3_assets.artifacts import RELEASE_DIR
from eagle3_assets.drafter.eval_report import (
    ORIGINAL_SET,
    TRAFFIC_SET,
    ContextBins,
    Served,
    ServedReport,
)
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINER_LEASE_DIR
from eagle3_assets.errors import Refusal
from eagle3_assets.families import EAGLE3, family_spec
from eagle3_assets.leases import settled
from eagle3_assets.provenance import judged, read_record
from eagle3_assets.release_record import ReleasedOn, ReleaseRecord, read_release_record
from eagle3_assets.storage import ArtifactStore

RELEASED = "released"  # the name `drafter_eval` reports the released drafter under, beside ours
# One promotion at a time decides and publishes: its lease lives beside the release, never in the directory it replaces.
PROMOTION_LEASE_DIR = "drafter/promotion"
# How a reason names each prompt set (`prompt_sets.py`).
SET_NAMES = {TRAFFIC_SET: "the traffic's held-out prompts", ORIGINAL_SET: "the original held-out prompts"}
# In an eval's record (`extra`): the digest of the export its report is of, which ties the record to the report.
EVALUATED_SHA256 = "export_sha256"


class NotComparable(Refusal):
    """The report is not of the export now in the store, or lacks the figures of the drafter released now beside it."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate: dict[str, float]  # "k3" -> mean acceptance length of the new export
    released: dict[str, float] | None  # the released drafter's, served beside it; None when nothing is released
    released_now: bool = False  # its export is the release (its own promotion): kept, unless another family beats it
    # With `traffic` set, `candidate` and `released` are the figures on the traffic's held-out prompts, and these the
    # figures on the original held-out prompts (`traffic_decision`); None without.
    candidate_original: dict[str, float] | None = None
    released_original: dict[str, float] | None = None


def target_version(store: ArtifactStore) -> str:
    """The version of the target the store's artifacts are made from (its `target_model` record)."""
    record = read_record(store, "target_model")
    return record.version if record is not None else "none"


def other_target(store: ArtifactStore, target: str) -> str | None:
    """Why the released drafter is no baseline for an export of `target` (the version `target_version` gives): it
    was released for another target. None when it is one, or when nothing is released."""
    if (record := read_release_record(store)) is None:
        return None
    released_for = record.target or target  # released before releases named their target: the baseline of any
    # A release made before targets were known by their bytes names the version the target's record had then; the
    # record keeps it (`provenance.sampled_version`), so the upgrade itself never drops a release.
    record = read_record(store, "target_model")
    if released_for in (target, record.extra.get("sampled_version") if record is not None else None):
        return None
    return (
        f"the drafter released at {store.url_of(RELEASE_DIR)} was released for another target (target_model "
        f"version {released_for}, now {target})"
    )


def release_decision(
    report: ServedReport,
    released: dict[str, float] | None,
    min_acceptance: float,
    released_bins: ContextBins | None = None,
    min_prompts_per_bin: int = 5,
) -> Decision:
    """Whether the export `report` evaluated replaces the released drafter (module docstring); `released_bins` are
    the released drafter's figures per context bin (None or empty: compared on the whole set alone)."""
    new = report.export.acceptance

    def decision(promote: bool, reason: str) -> Decision:
        return Decision(promote, reason, new, released)

    if not report.export.outputs_match_greedy:
        return decision(False, "the new export changed the greedy output under speculative decoding: never released")
    if low := [k for k, v in new.items() if v < min_acceptance]:
        k = low[0]
        return decision(
            False,
            f"the new export serves at mean acceptance length {new[k]:.3f} at k={k[1:]}, below "
            f"evaluation.release_min_acceptance {min_acceptance:g}: its drafts are (almost) never accepted, as with "
            "a zeroed or misloaded head; never released",
        )
    if released is None:
        return decision(True, "first release: " + ", ".join(f"k={k[1:]} {v:.3f}" for k, v in new.items()))
    if worse := [k for k in new if new[k] < released.get(k, 0.0)]:
        k = worse[0]
        return decision(
            False,
            f"the new export serves at mean acceptance length {new[k]:.3f} at k={k[1:]}, the released drafter at "
            f"{released[k]:.3f} (same prompts, k and engine): not promoted, the released drafter stays",
        )
    ours, theirs = report.export.bins, released_bins or ContextBins()
    judged, worse_bin = bin_regression(ours, theirs, min_prompts_per_bin)
    if worse_bin is not None:
        b, k = worse_bin
        return decision(
            False,
            f"the new export serves at mean acceptance length {ours.acceptance[b][k]:.3f} at k={k[1:]} on prompts of "
            f"{b} tokens ({ours.prompts[b]} prompts), the released drafter at {theirs.acceptance[b][k]:.3f} (same "
            "prompts, k and engine): not promoted, the released drafter stays",
        )
    return decision(
        True,
        "at least as good as the released drafter: "
        + ", ".join(f"k={k[1:]} {new[k]:.3f} >= {released[k]:.3f}" for k in new if k in released)
        + bins_judged(ours, theirs, judged, min_prompts_per_bin),
    )


def traffic_decision(
    report: ServedReport,
    released: dict[str, Served] | None,
    min_acceptance: float,
    margin: float,
    min_prompts_per_bin: int = 5,
) -> Decision:
    """With `traffic` set: whether the export `report` evaluated replaces the released drafter, judged where it matters
    (docs/DESIGN.md §9). It must beat the released drafter on the traffic's held-out prompts (at least its figure at
    every k, above it at one at least, and at least its figure in each context bin of enough prompts) and serve at
    least (1 - `margin`) x its figure on the original held-out prompts at every k. `released` holds the released
    drafter's figures per prompt set (None: nothing released). Every reason past the first two rules names both
    drafters' figures on both sets."""
    traffic, original = report.export.sets[TRAFFIC_SET], report.export.sets[ORIGINAL_SET]
    new, new_o = traffic.acceptance, original.acceptance
    bar, bar_o = (released[TRAFFIC_SET], released[ORIGINAL_SET]) if released else (None, None)

    def decision(promote: bool, reason: str) -> Decision:
        return Decision(promote, reason, new, bar and bar.acceptance, candidate_original=new_o,
                        released_original=bar_o and bar_o.acceptance)  # fmt: skip

    if not report.export.outputs_match_greedy:
        return decision(False, "the new export changed the greedy output under speculative decoding: never released")
    if not new:
        return decision(False, "no prompt of the traffic's held-out split was served (traffic/heldout.jsonl is empty: "
                        "log more traffic or raise traffic.heldout_share): nothing to judge the new export on; not "
                        "promoted")  # fmt: skip
    for name, figures in ((SET_NAMES[TRAFFIC_SET], new), (SET_NAMES[ORIGINAL_SET], new_o)):
        if low := [k for k, v in figures.items() if v < min_acceptance]:
            return decision(
                False,
                f"the new export serves at mean acceptance length {figures[low[0]]:.3f} at k={low[0][1:]} on {name}, "
                f"below evaluation.release_min_acceptance {min_acceptance:g}: its drafts are (almost) never accepted, "
                "as with a zeroed or misloaded head; never released",
            )
    if bar is None or bar_o is None:
        return decision(True, "first release: " + _on_sets(new, new_o))
    both = _on_sets(new, new_o, bar.acceptance, bar_o.acceptance)
    worse = [k for k in new if new[k] < bar.acceptance.get(k, 0.0)]
    if worse or not [k for k in new if new[k] > bar.acceptance.get(k, 0.0)]:
        at = f"at k={worse[0][1:]} it serves less" if worse else "it serves no more at any k"
        return decision(False, f"the new export does not beat the released drafter on {SET_NAMES[TRAFFIC_SET]} ({at}): "
                        f"not promoted, the released drafter stays; {both}")  # fmt: skip
    floor = {k: v * (1 - margin) for k, v in bar_o.acceptance.items()}
    if regressed := [k for k in new_o if k in floor and new_o[k] < floor[k]]:
        k = regressed[0]
        return decision(
            False,
            f"the new export beats the released drafter on {SET_NAMES[TRAFFIC_SET]} but serves "
            f"{1 - new_o[k] / bar_o.acceptance[k]:.1%} less on {SET_NAMES[ORIGINAL_SET]} at k={k[1:]}, more than "
            f"evaluation.original_regression_margin {margin:g}: not promoted, the released drafter stays; {both}",
        )
    judged, worse_bin = bin_regression(traffic.bins, bar.bins, min_prompts_per_bin)
    if worse_bin is not None:
        b, k = worse_bin
        return decision(
            False,
            f"the new export serves at mean acceptance length {traffic.bins.acceptance[b][k]:.3f} at k={k[1:]} on "
            f"{SET_NAMES[TRAFFIC_SET]} of {b} tokens ({traffic.bins.prompts[b]} prompts), the released drafter at "
            f"{bar.bins.acceptance[b][k]:.3f}: not promoted, the released drafter stays; {both}",
        )
    return decision(
        True,
        f"beats the released drafter on {SET_NAMES[TRAFFIC_SET]}, and within evaluation.original_regression_margin "
        f"{margin:g} of it on {SET_NAMES[ORIGINAL_SET]}: {both}"
        + bins_judged(traffic.bins, bar.bins, judged, min_prompts_per_bin),
    )


def _on_sets(
    new: dict[str, float], new_o: dict[str, float],
    bar: dict[str, float] | None = None, bar_o: dict[str, float] | None = None,
) -> str:  # fmt: skip
    """Both sets' figures, the released drafter's beside ours: "traffic held-out k=3 2.400 (released 2.300), …"."""

    def one(name: str, ours: dict[str, float], theirs: dict[str, float] | None) -> str:
        shown = [f"k={k[1:]} {v:.3f}" + (f" (released {theirs[k]:.3f})" if theirs and k in theirs else "")
                 for k, v in ours.items()]  # fmt: skip
        return f"{name} " + ", ".join(shown)

    return f"{one('traffic held-out', new, bar)}; {one('original held-out', new_o, bar_o)}"


def bin_regression(
    ours: ContextBins, theirs: ContextBins, min_prompts_per_bin: int
) -> tuple[list[str], tuple[str, str] | None]:
    """The context bins judged (enough prompts in both figures), and the first (bin, k) where ours serves less."""
    judged = [b for b in ours.enough(min_prompts_per_bin) if b in theirs.enough(min_prompts_per_bin)]
    for b in judged:
        mine, bar = ours.acceptance[b], theirs.acceptance[b]
        if worse := [k for k in mine if k in bar and mine[k] < bar[k]]:
            return judged, (b, worse[0])
    return judged, None


def bins_judged(ours: ContextBins, theirs: ContextBins, judged: list[str], min_prompts_per_bin: int) -> str:
    """What a passing decision says of the bins: which were judged, which not and why."""
    unjudged = [b for b in ours.acceptance if b not in judged]
    return (
        (f"; and in each context bin of {min_prompts_per_bin} or more prompts ({', '.join(judged)})" if judged else "")
        + (
            "; not judged, too few prompts or no released figures: "
            + ", ".join(f"{b} ({ours.prompts.get(b, 0)} prompts)" for b in unjudged)
            if unjudged and theirs.acceptance
            else ""
        )
    )


def export_digest(store: ArtifactStore, rel: str = EXPORT_DIR) -> str:
    """sha256 of the export's weights: which export a report is of."""
    return hashlib.sha256(store.read_bytes(f"{rel}/model.safetensors")).hexdigest()


def release_digest(store: ArtifactStore) -> str | None:
    """sha256 of the released drafter's weights (as `promote` recorded it, or read for a release made before), None
    when nothing is released: which release a report was served beside."""
    if (record := read_release_record(store)) is None:
        return None
    return record.export_sha256 or export_digest(store, RELEASE_DIR)


def decide(
    store: ArtifactStore,
    report: ServedReport,
    target: str,
    min_acceptance: float,
    source: ArtifactStore | None = None,
    min_prompts_per_bin: int = 5,
    family: str = EAGLE3.name,
    approved_target: str | None = None,
    original_margin: float | None = None,
) -> Decision:
    """`release_decision` on the report of the export now in `source` (a family's directory, `FamilySpec.root`;
    the store itself by default), against the drafter released for `target` (nothing released for it: a first
    release, which replaces a release of another target only when a person approved it for `target`,
    `evaluation.replace_release_for_target`, saying so). With `traffic` set, `original_margin` is
    `evaluation.original_regression_margin` and the report is judged on both prompt sets (`traffic_decision`); None
    without. A report that is not of that export, or not served beside that release (or, with `traffic`, not on both
    sets), is no basis: not promoted, and the reason names `family`'s eval to rematerialize."""
    try:
        return _decide(
            store, report, target, min_acceptance, source or store, min_prompts_per_bin, family, approved_target,
            original_margin,
        )  # fmt: skip
    except NotComparable as e:
        return Decision(False, str(e), report.export.acceptance, None)


def _decide(
    store: ArtifactStore, report: ServedReport, target: str, min_acceptance: float, source: ArtifactStore,
    min_prompts_per_bin: int, family: str, approved_target: str | None, original_margin: float | None,
) -> Decision:  # fmt: skip
    # A replacement a kill interrupted is finished, never read half done: the export by its trainer (or in its stead
    # once none lives), the release here, by its owner (`store` is guarded by the promotion's lease).
    settled(source, EXPORT_DIR, TRAINER_LEASE_DIR)
    store.settle(RELEASE_DIR)
    name = family_spec(family).eval_asset
    if report.export_sha256 != export_digest(source):
        raise NotComparable(
            f"the {name} report ({report.export_sha256 or 'no digest'}) is not of the export now at "
            f"{source.url_of(EXPORT_DIR)}: not promoted; rematerialize {name} first"
        )
    on_sets = original_margin is not None
    if on_sets and (missing := [s for s in (TRAFFIC_SET, ORIGINAL_SET) if s not in report.export.sets]):
        raise NotComparable(
            f"the {name} report has no figures on {SET_NAMES[missing[0]]} (served before `traffic` was set): not "
            f"promoted; rematerialize {name}, which serves both prompt sets"
        )
    other = other_target(store, target)
    if other is None and report.export_sha256 == release_digest(store):
        return _released_now(store, report, family, on_sets)
    if on_sets:
        released = None if other else released_sets(store, report, family)
        decision = traffic_decision(report, released, min_acceptance, original_margin, min_prompts_per_bin)
    else:
        decision = release_decision(
            report,
            None if other else released_figures(store, report, family),
            min_acceptance,
            None if other else released_bins(store, report),
            min_prompts_per_bin,
        )
    if other:
        # Dropping a release cannot be undone, and a target changes by accident too (issue 52, item 5): a person says.
        approved = approved_target == target
        outcome = "nothing is released for this target"
        if decision.promote:
            outcome = (
                "replaced, as approved (evaluation.replace_release_for_target)"
                if approved
                else "kept: a release for another target is replaced only by a person's approval; set "
                f"evaluation.replace_release_for_target: {target} to release this export in its place"
            )
        return replace(decision, promote=decision.promote and approved, reason=f"{decision.reason}; {other}: {outcome}",
                       released=None, released_original=None)  # fmt: skip
    return decision


def _released_now(store: ArtifactStore, report: ServedReport, family: str, on_sets: bool) -> Decision:
    """The report this release was promoted on (or its eval made again, beside itself): it was judged then, and every
    other family's eval was served beside it since (a change of release makes them due)."""
    record = read_release_record(store)
    assert record is not None, "a release of this export is there: its digest was read"
    figures = record.released_on.acceptance
    released_on = ", ".join(f"k={k[1:]} {v:.3f}" for k, v in figures.items())
    sets = record.sets
    if on_sets and TRAFFIC_SET in sets and ORIGINAL_SET in sets:
        released_on = _on_sets(sets[TRAFFIC_SET].acceptance, sets[ORIGINAL_SET].acceptance)
    candidate = report.export.sets[TRAFFIC_SET].acceptance if on_sets else report.export.acceptance
    return Decision(
        True, f"the {family} export is the release (sha256 {report.export_sha256}): it stays, released on {released_on}",
        candidate, figures, released_now=True,
    )  # fmt: skip


def released_sets(store: ArtifactStore, report: ServedReport, family: str = EAGLE3.name) -> dict[str, Served] | None:
    """The released drafter's figures on each prompt set served beside the new export, as `released_figures` takes
    its whole-set ones (the bars it was released at, per set, when it no longer serves greedily here); None when
    nothing is released."""
    if released_figures(store, report, family) is None:  # which release it was served beside, checked
        return None
    beside, name = report.beside[RELEASED], family_spec(family).eval_asset
    if missing := [s for s in (TRAFFIC_SET, ORIGINAL_SET) if s not in beside.sets]:
        raise NotComparable(
            f"the {name} report has no figures of the released drafter on {SET_NAMES[missing[0]]}: not promoted; "
            f"rematerialize {name}, which serves both prompt sets"
        )
    if beside.outputs_match_greedy:
        return beside.sets
    record = read_release_record(store)
    recorded = record.sets if record is not None else {}
    out = {}
    for s, served in beside.sets.items():
        bar = recorded.get(s, ReleasedOn())
        out[s] = Served({k: bar.acceptance.get(k, v) for k, v in served.acceptance.items()}, False, bar.bins)
    return out


def released_figures(
    store: ArtifactStore, report: ServedReport, family: str = EAGLE3.name
) -> dict[str, float] | None:
    """The released drafter's acceptance served beside the new export (`report`), None when nothing is released.
    Figures of another drafter than the one released now (served before it was released) are no measure of it."""
    released = release_digest(store)
    if released is None:
        return None
    beside, name = report.beside.get(RELEASED), family_spec(family).eval_asset
    if beside is None:
        raise NotComparable(
            f"a drafter is released ({store.url_of(RELEASE_DIR)}, sha256 {released}) but the {name} report has no "
            f"figures of it served beside the new export (made before it was released): not promoted; rematerialize "
            f"{name}, which serves both"
        )
    if beside.sha256 != released:
        raise NotComparable(
            f"the {name} report was served beside another release (sha256 {beside.sha256 or 'not recorded'}) than "
            f"the one at {store.url_of(RELEASE_DIR)} now (sha256 {released}): not promoted; rematerialize {name}, "
            "which serves both"
        )
    if not beside.outputs_match_greedy:
        # It no longer serves greedily here (another engine, a changed kernel): its figures now are no measure, and a
        # baseline of 1.0 would let any working export replace it. It stays the bar it was released at.
        record = read_release_record(store)
        recorded = record.released_on.acceptance if record is not None else {}
        return {k: recorded.get(k, v) for k, v in beside.acceptance.items()}
    return beside.acceptance


def released_bins(store: ArtifactStore, report: ServedReport) -> ContextBins | None:
    """The released drafter's figures per context bin served beside the new export, as `released_figures` takes
    its whole-set ones: the bar it was released at when it no longer serves greedily here. Empty when it was served
    (or released) before bins existed; None when nothing is released."""
    if (record := read_release_record(store)) is None or (beside := report.beside.get(RELEASED)) is None:
        return None
    return beside.bins if beside.outputs_match_greedy else record.released_on.bins


def promote(
    store: ArtifactStore, decision: Decision, report: ServedReport, target: str, source: ArtifactStore | None = None,
    family: str = EAGLE3.name,
) -> str:  # fmt: skip
    """Copy `family`'s export (in `source`, the store by default) to `drafter/release/` with the figures it was
    released on, its family, the version of the target it was released for and the eval it was judged by
    (`RELEASE_JUDGED`: that eval stays current, every other one is due); returns the release's URL. The release is
    left as it is when it already is this export for this target (`Decision.released_now`)."""
    source = source or store
    if release_digest(store) == report.export_sha256 and other_target(store, target) is None:
        return store.url_of(RELEASE_DIR)
    # The eval's record, when it is the one of this report (a record before it, of an eval that failed after its
    # report, is not): which inputs and which release it was made beside.
    evaluated = read_record(store, family_spec(family).eval_asset)
    of_report = evaluated is not None and evaluated.extra.get(EVALUATED_SHA256) == report.export_sha256
    by = judged(evaluated) if of_report else {}
    with tempfile.TemporaryDirectory(prefix="drafter-release-") as tmp:
        for name in source.listdir(EXPORT_DIR):
            (Path(tmp) / name).write_bytes(source.read_bytes(f"{EXPORT_DIR}/{name}"))
        copied = hashlib.sha256((Path(tmp) / "model.safetensors").read_bytes()).hexdigest()
        if copied != report.export_sha256:  # rewritten between drafter_eval and now: not what was judged
            raise NotComparable(
                f"the export at {source.url_of(EXPORT_DIR)} changed since drafter_eval served it (sha256 {copied}, "
                f"served {report.export_sha256}): not released; rematerialize drafter_eval"
            )
        ReleaseRecord(
            target=target,
            family=family,
            released_on=ReleasedOn(decision.candidate, report.export.bins),
            # With `traffic` set: the figures on each prompt set, the bars when it no longer serves greedily.
            sets={s: ReleasedOn(f.acceptance, f.bins) for s, f in report.export.sets.items()},
            replaced=decision.released,
            reason=decision.reason,
            export=source.url_of(EXPORT_DIR),
            export_sha256=report.export_sha256,
            report=report.about,
            judged=by,
        ).write(Path(tmp))
        store.put_dir(tmp, RELEASE_DIR)
    return store.url_of(RELEASE_DIR)


def choose(decisions: dict[str, Decision]) -> tuple[str | None, dict[str, str]]:
    """Across families, each judged against the released drafter by `decide`: the one to promote (the highest mean
    acceptance length at the largest k among those `decide` would promote; on a tie, the first named) and why each
    other one is not. A family whose export is the release already (`Decision.released_now`) is chosen only when no
    other passes: one that serves at least as well beside it, in the same run, replaces it. None when no family
    passes."""
    passing = [f for f, d in decisions.items() if d.promote]
    reasons = {f: d.reason for f, d in decisions.items() if not d.promote}
    if not passing:
        return None, reasons
    kept = [f for f in passing if decisions[f].released_now]
    if len(kept) < len(passing):
        passing = [f for f in passing if f not in kept]
    else:
        kept = []
    k = max(decisions[passing[0]].candidate, key=lambda name: int(name[1:]))
    best = max(passing, key=lambda f: decisions[f].candidate.get(k, 0.0))
    won = decisions[best].candidate
    for f in kept:
        reasons[f] = f"the {f} export was the release; {best} serves at least as well beside it: {best} is released"
    for f in passing:
        if f != best:
            mine = decisions[f].candidate
            reasons[f] = (
                f"{f} serves at mean acceptance length {mine.get(k, 0.0):.3f} at k={k[1:]}, {best} at {won[k]:.3f} "
                f"(same prompts, k and engine): {best} is released, {f} is not"
            )
    return best, reasons
