"""Generation backends: the target answers prompts (HF transformers now; vLLM behind the same interface)."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.generation.base import Completion, Generator
from eagle3_assets.settings import GenerationSettings

__all__ = ["Completion", "Generator", "open_generator"]


def open_generator(model_dir: Path, settings: GenerationSettings) -> Generator:
    """The backend named by `generation.backend`."""
    if settings.backend == "hf":
        from eagle3_assets.generation.hf import HFGenerator

        return HFGenerator(model_dir, settings)
    raise NotImplementedError(f"generation.backend: {settings.backend!r} is not available yet; use 'hf'")
