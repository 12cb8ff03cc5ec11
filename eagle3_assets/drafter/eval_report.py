"""`drafter_eval/report.json` as the release reads it: which export was served, and the figures it and each drafter
served beside it achieved (`evaluate.py` writes it, in vLLM's form: `EvalReport.as_metadata`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.errors import Refusal
from eagle3_assets.storage import ArtifactStore

EVAL_REPORT_FILE = "drafter_eval/report.json"
ACCEPTANCE_PREFIX = "mean_acceptance_length_k"
ABOUT = ("prompts", "max_tokens", "prompts_file", "engine")  # how it was served, kept with a release


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
class Served:
    """One drafter's served figures: mean acceptance length by k ("k3"), and whether its output stayed greedy."""

    acceptance: dict[str, float]
    outputs_match_greedy: bool

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Served:
        return cls(acceptance_of(body), bool(body.get("outputs_match_greedy", False)))


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
