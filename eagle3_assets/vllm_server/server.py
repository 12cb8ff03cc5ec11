"""A handle on the vLLM server the `vllm` backends talk to: started for one run, or a long-lived one reused.

Two ways to get a server (docs/DESIGN.md §6):

- no `vllm.server_url(s)`: the run starts `vllm serve` for itself, as a child process in
  its own process group, waits for `/health`, and stops the whole group when it closes
  its backend. One model load per run.
- `vllm.server_urls` (or `server_url`) set: the run checks `/health` there and uses that
  server; closing the backend leaves it running. On a GPU node, start one per phase
  with `python -m eagle3_assets.vllm_server --serve --role extract` (`__main__.py`):
  every shard run then uses the one model load, while shards still materialize, fail
  and retry independently.

Every server this module starts runs under a small supervisor (`supervisor.py`) that
stops the server when the process that started it dies without stopping it: a killed
run must not leave a GPU server behind. On the CPU build each server computes on cores of
its own (`cores.py`), so servers started on one host do not starve each other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_assets.processes import STOP_GRACE_S, stop_groups
from eagle3_assets.settings import VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.client import (
    HEALTH_TIMEOUT_S,
    ServedModel,
    VllmServerError,
    is_healthy,
    port_in_use,
    served_model,
)
from eagle3_assets.vllm_server.command import serve_args
from eagle3_assets.vllm_server.cores import CoreClaim, cpu_build, engine_claim
from eagle3_assets.vllm_server.protocol import Role, ServerPlan

SERVER_LOG_FILE = "server.log"
STORAGE_SUBDIR = "hidden_states"
# vLLM logs this once per model load (per worker: TP ranks each log it on a GPU node).
MODEL_LOAD_MARKER = "Starting to load model"
# How much of a dead server's log is searched for a known cause: the CPU build logs its KV-cache error ~150
# lines before the end (the engine's teardown follows it); a bound, because a server that ran long logs GBs.
CAUSE_SCAN_BYTES = 4 << 20
_KV_CACHE_CAUSE = re.compile(r"Available memory on node .* is less than (desired CPU memory utilization|requested memory for kv)")


class VllmServer:
    """A handle on a vLLM server: one this process started (and stops), or one it reuses (and leaves alone)."""

    def __init__(
        self,
        url: str,
        *,
        process: subprocess.Popen | None = None,
        workdir: Path | None = None,
        remove_workdir: bool = False,
        plan: ServerPlan | None = None,
        cores: CoreClaim | None = None,
    ):
        self.url = url.rstrip("/")
        self.process = process
        self.workdir = workdir
        self._remove_workdir = remove_workdir
        self._stopped = False
        self.plan = plan
        self.cores = cores

    # ------------------------------------------------------------ getting one

    @classmethod
    def start(
        cls,
        target: TargetModel,
        vllm: VllmSettings,
        role: Role,
        *,
        host: str | None = None,
        port: int | None = None,
        workdir: str | Path | None = None,
        write_roots: Sequence[str | Path] = (),
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        """Start `vllm serve` for `target` and wait until `/health` answers.

        `workdir` holds `server.log` and the raw hidden-state files (`hidden_states/`); by default a
        fresh temporary directory, removed at `stop()` unless the server failed (its log is kept
        for the error message). Host and port default to `vllm.host` / `vllm.port`. An extraction
        server may write sample files under `write_roots` (the local artifact stores it serves).
        """
        host = host or vllm.host
        port = port or vllm.port
        url = f"http://{host}:{port}"
        if port_in_use(host, port):
            raise VllmServerError(
                f"cannot start a vLLM server at {url}: the port is already in use (another server? "
                f"set vllm.server_url to {url} to reuse it, or choose another vllm.port)"
            )
        plan = ServerPlan.for_target(target, role)
        remove = workdir is None
        wd = Path(tempfile.mkdtemp(prefix="eagle3-vllm-")) if workdir is None else Path(workdir)
        storage = wd / STORAGE_SUBDIR
        storage.mkdir(parents=True, exist_ok=True)
        _remove_request_files(storage)
        plan.write(storage)
        args = serve_args(target, vllm, plan, host=host, port=port, storage_dir=storage, write_roots=write_roots)
        cmd = [
            sys.executable, "-m", "eagle3_assets.vllm_server", "--supervise", str(os.getpid()), "--",
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
        ]  # fmt: skip
        run_env = {**os.environ, **cpu_env(vllm), **(env or {})}
        cores = engine_claim(vllm.cpu_cores, environ=run_env)
        try:
            with open(wd / SERVER_LOG_FILE, "wb") as log:  # this server's log only: model_loads() counts in it
                log.write(f"$ {' '.join(cmd)}\n".encode())
                if cores is not None:
                    log.write(f"{cores.describe()}\n".encode())
                log.flush()
                # Own session = own process group: stop() signals the server and all its workers at once.
                # The supervisor pins itself (so the server) to the claimed cores, and holds the claim too:
                # it outlives a starter killed outright.
                process = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env=run_env | (cores.env() if cores else {}), pass_fds=(cores.fd,) if cores else (),
                )  # fmt: skip
        except BaseException:
            if cores is not None:
                cores.release()
            raise
        server = cls(url, process=process, workdir=wd, remove_workdir=remove, plan=plan, cores=cores)
        try:
            server._wait_ready(vllm.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    @classmethod
    def attach(cls, url: str, *, timeout_s: float = HEALTH_TIMEOUT_S) -> VllmServer:
        """A server already running at `url` (not ours: `stop()` leaves it alone)."""
        server = cls(url)
        if not server.is_healthy(timeout_s):
            raise VllmServerError(
                f"vllm.server_url: the vLLM server at {server.url} is not answering /health; start it "
                "(python -m eagle3_assets.vllm_server --serve --role extract|generate) or unset "
                "vllm.server_url to let each run start its own"
            )
        return server

    @classmethod
    def for_run(
        cls, target: TargetModel, vllm: VllmSettings, role: Role, *, write_roots: Sequence[str | Path] = ()
    ) -> VllmServer:
        """The configured `vllm.server_url` if set, else a server started for this run."""
        if vllm.server_url:
            return cls.attach(vllm.server_url)
        return cls.start(target, vllm, role, write_roots=write_roots)

    # ------------------------------------------------------------ state

    @property
    def owned(self) -> bool:
        """True when this process started the server (and `stop()` ends it)."""
        return self.process is not None

    @property
    def log_path(self) -> Path | None:
        return None if self.workdir is None else self.workdir / SERVER_LOG_FILE

    @property
    def storage_dir(self) -> Path | None:
        return None if self.workdir is None else self.workdir / STORAGE_SUBDIR

    def is_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        return is_healthy(self.url, timeout_s)

    def served_model(self) -> ServedModel:
        return served_model(self.url)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def model_loads(self) -> int:
        """How many times this server loaded the model (from its log; a server we started only)."""
        if self.log_path is None or not self.log_path.exists():
            raise VllmServerError(f"no log of the vLLM server at {self.url}: it was not started here")
        return self.log_path.read_text(errors="replace").count(MODEL_LOAD_MARKER)

    def describe_down(self) -> str:
        """Why the server is not answering, as far as this process can tell."""
        if self.process is None:
            return f"the vLLM server at {self.url} (not started by this run) stopped answering"
        rc = self.process.poll()
        state = f"exited with code {rc}" if rc is not None else "is running but not answering"
        tail = self.log_tail(15)
        return (
            f"the vLLM server at {self.url} (started by this run, pid {self.process.pid}) {state}; "
            f"log {self.log_path}" + (f", last lines:\n{tail}" if tail else "")
        )

    # ------------------------------------------------------------ lifecycle

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rc = self.process.poll()
            if rc is not None:
                tail = self.log_tail()
                raise VllmServerError(
                    f"the vLLM server for {self.plan.model if self.plan else '?'} at {self.url} exited with code "
                    f"{rc} before it was ready{memory_hint(self.log_path)}; log {self.log_path}, last lines:\n{tail}"
                )
            if self.is_healthy(2.0):
                return
            time.sleep(0.25)  # a health request is cheap; the phase waits on this
        raise VllmServerError(
            f"the vLLM server at {self.url} did not answer /health within vllm.startup_timeout_s "
            f"({timeout_s:g} s); log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stop a server this process started (SIGTERM to its group, SIGKILL after a grace period).

        A reused server is left running. The work directory is removed unless the server had
        died on its own (then its log stays for whoever reads the error).
        """
        if self.process is None or self._stopped:
            return  # not ours; or already stopped (its group id may belong to someone else by now)
        self._stopped = True
        crashed = self.process.poll() is not None and self.process.returncode != 0
        stop_groups([self.process], STOP_GRACE_S)
        if self.cores is not None:
            self.cores.release()
        if self.storage_dir is not None:
            _remove_request_files(self.storage_dir)
        if self._remove_workdir and self.workdir is not None and not crashed:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def memory_hint(log_path: Path | None) -> str:
    """The setting to change when the server's log says the CPU build could not reserve its KV cache, '' for
    other failures (or no log)."""
    if log_path is None or not log_path.exists():
        return ""
    with log_path.open("rb") as f:
        f.seek(max(0, log_path.stat().st_size - CAUSE_SCAN_BYTES))
        log = f.read().decode(errors="replace")
    if not _KV_CACHE_CAUSE.search(log):
        return ""
    return (
        ": the CPU build could not reserve its KV cache (by default most of the machine's RAM); "
        "set vllm.cpu_kv_cache_gib (e.g. 4) to bound it"
    )


def cpu_env(vllm: VllmSettings) -> dict[str, str]:
    """What the CPU build reads from the environment, not from flags: its KV cache's size, and where its one worker
    runs. On one device, vLLM 0.32's CPU build still starts a worker process beside the engine core's (its platform
    forces the multiprocessing executor while VLLM_ENABLE_V1_MULTIPROCESSING is 1), a third interpreter that imports
    torch and vLLM again: 12 s of every start on this project's 2-core machine (docs/DESIGN.md §6). With it 0, the
    worker runs in the engine core's process, as on one GPU; the server still runs its core apart from the front end."""
    env = {} if vllm.cpu_kv_cache_gib is None else {"VLLM_CPU_KVCACHE_SPACE": str(vllm.cpu_kv_cache_gib)}
    if cpu_build() and vllm.tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _remove_request_files(storage: Path) -> None:
    """Raw hidden-state files (and their locks) left by requests no client collected."""
    for p in storage.glob("*.safetensors*"):
        p.unlink(missing_ok=True)
    for p in storage.glob(".*.safetensors.tmp-*"):
        p.unlink(missing_ok=True)
