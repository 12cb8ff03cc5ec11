"""Generation backends: the target answers prompts (HF transformers now; vLLM behind the same interface)."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.generation.base import Completion, Generator
from eagle3_assets.settings import GenerationSettings, VllmSettings

__all__ = ["Completion", "Generator", "open_generator"]


def open_generator(model_dir: Path, settings: GenerationSettings, vllm: VllmSettings | None = None) -> Generator:
    """The backend named by `generation.backend`.

    `vllm` (the `vllm` settings section) configures the vLLM backend: the server at
    `vllm.server_url`, or one started for this generator and stopped by its `close()`.
    """
    if settings.backend == "hf":
        from eagle3_assets.generation.hf import HFGenerator

        return HFGenerator(model_dir, settings)
    if settings.backend == "vllm":
        from eagle3_assets.generation.vllm import VLLMGenerator

        return VLLMGenerator(model_dir, settings, vllm or VllmSettings())
    raise ValueError(f"generation.backend: {settings.backend!r} is not one of 'hf', 'vllm'")
