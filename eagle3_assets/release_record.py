"""`drafter/release/release.json`, the released drafter's record: what it holds, read and written in one place.

`drafter_release` writes it when it promotes an export (`drafter/release.py`), an import when it installs a published
drafter (`drafter/imported_release.py`); the evals, the release gate, the continuation and provenance read it. Every
field's default is what a release written before that field existed meant, said here and nowhere else, so a store made
by an older version reads as it was released.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.artifacts import RELEASE_DIR, RELEASE_JUDGED
from eagle3_assets.drafter.eval_report import PROMPT_SETS, PROMPTS_BY_BIN, ContextBins
from eagle3_assets.families import EAGLE3
from eagle3_assets.storage import ArtifactStore

RELEASE_RECORD_FILE = "release.json"
RELEASE_RECORD = f"{RELEASE_DIR}/{RELEASE_RECORD_FILE}"
RELEASE_ACCEPTANCE_BY_BIN = "acceptance_by_context_bin"  # beside "acceptance"
IMPORTED = "imported"  # a published drafter imported as the release: where it came from


@dataclass(frozen=True)
class ReleasedOn:
    """The figures a drafter was released on, on one prompt set or all: the bar it is held to once it no longer serves
    greedily beside a new export."""

    acceptance: dict[str, float] = field(default_factory=dict)  # "k3" -> mean acceptance length; {}: an import, unserved
    bins: ContextBins = field(default_factory=ContextBins)  # empty: released before context bins

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReleasedOn:
        acceptance = {k: float(v) for k, v in (body.get("acceptance") or {}).items()}
        return cls(acceptance, ContextBins.from_json(body, acceptance_key=RELEASE_ACCEPTANCE_BY_BIN))

    def to_json(self) -> dict[str, Any]:
        return {"acceptance": self.acceptance, PROMPTS_BY_BIN: self.bins.prompts,
                RELEASE_ACCEPTANCE_BY_BIN: self.bins.acceptance}  # fmt: skip


@dataclass(frozen=True)
class ReleaseRecord:
    # The target_model version it was released for. None: released before releases named their target; it stays the
    # baseline of whatever target (replacing a release is irreversible, refusing an export is not).
    target: str | None = None
    family: str = EAGLE3.name  # releases before families were EAGLE-3's
    released_on: ReleasedOn = field(default_factory=ReleasedOn)
    sets: dict[str, ReleasedOn] = field(default_factory=dict)  # with `traffic` set, per prompt set; {} without
    replaced: dict[str, float] | None = None  # the figures of the drafter it replaced, served beside it
    reason: str = "no reason recorded"
    export: str = ""  # where the export was copied from
    export_sha256: str = ""  # its weights' sha256; "": released before it was recorded (digest the weights)
    report: dict[str, Any] = field(default_factory=dict)  # how the report it was released on was served
    judged: dict[str, Any] = field(default_factory=dict)  # the eval it was promoted on (`provenance.judged`)
    imported: dict[str, Any] = field(default_factory=dict)  # an import's source, format and sha256; {}: trained here

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReleaseRecord:
        return cls(
            target=body.get("target"),
            family=body.get("family") or EAGLE3.name,
            released_on=ReleasedOn.from_json(body),
            sets={s: ReleasedOn.from_json(b) for s, b in (body.get(PROMPT_SETS) or {}).items()},
            replaced=body.get("replaced"),
            reason=body.get("reason") or cls.reason,
            export=body.get("export") or "",
            export_sha256=str(body.get("export_sha256") or ""),
            report=dict(body.get("report") or {}),
            judged=dict(body.get(RELEASE_JUDGED) or {}),
            imported=dict(body.get(IMPORTED) or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "family": self.family,
            **self.released_on.to_json(),
            **({PROMPT_SETS: {s: f.to_json() for s, f in self.sets.items()}} if self.sets else {}),
            "replaced": self.replaced,
            "reason": self.reason,
            "export": self.export,
            "export_sha256": self.export_sha256,
            "report": self.report,
            RELEASE_JUDGED: self.judged,
            **({IMPORTED: self.imported} if self.imported else {}),
        }

    def write(self, directory: Path) -> None:
        """Into a release directory being assembled (published with it, never alone)."""
        (directory / RELEASE_RECORD_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def read_release_record(store: ArtifactStore) -> ReleaseRecord | None:
    """The store's release record as it is now, None when nothing is released (callers settle a replacement first)."""
    if not store.exists(RELEASE_RECORD):
        return None
    return ReleaseRecord.from_json(store.read_json(RELEASE_RECORD))
