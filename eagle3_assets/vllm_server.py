"""The vLLM server the `vllm` backends talk to: started for one run, or a long-lived one reused.

Two ways to get a server (DESIGN §6):

- `vllm.server_url` unset: the run starts `vllm serve` for itself, as a child process
  in its own process group, waits for `/health`, and stops the whole group when it
  closes its backend. One model load per run.
- `vllm.server_url` set: the run checks `/health` there and uses that server; closing
  the backend leaves it running. On a GPU node, start it once for a whole phase:

      python -m eagle3_assets.vllm_server --serve --role extract   # or --role generate

  It reads the pipeline settings ($EAGLE3_CONFIG), prints the URL to put in
  `vllm.server_url`, and serves until Ctrl-C / SIGTERM. Every shard run then uses the
  one model load, while shards still materialize, fail and retry independently.

Roles, because the phases need different flags: `generate` serves chat completions
(with `--reasoning-parser` when configured); `extract` adds the `extract_hidden_states`
speculative method and our hidden-states KV connector (`eagle3_assets.vllm_connector`),
which writes one safetensors file per request into the server's storage directory.
`both` has both flag sets: it generates correctly too (greedy output equals HF), but
every chat request then also writes its prompt's hidden states (which the generator
deletes) and the hidden-state cache takes KV-cache memory, so a phase = one server is
the recommended setup. An `extract` server records what it extracts in
`<storage dir>/eagle3_server.json`, so a client can check the layer ids before it
writes any shard.

Every server this module starts runs under a small supervisor
(`python -m eagle3_assets.vllm_server --supervise PID -- vllm serve …`) that stops the
server when the process that started it dies without stopping it (a killed run must
not leave a GPU server behind).

No torch or vLLM import here: starting, reaching and supervising a server needs neither
(the client talks HTTP with urllib).
"""

from __future__ import annotations

import argparse
import fcntl
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3_assets.settings import Settings, SettingsError, VllmSettings, read_model_shape

Role = Literal["generate", "extract", "both"]
ROLES: tuple[str, ...] = ("generate", "extract", "both")

SERVER_INFO_FILE = "eagle3_server.json"  # in the storage dir, next to the hidden-state files
SERVER_LOG_FILE = "server.log"
STORAGE_SUBDIR = "hidden_states"
# vLLM logs this once per model load (per worker: TP ranks each log it on a GPU node).
MODEL_LOAD_MARKER = "Starting to load model"
CONNECTOR_MODULE = "eagle3_assets.vllm_connector"
CONNECTOR_CLASS = "CpuSafeHiddenStatesConnector"
STOP_GRACE_S = 30.0
HEALTH_TIMEOUT_S = 10.0


class VllmServerError(RuntimeError):
    """A server cannot be started, reached or used; the message names its URL."""


class ServerUnreachableError(VllmServerError):
    """No HTTP answer at all (refused, reset, timed out): the server is down or gone."""


class RequestRejectedError(RuntimeError):
    """The server answered one request with an HTTP error; it is still up."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


def http_json(url: str, body: dict[str, Any] | None = None, *, timeout: float) -> dict[str, Any]:
    """GET (body None) or POST JSON; the decoded JSON answer.

    ServerUnreachableError when nothing answers, RequestRejectedError on an HTTP error status.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RequestRejectedError(url, e.code, str(detail)[:2000]) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachableError(f"{url}: no answer ({reason})") from None
    return json.loads(raw) if raw else {}


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (tests and benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def hidden_states_file(path: str) -> Iterator[Path]:
    """The file a server wrote for one request, once complete; removed (with its lock) afterwards.

    The server answers before the file is on disk; its connector holds an exclusive lock
    on `<path>.lock` from before the answer until the file is written, so a shared lock
    waits exactly as long as needed. The server never deletes these files: we do.
    """
    lock = f"{path}.lock"
    try:
        if os.path.exists(lock):
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
        yield Path(path)
    finally:
        for p in (path, lock):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- the `vllm serve` command


def extraction_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Layers the server extracts: the aux ids and N (the last layer's output, pre-norm), sorted.

    vLLM sorts and de-duplicates them and writes them in this order, so the file's
    `hidden_states[:, i]` is layer `extraction_layer_ids(...)[i]`.
    """
    return sorted(set(int(i) for i in aux_layer_ids) | {int(num_layers)})


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(storage_dir: str | Path) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


def serve_args(
    model_dir: str | Path,
    vllm: VllmSettings,
    *,
    role: Role,
    host: str,
    port: int,
    layer_ids: Sequence[int] = (),
    storage_dir: str | Path | None = None,
) -> list[str]:
    """Arguments after `vllm serve`: the engine settings passed through, plus the role's flags."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    args = [
        str(model_dir),
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(vllm.tensor_parallel_size),
        "--dtype", vllm.dtype,
        "--gpu-memory-utilization", str(vllm.gpu_memory_utilization),
        # ~one access-log line per request otherwise: millions over an extraction phase
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if vllm.max_model_len is not None:
        args += ["--max-model-len", str(vllm.max_model_len)]
    if role in ("generate", "both") and vllm.reasoning_parser:
        args += ["--reasoning-parser", vllm.reasoning_parser]
    if role in ("extract", "both"):
        if not layer_ids or storage_dir is None:
            raise ValueError("an extraction server needs its layer ids and a storage directory")
        args += ["--speculative-config", json.dumps(speculative_config(layer_ids))]
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(storage_dir))]
    return args + list(vllm.extra_args)


