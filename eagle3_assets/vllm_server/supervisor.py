"""The supervisor every server we start runs under: it stops the server when its starter dies.

`python -m eagle3_assets.vllm_server --supervise PARENT_PID -- vllm serve …` (see
`server.py`): a run killed with SIGKILL cannot stop its server, so the supervisor
notices that its parent is gone and stops it, then kills the whole group after a grace
period. On the CPU build it first pins itself, and so the server, to the cores claimed for
it (`cores.py`). No torch or vLLM import here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from eagle3_assets.processes import STOP_GRACE_S
from eagle3_assets.vllm_server.cores import pin_to_claim



def supervise(parent_pid: int, cmd: list[str], poll_s: float = 1.0) -> int:
    """Run `cmd`; stop it when `parent_pid` is no longer our parent. Returns its exit code.

    We lead the process group (start_new_session in `VllmServer.start`), so a signal to
    the group reaches `cmd` directly; one sent to us alone is passed on. Either way we
    wait for `cmd` to finish.
    """
    pin_to_claim()  # before the server starts: every process of it inherits the cores
    # An ignored signal stays ignored across exec: started by a process that ignores SIGTERM
    # (a test runner, a job launcher), the server would be deaf to every stop but SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    child = subprocess.Popen(cmd)
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: child.send_signal(signal.SIGTERM))
    orphaned_at: float | None = None
    while child.poll() is None:
        time.sleep(poll_s)
        if orphaned_at is None and os.getppid() != parent_pid:
            orphaned_at = time.monotonic()
            print(f"eagle3 supervisor: process {parent_pid} is gone; stopping the vLLM server", flush=True)
            child.terminate()
        if orphaned_at is not None and time.monotonic() - orphaned_at > STOP_GRACE_S:
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return int(child.returncode)
