"""A shard's manifest, `hidden_states/<key>/_SUCCESS.json` (docs/DESIGN.md §4): written last by extraction, what the
shard holds. The one reader and writer of it; every other module asks this one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from eagle3_assets.errors import Eagle3Error
from eagle3_assets.sample_file import READABLE_FORMATS, manifest_path
from eagle3_assets.storage import ArtifactStore, StoreError


class ManifestError(Eagle3Error, ValueError):
    """A manifest that exists but cannot be read as one; the message names what is wrong."""


@dataclass(frozen=True)
class ShardManifest:
    format: str
    shard: str
    row_start: int
    row_end: int
    rows: int
    tokens: int
    bytes: int
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    last_hidden_state_norm: str | None
    model: str
    backend: str
    rows_computed: int
    rows_skipped: int
    seconds: float
    created: str  # ISO 8601, UTC

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_json(cls, body: Any) -> ShardManifest:
        if not isinstance(body, dict):
            raise ManifestError(f"expected a JSON object, got {type(body).__name__}")
        if body.get("format") not in READABLE_FORMATS:
            raise ManifestError(f"format is {body.get('format')!r}, expected one of {list(READABLE_FORMATS)}")
        try:
            return cls(**{**body, "aux_layer_ids": tuple(body["aux_layer_ids"])})
        except (KeyError, TypeError) as e:
            raise ManifestError(f"not a shard manifest ({e})") from None

    @classmethod
    def read(cls, store: ArtifactStore, key: str) -> ShardManifest | None:
        """Shard `key`'s manifest; None when it has none (never completed); ManifestError when unreadable."""
        path = manifest_path(key)
        if not store.exists(path):
            return None
        try:
            return cls.from_json(store.read_json(path))
        except (StoreError, OSError, ValueError) as e:
            raise ManifestError(f"{store.url_of(path)}: unreadable ({e})") from None

    def write(self, store: ArtifactStore) -> None:
        store.write_json(manifest_path(self.shard), self.as_json())
