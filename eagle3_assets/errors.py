"""The root of every error the pipeline raises on purpose.

Each module defines the errors of its own domain under `Eagle3Error`, so the Dagster
layer catches one type and turns it into a `Failure` (`defs/failures.py`). `Refusal`
marks the errors no retry can fix (settings that cannot work, a full disk, a read-only
store, a row longer than the model's context): Dagster must not retry those, least of
all after loading a 1T model again.
"""

from __future__ import annotations

from typing import ClassVar


class Eagle3Error(Exception):
    """Something a person must act on; the message names the row, file or setting at fault."""

    retryable: ClassVar[bool] = True


class Refusal(Eagle3Error):
    """Work refused before it started, for a reason a retry cannot change."""

    retryable: ClassVar[bool] = False
