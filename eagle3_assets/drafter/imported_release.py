"""Install a published drafter as the release a store starts from (issue 53, item 1; `start_from` in the settings).

The release directory (`drafter/release/`, docs/DESIGN.md §2) gets what a promoted export has: `config.json` and
`model.safetensors` in our export layout (`importing.py` converts and checks it against the target first), and
`release.json` with the target version it is released for, its family, `export_sha256`, and `imported`: where it
came from (`source`), its `format`, and the sha256 of its files. Its `acceptance` is empty until `release_baseline`
serves it alone on the held-out prompts (`release_baseline.py`); `drafter_eval` serves the released drafter beside the
next export, reading those passes, and those figures are the bar the gate holds (`release.released_figures`).

An import never replaces a release: with one in the store, nothing is installed and the result says why. An import
is where a store starts, not a way to drop what it released since (remove `drafter/release/` to start over from it).

It is installed where it is first needed, by the `vocab_map` asset (and by `drafter_eval`, for a store whose map was
made before `start_from` was set): while the release is an EAGLE-3 import, the store's vocab map is the import's own
(`adopted_vocab_map`), the only map its head was trained for, so the drafter continues it (`continuation.py`) on
every shard, from its weights exactly, into the drafter the family builds (`import_differences` names what keeps it
from doing so). A DFlash import drafts through the target's own head, so it is continued on the store's map, from
that head's rows of it (`dflash_import_differences`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_assets.drafter.dflash_export import dflash_exported_config
from eagle3_assets.drafter.dflash_import import ImportedDFlash
from eagle3_assets.drafter.dflash_model import DFlashConfig
from eagle3_assets.drafter.export import exported_config
from eagle3_assets.drafter.import_formats import source_url
from eagle3_assets.drafter.importing import Imported, import_published
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.release import RELEASE_DIR, target_version
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.families import family_spec
from eagle3_assets.release_record import ReleaseRecord, read_release_record
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.vocab_map import VocabMap, build_vocab_map, coverage

@dataclass(frozen=True)
class Installed:
    installed: bool
    reason: str  # what was installed, or why nothing was
    url: str  # the release directory


def install_release(store: ArtifactStore, imported: Imported | ImportedDFlash, *, target_version: str) -> Installed:
    """Write `imported` as the release of the target of `target_version` (the `target_model` record's version,
    `release.target_version`), unless a drafter is released already (module docstring)."""
    url = store.url_of(RELEASE_DIR)
    if (kept := kept_release(store, imported.source)) is not None:
        return Installed(False, kept, url)
    reason = f"{imported_from(imported.provenance())}: not yet served here"

    def write_record(directory: Path) -> None:
        ReleaseRecord(
            target=target_version, family=imported.family, reason=reason, export=imported.source,
            export_sha256=hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest(),
            imported=imported.provenance(),
        ).write(directory)  # fmt: skip

    imported.publish(store, RELEASE_DIR, write_extra=write_record)
    return Installed(True, reason, url)


def imported_from(imported: Mapping[str, Any]) -> str:
    """Where an import came from, as its release's reason says: from its `imported` provenance."""
    return f"imported from {imported.get('source')} ({imported.get('format')} format, sha256 {imported.get('sha256')})"


