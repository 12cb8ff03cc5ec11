"""Named points where a test can kill this process outright, to prove what survives a kill there.

`EAGLE3_CRASH_AT=<name>[,<name>…]` makes `crash_point(<name>)` SIGKILL the process: no
`finally`, no atexit, exactly what an OOM kill or a lost node does. `rank<R>:<name>` kills
only the data-parallel rank R (torchrun's $RANK), e.g. `rank1:step:3`. Unset (always, outside
tests) a crash point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "EAGLE3_CRASH_AT"


def crash_point(name: str) -> None:
    at = os.environ.get(CRASH_ENV)
    if not at:
        return
    here = {name, f"rank{os.environ.get('RANK', '0')}:{name}"}
    if here & set(at.split(",")):
        os.kill(os.getpid(), signal.SIGKILL)