@dataclass(frozen=True)
class ServerPlan:
    """What a server for `model_dir` under `settings` extracts; written as `eagle3_server.json`."""

    role: str
    model: str
    num_layers: int
    hidden_size: int
    aux_layer_ids: list[int]
    layer_ids: list[int]  # what an extract server writes, in file order; [] for generate

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def plan_server(model_dir: str | Path, role: Role, aux_layer_ids: Sequence[int] | None = None) -> ServerPlan:
    """The plan of a server for `model_dir`; an extracting role needs the aux layer ids."""
    shape = read_model_shape(str(model_dir))
    if shape is None or not shape.hidden_size:
        raise VllmServerError(f"target model: cannot read its shape from {model_dir}/config.json")
    extracts = role in ("extract", "both")
    if extracts and not aux_layer_ids:
        raise VllmServerError(f"a vLLM server with role {role!r} needs the aux layer ids to extract")
    aux = sorted(int(i) for i in aux_layer_ids or ())
    layers = extraction_layer_ids(aux, shape.num_layers) if extracts else []
    return ServerPlan(role, str(model_dir), shape.num_layers, shape.hidden_size, aux, layers)


def settings_aux_layer_ids(settings: Settings, model_dir: str | Path) -> list[int]:
    """`aux_layer_ids` (or the default) for the model in `model_dir`, checked against it."""
    shape = read_model_shape(str(model_dir))
    if shape is None:
        raise VllmServerError(f"target model: cannot read num_hidden_layers from {model_dir}/config.json")
    try:
        return settings.resolved_aux_layer_ids(shape.num_layers)
    except SettingsError as e:
        raise VllmServerError(str(e)) from None


