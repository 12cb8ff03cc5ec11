"""Named points where a test can kill this process outright, or hold it, to prove what survives there.

`EAGLE3_CRASH_AT=<name>[,<name>…]` makes `crash_point(<name>)` SIGKILL the process: no
`finally`, no atexit, exactly what an OOM kill or a lost node does. `rank<R>:<name>` kills
only the data-parallel rank R (torchrun's $RANK), e.g. `rank1:step:3`. `EAGLE3_STALL_AT`, with
the same names, holds the process there instead (it says so on stderr and sleeps), so a test can
signal it at a known moment. Unset (always, outside tests) a crash point costs two environment lookups.
"""

from __future__ import annotations

import os
import signal
import sys
import time

CRASH_ENV = "EAGLE3_CRASH_AT"
STALL_ENV = "EAGLE3_STALL_AT"
STALLED = "crash point: stalled at "


def _here(env: str, name: str) -> bool:
    at = os.environ.get(env)
    return bool(at) and bool({name, f"rank{os.environ.get('RANK', '0')}:{name}"} & set(at.split(",")))


def crash_point(name: str) -> None:
    if _here(CRASH_ENV, name):
        os.kill(os.getpid(), signal.SIGKILL)
    if _here(STALL_ENV, name):
        print(f"{STALLED}{name}", file=sys.stderr, flush=True)
        while True:  # until a signal ends it, as one would end the work it stands for
            time.sleep(3600)
