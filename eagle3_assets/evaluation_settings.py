"""The `evaluation` settings section: how `drafter_eval` serves the drafters and how `drafter_release` judges them.

Kept out of `settings.py` (one field there names this section), as `traffic_settings.py` is.
"""

from __future__ import annotations

from itertools import pairwise

from pydantic import Field, field_validator

from eagle3_assets.section import Section


class EvaluationSettings(Section):
    """`drafter_eval`: five vLLM passes over the held-out prompts (plain, then k=3 and k=7, features kept and zeroed),
    and two more (k=3, k=7) for each drafter served beside ours (the released one, the reference)."""

    max_new_tokens: int | None = Field(
        None, ge=1, description="tokens decoded per held-out prompt in each pass; None = generation.max_new_tokens"
    )
    engine_load_s: float = Field(600.0, gt=0, description="seconds each pass may take to load its vLLM engine")
    min_tokens_per_s: float = Field(
        20.0,
        gt=0,
        description="the slowest decode (tokens/s over all prompts) a pass may run at before it counts as stuck: "
        "the timeout is passes x (engine_load_s + prompts x max_new_tokens / this)",
    )
    reference_drafter: str | None = Field(
        None,
        description="a local EAGLE-3 export directory (config.json + model.safetensors), e.g. the drafter published "
        "for the target: served at k=3 and k=7 beside ours on the same prompts and reported as `reference`",
    )
    release_min_acceptance: float = Field(
        1.05,
        ge=1.0,
        description="`drafter_release` never releases an export serving below this mean acceptance length at any k: "
        "at 1.0 no draft is ever accepted (a zeroed or misloaded head)",
    )
    replace_release_for_target: str | None = Field(
        None,
        description="a person's approval that an export of this target_model version (as drafter_release names it) "
        "replaces a drafter released for another target; unset, that release stays and the release check fails "
        "naming this setting with the version to approve",
    )
    reuse_passes: bool = Field(
        True,
        description="a pass drafter_eval served before (the same engine, device, target, prompts, engine arguments "
        "and drafter files) is read from the store's served_passes/ instead of served again: after a release, each "
        "family's eval serves nothing new but the release beside it; false serves every pass again",
    )
    context_bins: list[int] = Field(
        default_factory=lambda: [0, 1024, 4096, 16384, 32768, 65536],
        description="edges of the context-length bins (prompt tokens) drafter_eval reports acceptance in: bin i holds "
        "prompts of edges[i] up to edges[i+1] tokens, the last bin every longer one; starts at 0, increasing",
    )
    min_prompts_per_bin: int = Field(
        5,
        ge=1,
        description="a context bin with fewer held-out prompts is reported as too small and not judged by "
        "drafter_release (a mean over a few prompts moves by half between prompts)",
    )
    original_regression_margin: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="with `traffic` set, drafter_release releases an export that beats the released drafter on the "
        "traffic's held-out prompts only if it serves at least (1 - this) x the released drafter's mean acceptance "
        "length on the original held-out prompts (eval_prompts) at every k: 0.02 allows 2% less there",
    )

    @field_validator("context_bins")
    @classmethod
    def _bin_edges(cls, edges: list[int]) -> list[int]:
        # Every prompt must fall in a bin, and each bin must be a range: no gap below the first edge, no empty bin.
        if not edges or edges[0] != 0:
            raise ValueError(f"the first edge must be 0, so every prompt falls in a bin; got {edges}")
        if any(b <= a for a, b in pairwise(edges)):
            raise ValueError(f"edges must increase strictly (each bin a range of prompt lengths); got {edges}")
        return edges
