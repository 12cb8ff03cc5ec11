"""The learning-rate schedule every family trains by, and the warning for a run too short for its warmup."""

from __future__ import annotations

import math
from collections.abc import Callable

from eagle3_assets.training_settings import TrainingSettings


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR factor: linear warmup to 1 over `warmup_steps`, then cosine to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def short_run_warning(settings: TrainingSettings, total_steps: int) -> str | None:
    """A warning when warmup takes a quarter of the run or more: the defaults are for long runs, and at a few
    hundred steps the learning rate would peak late or never."""
    if settings.warmup_steps * 4 < total_steps:
        return None
    return (
        f"drafter: warmup_steps {settings.warmup_steps} is {settings.warmup_steps / total_steps:.0%} of this run's "
        f"{total_steps} steps: lr {settings.lr:g} is reached late or never. For a run this short set "
        f"training.warmup_steps to about {max(1, total_steps // 20)} and training.lr as README.md's table "
        "'Optimizer settings by run length' says"
    )
