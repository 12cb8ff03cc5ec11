"""A published drafter imported as the release, served alone on the held-out prompts before any drafter of this store
is evaluated (issue 53, item 1): what it serves is the baseline the release gate holds.

The passes are drafter_eval's own, asked for with the same arguments (`evaluate.served_or_reused`): plain greedy
decoding and the release at each k, on the same prompts (the original held-out prompts, then the traffic's held-out
split with `traffic` set), kept in the store by what determines them (`served_passes.py`). The first drafter_eval
serves its export beside the release and reads these three passes instead of serving them again, so the figure the
gate compares the first export against is this one, and serving the import first costs no engine start (on a GPU
node, a load of the target) that the first eval would not have made.

The figures go into the release's record (`release.json`, its `acceptance` and, with `traffic`, each set's): the bar
the release is held to if it no longer serves greedily beside a later export (`release.released_figures`), and what
`drafter_release` names when nothing beats it. The report (`release_baseline/report.json`) names the kept passes, so
no eval's pruning removes them before the first eval reads them.

Only an import is served here: a release this store promoted was served when its eval judged it, and every eval serves
the release beside its own export.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.eval_report import ABOUT, BASELINE_REPORT_FILE, Served
from eagle3_assets.drafter.evaluate import (
    PLAIN_RUN,
    drafter_run,
    eval_max_tokens,
    served_copy,
    served_or_reused,
    served_prompts,
)
from eagle3_assets.drafter.imported_release import imported_from
from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR, RELEASE_DIR, RELEASED, other_target, target_version
from eagle3_assets.drafter.served_passes import REPORT_KEYS, drafter_digests
from eagle3_assets.families import family_spec
from eagle3_assets.leases import settled
from eagle3_assets.release_record import RELEASE_RECORD, ReleasedOn, ReleaseRecord, read_release_record
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel


@dataclass(frozen=True)
class Baseline:
    reason: str  # what was served and what it scored, or why nothing was
    figures: dict[str, Any] | None = None  # the release's figures in the report's form (`EvalReport.add_beside`)

    @property
    def served(self) -> Served | None:
        return None if self.figures is None else Served.from_json(self.figures)


def serve_release_baseline(
    store: ArtifactStore, target: TargetModel, settings: Settings, log: Callable[[str], None] = print
) -> Baseline:
    """Serve the imported release alone (plain, then at each k) on the held-out prompts and record what it served in
    its `release.json`; nothing when the release is no import, or is another target's. The caller holds the
    promotion lease: the record is rewritten in place."""
    settled(store, RELEASE_DIR, PROMOTION_LEASE_DIR)
    record = read_release_record(store)
    if record is None:
        return Baseline("nothing is released: set `start_from` to start from a published drafter")
    if not record.imported:
        return Baseline(
            f"the release is no import ({record.reason}): every drafter_eval serves it beside its own export"
        )
    if other := other_target(store, target_version(store)):
        return Baseline(f"{other}: the import is not served with this target")
    max_tokens = eval_max_tokens(settings)
    served = served_prompts(store, target, settings, max_tokens)
    method = family_spec(record.family).vllm_method
    with tempfile.TemporaryDirectory(prefix="release-baseline-") as tmp:
        release_dir = served_copy(store, RELEASE_DIR, Path(tmp) / "release")
        digests = drafter_digests(release_dir)
        labels = ["plain", *(f"{RELEASED} k={k}" for k in SPECULATIVE_TOKENS)]
        runs = [PLAIN_RUN, *(drafter_run(release_dir, method, k) for k in SPECULATIVE_TOKENS)]
        log(
            f"release_baseline: the imported release ({record.imported.get('source')}, {record.family}) served alone on "
            f"{served.report.prompts} held-out prompts ({max_tokens} tokens each), plain and at "
            f"k={', '.join(map(str, SPECULATIVE_TOKENS))}"
        )
        plain, *speculative = served_or_reused(
            store, target, settings, served, labels, runs, log, drafters={str(release_dir): digests.files}
        )
    report = served.report
    for k, spec in zip(SPECULATIVE_TOKENS, speculative, strict=True):
        report.add_beside(RELEASED, store.url_of(RELEASE_DIR), k, plain.result, spec.result, digests.weights)
    figures = report.beside[RELEASED]
    store.write_json(
        BASELINE_REPORT_FILE,
        {**{k: getattr(report, k) for k in ABOUT}, "release": figures, REPORT_KEYS: report.served_passes},
    )
    baseline = Served.from_json(figures)
    on = ", ".join(f"k={k[1:]} {v:.3f}" for k, v in baseline.acceptance.items())
    greedy = "" if baseline.outputs_match_greedy else "; its output is not plain greedy decoding's"
    reason = f"{imported_from(record.imported)}; served alone on the held-out prompts before any export: {on}{greedy}"
    store.write_json(
        RELEASE_RECORD,
        replace(
            record, released_on=ReleasedOn(baseline.acceptance, baseline.bins), reason=reason,
            sets={s: ReleasedOn(f.acceptance, f.bins) for s, f in baseline.sets.items()},
            report={k: getattr(report, k) for k in ABOUT},
        ).to_json(),
    )  # fmt: skip
    return Baseline(reason, figures)

