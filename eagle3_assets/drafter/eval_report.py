"""`drafter_eval/report.json` as the release reads it: which export was served, and the figures it and each drafter
served beside it achieved (`evaluate.py` writes it, in vLLM's form: `EvalReport.as_metadata`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.errors import Refusal
from eagle3_assets.storage import ArtifactStore

EVAL_REPORT_FILE = "drafter_eval/report.json"
# An imported release's figures, served before any eval (`release_baseline.py`): its passes are the first eval's.
BASELINE_REPORT_FILE = "release_baseline/report.json"
ACCEPTANCE_PREFIX = "mean_acceptance_length_k"
ABOUT = ("prompts", "max_tokens", "prompts_file", "engine")  # how it was served, kept with a release
PROMPTS_BY_BIN = "prompts_by_context_bin"  # context bin ("0-1024", `context_bins`) -> held-out prompts in it
ACCEPTANCE_BY_BIN = "mean_acceptance_length_by_context_bin"  # context bin -> "k3" -> mean acceptance length
# With `traffic` set, each drafter's figures on each prompt set it was served on: set -> its prompts, its file and its
# figures in the report's form (mean acceptance length by k, prompts and acceptance by context bin). Absent without.
PROMPT_SETS = "prompt_sets"
TRAFFIC_SET = "traffic"  # the traffic's held-out split (`traffic.TRAFFIC_HELDOUT_FILE`)
ORIGINAL_SET = "original"  # the original held-out prompts (`prompts.EVAL_PROMPTS_FILE`)


class EvalReportError(Refusal):
    """No report, or one that is not a drafter_eval report; the message names the file."""


def acceptance_of(figures: Mapping[str, Any]) -> dict[str, float]:
    """"k3" -> mean acceptance length, from figures in `EvalReport.as_metadata` form."""
    return {
        f"k{name[len(ACCEPTANCE_PREFIX):]}": float(v)
        for name, v in figures.items()
        if name.startswith(ACCEPTANCE_PREFIX) and name[len(ACCEPTANCE_PREFIX) :].isdigit()
    }


@dataclass(frozen=True)
class ContextBins:
    """Acceptance per context-length bin (`context_bins`): the prompts in each bin, and "0-1024" -> "k3" -> mean
    acceptance length. Empty in a report or release made before bins existed: nothing to compare per bin."""

    prompts: dict[str, int] = field(default_factory=dict)
    acceptance: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any], acceptance_key: str = ACCEPTANCE_BY_BIN) -> ContextBins:
        return cls(
            {b: int(n) for b, n in (body.get(PROMPTS_BY_BIN) or {}).items()},
            {b: {k: float(v) for k, v in acc.items()} for b, acc in (body.get(acceptance_key) or {}).items()},
        )

    def enough(self, minimum: int) -> list[str]:
        """The bins with figures and at least `minimum` prompts, in bin order."""
        return [b for b in self.acceptance if self.prompts.get(b, 0) >= minimum]


@dataclass(frozen=True)
class Served:
    """One drafter's served figures: mean acceptance length by k ("k3"), whether its output stayed greedy, and
    the same per context bin."""

    acceptance: dict[str, float]
    outputs_match_greedy: bool
    bins: ContextBins = field(default_factory=ContextBins)
    sha256: str = ""  # of a drafter served beside: the digest of the weights served ("": a report made before)
    sets: dict[str, Served] = field(default_factory=dict)  # `PROMPT_SETS`: the same per prompt set; empty without

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Served:
        greedy, sha256 = bool(body.get("outputs_match_greedy", False)), str(body.get("export_sha256", ""))
        # A set's outputs are the drafter's outputs on its prompts: whether they stayed greedy is said once for all.
        sets = {name: cls(acceptance_of(b), greedy, ContextBins.from_json(b), sha256)
                for name, b in (body.get(PROMPT_SETS) or {}).items()}  # fmt: skip
        return cls(acceptance_of(body), greedy, ContextBins.from_json(body), sha256, sets)


@dataclass(frozen=True)
class ServedReport:
    export_sha256: str  # which export was served (`release.export_digest`)
    export: Served
    beside: dict[str, Served] = field(default_factory=dict)  # drafters served beside it, by name
    about: dict[str, Any] = field(default_factory=dict)  # `ABOUT`

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ServedReport:
        return cls(
            export_sha256=str(body.get("export_sha256", "")),
            export=Served.from_json(body),
            beside={name: Served.from_json(b) for name, b in (body.get("beside") or {}).items()},
            about={k: body[k] for k in ABOUT if k in body},
        )

    @classmethod
    def read(cls, store: ArtifactStore) -> ServedReport:
        if not store.exists(EVAL_REPORT_FILE):
            raise EvalReportError(f"no drafter_eval report at {store.url_of(EVAL_REPORT_FILE)}: materialize drafter_eval first")
        body = store.read_json(EVAL_REPORT_FILE)
        if not isinstance(body, dict) or "export_sha256" not in body:
            raise EvalReportError(f"{store.url_of(EVAL_REPORT_FILE)} is not a drafter_eval report: materialize drafter_eval again")
        return cls.from_json(body)
