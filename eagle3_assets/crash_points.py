"""Named points where a test can kill this process outright, to prove what survives a kill there.

`EAGLE3_CRASH_AT=<name>[,<name>…]` makes `crash_point(<name>)` SIGKILL the process: no
`finally`, no atexit, exactly what an OOM kill or a lost node does. Unset (always, outside
tests) a crash point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "EAGLE3_CRASH_AT"


def crash_point(name: str) -> None:
    at = os.environ.get(CRASH_ENV)
    if at and name in at.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
