"""Install a published drafter as the release a store starts from (issue 53, item 1; `start_from` in the settings).

The release directory (`drafter/release/`, docs/DESIGN.md §2) gets what a promoted export has: `config.json` and
`model.safetensors` in our export layout (`importing.py` converts and checks it against the target first), and
`release.json` with the target version it is released for, its family, `export_sha256`, and `imported`: where it
came from (`source`), its `format`, and the sha256 of its files. Its `acceptance` is empty: it has not been served
here yet. `drafter_eval` serves the released drafter beside the next export on the held-out prompts, and those figures
are the bar the gate holds (`release.released_figures`).

An import never replaces a release: with one in the store, nothing is installed and the result says why. An import
is where a store starts, not a way to drop what it released since (remove `drafter/release/` to start over from it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.drafter.export import checked_tensors, expected_export_tensors, publish_export
from eagle3_assets.drafter.import_formats import source_url
from eagle3_assets.drafter.importing import Imported, import_drafter
from eagle3_assets.drafter.release import IMPORTED, RELEASE_DIR, RELEASE_RECORD, target_version
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.families import EAGLE3
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel

@dataclass(frozen=True)
class Installed:
    installed: bool
    reason: str  # what was installed, or why nothing was
    url: str  # the release directory


def install_release(store: ArtifactStore, imported: Imported, *, target_version: str) -> Installed:
    """Write `imported` as the release of the target of `target_version` (the `target_model` record's version,
    `release.target_version`), unless a drafter is released already (module docstring)."""
    url = store.url_of(RELEASE_DIR)
    if (kept := kept_release(store, imported.source)) is not None:
        return Installed(False, kept, url)
    cfg = imported.cfg
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    tensors = checked_tensors(store, RELEASE_DIR, imported.tensors, expected_export_tensors(cfg), full_vocab=full_vocab)
    reason = (
        f"imported from {imported.source} ({imported.format} format, sha256 {imported.digest}): not yet served here"
    )

    def write_record(directory: Path) -> None:
        record = {
            "target": target_version,
            "family": EAGLE3.name,
            "acceptance": {},
            "replaced": None,
            "reason": reason,
            "export": imported.source,
            "export_sha256": hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest(),
            IMPORTED: imported.provenance(),
        }
        (directory / "release.json").write_text(json.dumps(record, indent=2) + "\n")

    publish_export(store, RELEASE_DIR, tensors, imported.export_config(), imported.dtype, write_extra=write_record)
    return Installed(True, reason, url)


def kept_release(store: ArtifactStore, source: str) -> str | None:
    """Why a drafter released in `store` stays (an import of `source` installs nothing); None when none is."""
    store.settle(RELEASE_DIR)  # a replacement a kill interrupted is finished, never read half done
    if not store.exists(RELEASE_RECORD):
        return None
    record = store.read_json(RELEASE_RECORD)
    url = store.url_of(RELEASE_DIR)
    if (record.get(IMPORTED) or {}).get("source") == source:
        return f"{source} is already the release at {url} (imported, sha256 {record[IMPORTED].get('sha256')})"
    return (
        f"a drafter is released at {url} already ({record.get('reason', 'no reason recorded')}): an import starts a "
        f"store with none and never replaces a release; remove {url} to start from {source}"
    )


def start_from(
    store: ArtifactStore, source: str, target: TargetModel, *, target_version: str, fmt: str = "auto"
) -> Installed:
    """Import the drafter at `source` (checked against `target`, its embedding read from the target only when the
    drafter ships one) as the store's release, unless one is released: that is checked first, so a store that has a
    release reads nothing of `source`."""
    if (kept := kept_release(store, source_url(source))) is not None:
        return Installed(False, kept, store.url_of(RELEASE_DIR))
    imported = import_drafter(source, target, fmt=fmt, embed_tokens=lambda: load_target_weights(target).embed_tokens)
    return install_release(store, imported, target_version=target_version)


def install_start_from(store: ArtifactStore, settings: Settings, target: TargetModel) -> Installed:
    """The settings' `start_from` (set) applied, as `drafter_eval` does before it serves the release beside a new
    export: the published drafter is the release of the store's target (`release.target_version`) unless one is
    released."""
    s = settings.start_from
    if s is None:
        raise ValueError("start_from is not set")
    return start_from(store, s.drafter, target, target_version=target_version(store), fmt=s.format)
