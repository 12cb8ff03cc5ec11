"""Processes and process groups on this machine: the one place that signals, waits and reads /proc.

Long-lived children (a vLLM server, the Dagster webserver and daemon) are started in a
session of their own, so one signal to the group reaches every worker they spawn; a
Dagster server in the background of a script ignores signals sent to its leader alone
(docs/DESIGN.md §7). Liveness checks read /proc so that zombies count as gone and a pid
reused by a later process is not mistaken for the one that was recorded.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# How long a process group is given after SIGTERM before SIGKILL: a vLLM engine freeing its device, torchrun
# forwarding the signal to its ranks and their checkpoint-free exit, the Dagster webserver and daemon.
STOP_GRACE_S = 30.0

# Loaded here, not in the forked child: a child of a threaded parent must not import or load anything.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> Callable[[], None]:
    """The `preexec_fn` of a job that must not outlive the process that starts it (a training job whose run was
    SIGKILLed would keep its GPUs and write beside the rerun): SIGTERM when the starting thread dies. Made in the
    starter, so it knows its pid: a starter killed between the fork and the kernel's promise is seen, and the job
    ends at once. Linux only; elsewhere the run's own stop is all there is."""
    starter = os.getpid()

    def preexec() -> None:
        if _LIBC is not None:
            # An ignored SIGTERM is inherited across exec (a starter started with it ignored): it would void the promise.
            _LIBC.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != starter:  # died before the promise was made: the job never starts
                os._exit(1)

    return preexec


def die_with_parent(parent_names: tuple[str, ...]) -> bool:
    """SIGKILL this process when its parent dies (Linux): for a process its launcher put in a session of its
    own (torchrun's ranks), which no signal to the launcher's group reaches. False when the parent died
    before this call: then the parent is init or a subreaper, whose command line names none of
    `parent_names`, and the caller must exit. Elsewhere True, unchecked."""
    if _LIBC is None:
        return True
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(name in arg for arg in argv for name in parent_names)


def signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    """Send `sig` to the group `process` leads (started with `start_new_session=True`)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every group, wait up to `grace_s` for the leaders, then SIGKILL what is left of each group
    (workers that ignored SIGTERM, children that outlived their leader) and wait until it is gone."""
    for p in processes:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in processes:
        signal_group(p, signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + grace_s
    while any(group_members(p.pid) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks since boot) from /proc/<pid>/stat, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group; from /proc, else a signal-0 probe."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    members = []
    for entry in proc.iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            if stat[1] == pgid and stat[0] != "Z":
                members.append(int(entry.name))
    return members


def boot_time() -> float | None:
    """Epoch seconds of this machine's boot, from /proc/stat."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def process_started_at(pid: int) -> float | None:
    """Epoch seconds when `pid` started (Linux /proc), or None where it cannot be known."""
    stat, boot = proc_stat(pid), boot_time()
    if stat is None or boot is None:
        return None
    return boot + stat[2] / os.sysconf("SC_CLK_TCK")


def process_alive(pid: int, started_by: float | None = None) -> bool:
    """Whether `pid` is a live process on this machine (zombies count as gone).

    With `started_by` (epoch seconds), a process that started later is a different one
    that reused the pid, so it counts as gone too (Linux /proc; elsewhere not checked).
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    stat = proc_stat(pid)
    if stat is None:
        return True
    if stat[0] in ("Z", "X"):
        return False
    started_at = process_started_at(pid)
    # 2 s of slack: boot time and tick counts are coarse.
    return not (started_by is not None and started_at is not None and started_at > started_by + 2.0)


def machine_id() -> str:
    """Names this machine, boot and pid namespace: a pid recorded under another id means nothing here. Containers
    with host networking (NCCL's usual setup, k8s `hostNetwork`) share the host name and the boot, not the pids."""
    boot = boot_time()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: one namespace
        namespace = 0
    return f"{socket.gethostname()}@{int(boot) if boot else 0}/pid-ns:{namespace}"


def pid_prefix(prefix: str) -> str:
    """A local temporary directory's name prefix naming this process: `remove_dead_tempdirs` sweeps it once the
    process is gone (a SIGKILL runs no cleanup, and an export's staging copy is gigabytes)."""
    return f"{prefix}{os.getpid()}-"


def remove_dead_tempdirs(prefix: str, root: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the directories `<root>/<prefix><pid>-*` (`pid_prefix`; root: the temporary directory) whose process is
    gone, or is a later one that reused its pid; returns their names. A live writer's are kept."""
    base, gone = Path(root or tempfile.gettempdir()), []
    for d in base.glob(f"{prefix}*-*"):
        pid = d.name[len(prefix) :].split("-", 1)[0]
        try:
            made = d.stat().st_mtime
        except OSError:
            continue  # removed meanwhile
        if d.is_dir() and pid.isdigit() and not process_alive(int(pid), started_by=made):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return sorted(gone)
