"""The `start_from` settings section: a published drafter the store's first release is imported from (issue 53).

Its own module, so `settings.py` only names the section. What the import reads, checks and writes is
`drafter/importing.py` and `drafter/imported_release.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3_assets.section import Section


class StartFromSettings(Section):
    """The published drafter the first release is imported from, and what the import keeps of it."""

    drafter: str = Field(
        ...,
        min_length=1,
        description="a published EAGLE-3 or DFlash drafter's directory or fsspec URL (config.json + safetensors "
        "weights): checked against the target and installed as the release when the store has none",
    )
    format: Literal["auto", "eagle3", "speculators", "dflash"] = Field(
        "auto",
        description="its layout: `eagle3` (vLLM's LlamaForCausalLMEagle3, as the EAGLE reference and SpecForge write "
        "it), `speculators` (speculators_model_type eagle3), `dflash` (z-lab's DFlashDraftModel), or `auto` to tell "
        "them apart by its config.json",
    )
