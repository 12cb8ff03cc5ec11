"""The running pipeline: its settings, its artifact store, and where the target model lives.

Dagster hands one `Project` to every asset as a resource; tests build their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.provenance import ProvenanceError, target_files, target_identity
from eagle3_assets.settings import Settings, artifact_root, load_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel

DEMO_MODEL_DIR = "target_model/model"
DEMO_MODEL_SETTINGS = "target_model/demo_settings.json"


@dataclass(frozen=True)
class Project:
    settings: Settings
    store: ArtifactStore

    @classmethod
    def from_environment(cls) -> Project:
        """Settings from $EAGLE3_CONFIG (demo without it), artifacts under $EAGLE3_ROOT (default ./.eagle3)."""
        return cls(load_settings(), ArtifactStore(artifact_root()))

    @property
    def model_name(self) -> str:
        return self.settings.target_model or "eagle3-demo-target"

    def target(self) -> TargetModel:
        """The target's description with the configured aux layers resolved: read once per asset, then handed down."""
        return TargetModel.read(
            self.target_dir(), aux_layer_ids=self.settings.aux_layer_ids, trust_remote_code=self.settings.trust_remote_code
        )

    def target_dir(self) -> Path:
        """A local directory holding the target model (engines load from local paths only): the model itself
        when it is local, else a copy made for its current identity (`provenance.target_identity`), the one the
        records hold. A target rewritten in place at its URL is copied again, never loaded from the old copy."""
        if self.settings.target_model is None:
            return _local_copy(self.store, DEMO_MODEL_DIR)
        path = self.settings.target_model
        if path.startswith("file://"):
            path = path[len("file://") :]
        if "://" in path:
            parent, name = path.rstrip("/").rsplit("/", 1)
            return _local_copy(ArtifactStore(parent), name)
        return Path(path)


def _local_copy(store: ArtifactStore, rel: str) -> Path:
    local = store.local_path(rel)
    if local is not None:
        return local
    url = store.url_of(rel)
    identity = target_identity(url)
    # The files the identity counts, no more: a Llama repository's `original/` would double the bytes copied.
    copy = store.ensure_local_dir(rel, version=identity, files=target_files(url))
    if target_identity(str(copy)) != identity:
        raise ProvenanceError(f"target model {url}: its files changed while they were copied to {copy}; run it again")
    return copy