@dataclass(frozen=True)
class ServedModel:
    """What `/v1/models` says: the id to put in requests and the context length."""

    url: str
    model_id: str
    root: str
    max_model_len: int


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
    ):
        self.url = url.rstrip("/")
        self.process = process
        self.workdir = workdir
        self._remove_workdir = remove_workdir
        self._stopped = False
        self.plan = plan

    # ------------------------------------------------------------ getting one

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        vllm: VllmSettings,
        role: Role,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        host: str | None = None,
        port: int | None = None,
        workdir: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        """Start `vllm serve` for `model_dir` and wait until `/health` answers.

        `workdir` holds `server.log` and the hidden-state files (`hidden_states/`); by default a
        fresh temporary directory, removed at `stop()` unless the server failed (its log is kept
        for the error message). Host and port default to `vllm.host` / `vllm.port`.
        """
        host = host or vllm.host
        port = port or vllm.port
        url = f"http://{host}:{port}"
        if port_in_use(host, port):
            raise VllmServerError(
                f"cannot start a vLLM server at {url}: the port is already in use (another server? "
                f"set vllm.server_url to {url} to reuse it, or choose another vllm.port)"
            )
        plan = plan_server(model_dir, role, aux_layer_ids)
        remove = workdir is None
        wd = Path(tempfile.mkdtemp(prefix="eagle3-vllm-")) if workdir is None else Path(workdir)
        storage = wd / STORAGE_SUBDIR
        storage.mkdir(parents=True, exist_ok=True)
        _remove_request_files(storage)
        (storage / SERVER_INFO_FILE).write_text(json.dumps(plan.to_json(), indent=1))
        args = serve_args(
            model_dir, vllm, role=role, host=host, port=port, layer_ids=plan.layer_ids, storage_dir=storage
        )
        cmd = [
            sys.executable, "-m", "eagle3_assets.vllm_server", "--supervise", str(os.getpid()), "--",
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
        ]  # fmt: skip
        with open(wd / SERVER_LOG_FILE, "wb") as log:  # this server's log only: model_loads() counts in it
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            # Own session = own process group: stop() signals the server and all its workers at once.
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **(env or {})},
            )  # fmt: skip
        server = cls(url, process=process, workdir=wd, remove_workdir=remove, plan=plan)
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
        cls, model_dir: str | Path, vllm: VllmSettings, role: Role, *, aux_layer_ids: Sequence[int] | None = None
    ) -> VllmServer:
        """The configured `vllm.server_url` if set, else a server started for this run."""
        if vllm.server_url:
            return cls.attach(vllm.server_url)
        return cls.start(model_dir, vllm, role, aux_layer_ids=aux_layer_ids)

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
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return False

    def served_model(self) -> ServedModel:
        """The (single) model the server serves."""
        answer = http_json(f"{self.url}/v1/models", timeout=HEALTH_TIMEOUT_S)
        models = answer.get("data") or []
        if len(models) != 1:
            raise VllmServerError(f"the vLLM server at {self.url} serves {len(models)} models; expected exactly 1")
        m = models[0]
        return ServedModel(self.url, str(m["id"]), str(m.get("root") or m["id"]), int(m["max_model_len"]))

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
                raise VllmServerError(
                    f"the vLLM server for {self.plan.model if self.plan else '?'} at {self.url} exited with code "
                    f"{rc} before it was ready; log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            if self.is_healthy(2.0):
                return
            time.sleep(1.0)
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
        _stop_group(self.process, STOP_GRACE_S)
        if self.storage_dir is not None:
            _remove_request_files(self.storage_dir)
        if self._remove_workdir and self.workdir is not None and not crashed:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_group(process: subprocess.Popen, grace_s: float) -> None:
    pgid = process.pid  # start_new_session: the child leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Whatever is left of the group (workers that ignored SIGTERM, or the whole server on timeout).
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


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
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _remove_request_files(storage: Path) -> None:
    """Hidden-state files (and their locks) left by requests no client collected."""
    for p in storage.glob("*.safetensors*"):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- supervisor and CLI


def supervise(parent_pid: int, cmd: list[str], poll_s: float = 1.0) -> int:
    """Run `cmd`; stop it when `parent_pid` is no longer our parent. Returns its exit code.

    We lead the process group (start_new_session in `VllmServer.start`), so a signal to
    the group reaches `cmd` directly; one sent to us alone is passed on. Either way we
    wait for `cmd` to finish.
    """
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


def serve_forever(
    settings: Settings, model_dir: Path, role: Role, *, host: str | None, port: int | None, workdir: Path
) -> int:
    """The long-lived server of a phase: start, print the URL, block until Ctrl-C / SIGTERM or the server exits."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM like Ctrl-C, also during the (long) startup: both end in server.stop().
    signal.signal(signal.SIGTERM, interrupt)
    print(f"starting vLLM ({role}) for {model_dir}; log {workdir / SERVER_LOG_FILE}", flush=True)
    aux = settings_aux_layer_ids(settings, model_dir) if role in ("extract", "both") else None
    try:
        server = VllmServer.start(
            model_dir, settings.vllm, role, aux_layer_ids=aux, host=host, port=port, workdir=workdir
        )
    except KeyboardInterrupt:
        print("interrupted before the server was ready; stopped", flush=True)
        return 0
    assert server.process is not None
    layers = f", extracting layers {server.plan.layer_ids}" if server.plan and server.plan.layer_ids else ""
    print(f"vLLM server ready at {server.url} (role {role}{layers}; process group {server.process.pid})", flush=True)
    print(f"use it from the pipeline with   vllm: {{server_url: {server.url}}}", flush=True)
    print(f"URL={server.url}", flush=True)
    try:
        while server.process.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        server.stop()
        print("vLLM server stopped", flush=True)
        return 0
    code = server.process.returncode
    server.stop()
    print(f"the vLLM server exited with code {code}; log {server.log_path}", file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--supervise"]:
        if len(argv) < 4 or argv[2] != "--":
            print("usage: --supervise PARENT_PID -- COMMAND...", file=sys.stderr)
            return 2
        return supervise(int(argv[1]), argv[3:])

    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.vllm_server",
        description="Start the long-lived vLLM server of a phase for the configured target ($EAGLE3_CONFIG).",
    )
    parser.add_argument("--serve", action="store_true", required=True, help="start the server and block")
    parser.add_argument(
        "--role", choices=ROLES, default="extract", help="extract (hidden_states), generate (responses), or both"
    )
    parser.add_argument("--host", default=None, help="default: vllm.host")
    parser.add_argument("--port", type=int, default=None, help="default: vllm.port")
    parser.add_argument(
        "--workdir", type=Path, default=None,
        help="server.log and the hidden-state files; default $TMPDIR/eagle3-vllm-<port> (use local NVMe on a GPU node)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from eagle3_assets.project import Project

    project = Project.from_environment()
    settings = project.settings
    port = args.port or settings.vllm.port
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"eagle3-vllm-{port}"
    try:
        return serve_forever(settings, project.target_dir(), args.role, host=args.host, port=port, workdir=workdir)
    except VllmServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
