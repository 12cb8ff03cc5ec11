"""The one place the Dagster layer turns the pipeline's errors into `Failure`s.

Every error the plain modules raise on purpose is an `Eagle3Error`; its message names
the row, file or setting. A `Refusal` (settings that cannot work, a full disk, a row
longer than the context) becomes a failure Dagster does not retry: a retry cannot help,
and on a GPU node each attempt would load the model again first. So is a stop signal: Dagster
retries an interrupted step under its `RetryPolicy`, which would start again the work a person (or
the cluster) just stopped.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster import DagsterExecutionInterruptedError, Failure

from eagle3_assets.errors import Eagle3Error

# In a refusal's metadata: the run-start executor (`ops/executor.py`) sees it go by and keeps the
# instance's `run_retries` from relaunching the run, which `allow_retries` alone does not.
REFUSAL = "eagle3/refusal"


def refusal(message: str, metadata: dict[str, Any] | None = None) -> Failure:
    """A `Failure` nothing may repeat: neither the asset's `RetryPolicy` nor the instance's `run_retries`."""
    return Failure(message, allow_retries=False, metadata={**(metadata or {}), REFUSAL: True})


@contextmanager
def failures(prefix: str = "") -> Iterator[None]:
    """Run the body; an `Eagle3Error` leaves it as a `Failure` with the same message (after `prefix`)."""
    try:
        yield
    except Eagle3Error as e:
        message = str(e) if not prefix or str(e).startswith(prefix) else f"{prefix}: {e}"
        raise (Failure(message) if e.retryable else refusal(message)) from None
    except (KeyboardInterrupt, DagsterExecutionInterruptedError):
        stopped = "stopped by a signal (SIGINT or SIGTERM); not retried: materialize it again to resume"
        raise refusal(f"{prefix}: {stopped}" if prefix else stopped) from None
