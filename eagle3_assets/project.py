"""The running pipeline: its settings and its artifact store, and where the target model lives.

Dagster hands one `Project` to every asset as a resource; tests build their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.settings import ModelShape, Settings, artifact_root, load_settings, read_model_shape
from eagle3_assets.storage import ArtifactStore

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

    def target_shape(self) -> ModelShape:
        """Layers, hidden size and vocab of the target, from its config.json."""
        shape = read_model_shape(str(self.target_dir()))
        if shape is None or not shape.hidden_size:
            raise ValueError(f"cannot read the target's shape from {self.target_dir()}/config.json")
        return shape

    def target_dir(self) -> Path:
        """A local directory holding the target model (engines load from local paths only)."""
        if self.settings.target_model is None:
            return self.store.ensure_local_dir(DEMO_MODEL_DIR)
        path = self.settings.target_model
        if path.startswith("file://"):
            path = path[len("file://") :]
        if "://" in path:
            parent, name = path.rstrip("/").rsplit("/", 1)
            return ArtifactStore(parent).ensure_local_dir(name)
        return Path(path)
