"""Generation backends: the target completes token-id prompts (HF transformers in process, or a vLLM server)."""

from __future__ import annotations

from eagle3_assets.generation.base import Generated, Generator
from eagle3_assets.settings import GenerationSettings, SettingsError, VllmSettings
from eagle3_assets.target import TargetModel

__all__ = ["Generated", "Generator", "open_generator"]


def open_generator(target: TargetModel, settings: GenerationSettings, vllm: VllmSettings | None = None) -> Generator:
    """The backend named by `generation.backend`.

    `vllm` (the `vllm` settings section) configures the vLLM backend: the server at
    `vllm.server_url`, or one started for this generator and stopped by its `close()`.
    """
    if settings.backend == "hf":
        from eagle3_assets.generation.hf import HFGenerator

        return HFGenerator(target, settings)
    if settings.backend == "vllm":
        from eagle3_assets.generation.vllm import VLLMGenerator

        return VLLMGenerator(target, settings, vllm or VllmSettings())
    raise SettingsError(f"generation.backend: {settings.backend!r} is not one of 'hf', 'vllm'")
