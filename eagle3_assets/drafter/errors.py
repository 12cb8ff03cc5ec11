"""The one error family drafter training raises, so a caller catches `TrainingError` and has them all."""

from __future__ import annotations

from eagle3_assets.errors import Eagle3Error


class TrainingError(Eagle3Error, RuntimeError):
    """Drafter training cannot start or continue; the message names the input, file or setting at fault."""


class EvaluationError(Eagle3Error, RuntimeError):
    """The drafter cannot be evaluated; the message names the input, file or setting at fault."""
