"""The CPU cores each vLLM CPU engine we start runs on, so engines sharing a host do not starve each other.

Left to itself, vLLM's CPU build binds every engine's OpenMP threads the same way
(VLLM_CPU_OMP_THREADS_BIND=auto: the allowed cores but one, kept for the engine's scheduler and
HTTP server), so two engines on one host compute on the same core. Binding only those threads
apart is not enough: each engine's other processes busy-poll their shared-memory queues, and
measured with two servers on two cores, one server still fell to 1% of its alone rate while
the other ran. So every engine we start (a phase's server, `--serve`, drafter_eval's engine)
runs, all its processes, on cores of its own, and its OpenMP threads with them (vLLM's auto
binding reads the affinity; a server's worker, in its engine core's process, inherits it).

The cores are claimed in a registry every process on the host shares: a directory under the
system temp dir with one claim file per engine. A claim is an exclusive `flock` on its file,
held by the process that lives as long as the engine (its supervisor, or drafter_eval's
interpreter, which pins itself to the claim from CORES_ENV before it starts anything):
however the engine ends, the kernel drops the lock, and the next claimer removes the file.

How many: `vllm.cpu_cores` per engine, or by default every free core but one (left to the
process that started it and to the next engine), at least one. When fewer cores are free than
asked for, the engine takes the least-claimed ones (shared, which the server log says) rather
than fail. A VLLM_CPU_OMP_THREADS_BIND set in the environment is the operator's choice: nothing
is claimed then. No torch or vLLM import here: the supervisor imports this.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.errors import Refusal

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CORES_ENV = "EAGLE3_VLLM_CORES"  # the claim's cores, for the engine's first process to pin itself to
REGISTRY = Path(tempfile.gettempdir()) / "eagle3-vllm-cores"
LOCK_FILE = ".lock"
CLAIM_SUFFIX = ".claim"


@dataclass
class CoreClaim:
    """Cores claimed for one engine; the claim lasts while `fd` (or a child's inherited copy of it) is open."""

    cores: tuple[int, ...]
    shared: bool
    path: Path
    fd: int

    def env(self) -> dict[str, str]:
        return {CORES_ENV: ",".join(map(str, self.cores))}

    def describe(self) -> str:
        how = "shared with other engines: no core was free" if self.shared else "its own"
        return f"vLLM CPU engine on cores {_ranges(list(self.cores))} ({how}; claim {self.path})"

    def release(self) -> None:
        """End the claim here (a child still holding the fd keeps the lock until it exits)."""
        if self.fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def pin_to_claim() -> None:
    """In an engine's first process, before it starts anything: run on the claimed cores, children included."""
    cores = os.environ.get(CORES_ENV)
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])


def claim_cores(wanted: int | None, *, registry: Path | None = None) -> CoreClaim:
    """Claim `wanted` cores (None: every free core but one, at least one) for an engine about to start, in
    `registry` (default REGISTRY, read at each call)."""
    registry = registry or REGISTRY
    allowed = sorted(os.sched_getaffinity(0))
    if wanted is not None and wanted > len(allowed):
        raise Refusal(
            f"vllm.cpu_cores: {wanted} cores per vLLM CPU engine, but this process may use only {len(allowed)} "
            f"({_ranges(allowed)}); set vllm.cpu_cores to at most {len(allowed)}, or leave it unset to take the free cores"
        )
    if not registry.is_dir():
        registry.mkdir(parents=True, exist_ok=True)
        # Like /tmp: every user's engines claim here, and only a claim's owner removes it.
        with suppress(PermissionError):
            registry.chmod(0o1777)
    with _locked(registry / LOCK_FILE):
        users = Counter(core for cores in _live_claims(registry) for core in cores)
        free = [c for c in allowed if not users[c]]
        n = wanted if wanted is not None else max(1, len(free) - 1)
        shared = len(free) < n
        cores = tuple(sorted(free[:n] if not shared else sorted(allowed, key=lambda c: (users[c], c))[:n]))
        path = registry / f"{os.getpid()}-{uuid.uuid4().hex[:8]}{CLAIM_SUFFIX}"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"cores": list(cores), "pid": os.getpid()}).encode())
    return CoreClaim(cores, shared, path, fd)


def engine_claim(
    wanted: int | None, *, environ: Mapping[str, str] = os.environ, registry: Path | None = None
) -> CoreClaim | None:
    """The claim for an engine about to start with `environ`; None when it binds already or vLLM is not the CPU build."""
    if environ.get(BIND_ENV) or not cpu_build():
        return None
    return claim_cores(wanted, registry=registry)


def cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (`vllm-cpu`, or a `vllm` whose version ends in +cpu), read
    without importing it."""
    from importlib import metadata  # here: the supervisor imports this module and needs none of it

    for dist, says_cpu in (("vllm-cpu", lambda _: True), ("vllm", lambda v: "+cpu" in v)):
        with suppress(metadata.PackageNotFoundError):
            if says_cpu(metadata.version(dist)):
                return True
    return False


def _live_claims(registry: Path) -> Iterator[list[int]]:
    """The cores of each claim whose holder is alive; the files of the dead ones are removed."""
    for path in registry.glob(f"*{CLAIM_SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield [int(c) for c in json.loads(os.read(fd, 1 << 16) or b"{}").get("cores", [])]
                continue
            with suppress(PermissionError):  # another user's; it still counts for nothing
                path.unlink(missing_ok=True)  # we got the lock: nobody holds the claim any more
        finally:
            os.close(fd)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The registry's own lock: two engines starting at once claim one after the other."""
    fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o644)  # flock needs no write access: any user can take it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _ranges(cores: list[int]) -> str:
    """`0-3,6` for [0, 1, 2, 3, 6]."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