def kept_release(store: ArtifactStore, source: str) -> str | None:
    """Why a drafter released in `store` stays (an import of `source` installs nothing); None when none is."""
    store.settle(RELEASE_DIR)  # a replacement a kill interrupted is finished, never read half done
    if (record := read_release_record(store)) is None:
        return None
    url = store.url_of(RELEASE_DIR)
    if record.imported.get("source") == source:
        return f"{source} is already the release at {url} (imported, sha256 {record.imported.get('sha256')})"
    return (
        f"a drafter is released at {url} already ({record.reason}): an import starts a "
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
    imported = import_published(source, target, fmt=fmt, weights=lambda: load_target_weights(target))
    return install_release(store, imported, target_version=target_version)


def install_start_from(store: ArtifactStore, settings: Settings, target: TargetModel) -> Installed:
    """The settings' `start_from` (set) applied, as `drafter_eval` does before it serves the release beside a new
    export: the published drafter is the release of the store's target (`release.target_version`) unless one is
    released."""
    s = settings.start_from
    if s is None:
        raise ValueError("start_from is not set")
    return start_from(store, s.drafter, target, target_version=target_version(store), fmt=s.format)


def adopted_release_map(store: ArtifactStore) -> tuple[VocabMap, str] | None:
    """(the release's own map, where it was imported from) while the store's vocab map is to be that map: the release
    is an import of a family that keeps its own (`FamilySpec.adopts_import_map`); None otherwise."""
    store.settle(RELEASE_DIR)
    record = read_release_record(store)
    if record is None or not record.imported or not family_spec(record.family).adopts_import_map:
        return None
    return release_vocab_map(store), record.imported["source"]


_NUMPY = {"I64": np.int64, "I32": np.int32, "BOOL": np.bool_}


def named_tensors(store: ArtifactStore, rel: str, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The integer or bool tensors `names` of the safetensors file `rel` (those it holds), read by their byte ranges
    alone: a published drafter's weights run to gigabytes, its vocab map to a few hundred kilobytes."""
    with store.open(rel) as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        out = {}
        for name in names:
            if name in header:
                begin, end = header[name]["data_offsets"]
                f.seek(8 + size + begin)
                raw = np.frombuffer(f.read(end - begin), dtype=_NUMPY[header[name]["dtype"]])
                out[name] = raw.reshape(header[name]["shape"]).copy()
    return out


def release_vocab_map(store: ArtifactStore) -> VocabMap:
    """The release's own `d2t`/`t2d` (its `model.safetensors`; no `d2t` is the identity of a full draft vocab)."""
    tensors = named_tensors(store, f"{RELEASE_DIR}/model.safetensors", ("d2t", "t2d"))
    t2d = tensors["t2d"].astype(np.bool_)
    d2t = tensors.get("d2t", np.zeros(int(t2d.sum()), dtype=np.int64)).astype(np.int64)
    return VocabMap(d2t, t2d)


def adopted_vocab_map(store: ArtifactStore, freq: np.ndarray, draft_vocab_size: int) -> tuple[VocabMap, str] | None:
    """(the imported release's own map, what was done and what it costs), None unless the release is an import whose
    map is kept (`adopted_release_map`): an EAGLE-3 import's `lm_head` rows are trained for its own draft ids, and a
    drafter is continued only on the map it was trained with. What it costs is its coverage of the store's loss tokens
    (`freq`) against a fresh map's of `draft_vocab_size`. A DFlash import is not adopted: it drafts over the whole
    vocabulary through the target's head, whose rows for the store's draft ids it continues from
    (`family.head_on_map`), so its map would only widen every head trained beside it."""
    if (adopted := adopted_release_map(store)) is None:
        return None
    own, source = adopted
    fresh = coverage(build_vocab_map(freq, draft_vocab_size), freq)
    n = len(own.d2t)
    size = "" if n == draft_vocab_size else f" (not draft_vocab_size {draft_vocab_size}: its head has {n} rows)"
    return own, (
        f"adopted the imported release's own map ({source}): its {n} draft ids cover {coverage(own, freq):.6f} of the "
        f"loss tokens, a fresh map of {draft_vocab_size} {fresh:.6f}{size}"
    )


def import_differences(
    store: ArtifactStore, built: DrafterConfig, aux_layer_ids: Sequence[int], vmap: VocabMap
) -> list[str]:
    """Each way the imported EAGLE-3 release differs from the drafter the family builds to continue it (`built`,
    reading `aux_layer_ids`, on the store's map `vmap`), as "norm_before_fc: release False, now True
    (training.norm_before_fc)"; empty when its weights load into it exactly. Its context is not compared: it bounds
    the positions served, not a weight, and the continued drafter is exported with the target's."""
    config = store.read_json(f"{RELEASE_DIR}/config.json")
    theirs = exported_config(config, store.url_of(RELEASE_DIR))
    out = []
    own = release_vocab_map(store)
    same_map = np.array_equal(own.d2t, vmap.d2t) and np.array_equal(own.t2d, vmap.t2d)
    if not same_map:
        out.append(
            f"vocab map: release its own ({theirs.draft_vocab_size} draft ids), now the store's vocab_map "
            f"({len(vmap.d2t)} draft ids; re-materialize vocab_map, which adopts an imported release's map)"
        )
    skip = {"max_position_embeddings"} | (set() if same_map else {"draft_vocab_size"})
    out += field_differences(theirs, built, skip, lambda name: f"training.{name}" if name.startswith("norm_") else "")
    ids = [int(i) for i in config.get("eagle_aux_hidden_state_layer_ids") or []]
    if ids != sorted(aux_layer_ids):
        out.append(f"aux layer ids: release {ids}, now {sorted(aux_layer_ids)} (aux_layer_ids)")
    return out


def dflash_import_differences(
    store: ArtifactStore, built: DFlashConfig, aux_layer_ids: Sequence[int], vmap: VocabMap
) -> list[str]:
    """`import_differences` for an imported DFlash release, continued into the DFlash drafter `built` on the store's
    map `vmap`, its context reading `aux_layer_ids`. Its head is remapped, not compared: a DFlash import drafts
    over the whole vocabulary through the target's own head, whose rows for the map's draft ids are the rows a fresh
    head starts from (`family.head_on_map`); so the map differs only where it holds a token the release cannot
    draft. Nor is `block_size`: no weight depends on the mask slots' count."""
    theirs, ids = dflash_exported_config(store.read_json(f"{RELEASE_DIR}/config.json"))
    out = []
    if outside := uncovered(release_vocab_map(store), vmap):
        out.append(
            f"vocab map: {len(outside)} of the store's draft tokens are outside the release's {theirs.draft_vocab_size} "
            f"draft ids (target ids {outside[:5]}{' ...' if len(outside) > 5 else ''})"
        )
    own_fields = {"num_layers", "mask_token_id"}
    skip = {"max_position_embeddings", "draft_vocab_size", "block_size", "num_aux_layers"}  # the layers: below
    out += field_differences(theirs, built, skip, lambda name: f"dflash.{name}" if name in own_fields else "")
    if ids != list(aux_layer_ids):
        out.append(f"aux layer ids: release {ids}, now {list(aux_layer_ids)} (dflash.aux_layer_ids)")
    return out


def field_differences(theirs: Any, built: Any, skip: set[str], setting: Callable[[str], str]) -> list[str]:
    """"name: release X, now Y (where)" for each field of the config dataclasses `theirs` and `built` that differs,
    less `skip`; `setting(name)` names the setting that decides it ("" = the target's shape)."""
    out = []
    for f in fields(built):
        mine, now = getattr(theirs, f.name), getattr(built, f.name)
        if f.name not in skip and mine != now:
            where = setting(f.name) or "the target's"
            out.append(f"{f.name}: release {mine!r}, now {now!r} ({where})")
    return out


def uncovered(release: VocabMap, vmap: VocabMap) -> list[int]:
    """The target ids `vmap` drafts that the release's map does not."""
    return [int(t) for t in np.flatnonzero(vmap.t2d & ~release.t2d)]
