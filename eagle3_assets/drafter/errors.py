"""The one error family drafter training raises, so a caller catches `TrainingError` and has them all."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """Drafter training cannot start or continue; the message names the input, file or setting at fault."""
