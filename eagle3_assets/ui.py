"""`make ui`: the Dagster webserver and daemon against `workspace.yaml` and $DAGSTER_HOME.

The webserver shows the asset graph, shard partitions and their progress figures; the
daemon runs what the UI queues (backfills, the run queue, sensors, run monitoring).
Each starts in its own session (process group): a Dagster server started in the
background of a script ignores SIGTERM/SIGINT sent to it alone (docs/DESIGN.md §7), so both
are stopped by signalling their whole group, and killed when they do not go in time.
Ctrl-C or SIGTERM here stops both; if either dies, the other is stopped too.
The instance's storage is created (or migrated) once, before either starts: on a fresh
$DAGSTER_HOME both would create the SQLite schema at the same moment, and one would die of
`table alembic_version already exists`.

    EAGLE3_UI_HOST (default 127.0.0.1)   EAGLE3_UI_PORT (default 3000)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.errors import Eagle3Error
from eagle3_assets.processes import STOP_GRACE_S, stop_groups

HOST_ENV = "EAGLE3_UI_HOST"
PORT_ENV = "EAGLE3_UI_PORT"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 3000
REPO_ROOT = Path(__file__).resolve().parent.parent


class UiError(Eagle3Error, RuntimeError):
    """The UI cannot start or stopped on its own; the message names the process or setting."""


@dataclass(frozen=True)
class UiConfig:
    dagster_home: Path
    workspace: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> UiConfig:
        """$DAGSTER_HOME (required), $EAGLE3_UI_HOST/$EAGLE3_UI_PORT, the repo's workspace.yaml."""
        env = os.environ if environ is None else environ
        home = env.get("DAGSTER_HOME")
        if not home:
            raise UiError("DAGSTER_HOME is not set: runs would go to a temporary instance. Run `make ui`.")
        port_text = env.get(PORT_ENV) or str(DEFAULT_PORT)
        try:
            port = int(port_text)
        except ValueError:
            raise UiError(f"{PORT_ENV}={port_text!r} is not a port number") from None
        if not 1 <= port <= 65535:
            raise UiError(f"{PORT_ENV}={port} is outside 1..65535")
        return cls(
            dagster_home=Path(home).resolve(),
            workspace=REPO_ROOT / "workspace.yaml",
            host=env.get(HOST_ENV) or DEFAULT_HOST,
            port=port,
        )


def webserver_command(config: UiConfig) -> list[str]:
    bin_dir = Path(sys.executable).parent
    return [
        str(bin_dir / "dagster-webserver"),
        "-w", str(config.workspace),
        "-h", config.host,
        "-p", str(config.port),
    ]  # fmt: skip


def daemon_command(config: UiConfig) -> list[str]:
    return [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(config.workspace)]


def prepare_instance(env: Mapping[str, str], timeout_s: float = 300.0) -> None:
    """Create (or bring up to date) the storage of the instance at `env`'s $DAGSTER_HOME, in one process: the
    webserver and daemon started next then find its schema made. UiError with the command's output on failure."""
    cmd = [str(Path(sys.executable).parent / "dagster"), "instance", "migrate"]
    try:
        done = subprocess.run(
            cmd, cwd=REPO_ROOT, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UiError(f"cannot create the instance storage in {env['DAGSTER_HOME']} (`{' '.join(cmd)}`): {e}") from e
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
        raise UiError(
            f"cannot create the instance storage in {env['DAGSTER_HOME']}: `{' '.join(cmd)}` exited with code "
            f"{done.returncode}:\n" + "\n".join(tail)
        )


@dataclass
class UiProcesses:
    """The running webserver and daemon, each the leader of its own process group."""

    config: UiConfig
    webserver: subprocess.Popen
    daemon: subprocess.Popen
    logs: list[Path] = field(default_factory=list)

    def exited(self) -> dict[str, int]:
        """Name -> exit code of whichever has stopped."""
        codes = {"webserver": self.webserver.poll(), "daemon": self.daemon.poll()}
        return {name: code for name, code in codes.items() if code is not None}

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM both groups, wait up to `grace_s`, then SIGKILL what is left (code servers included)."""
        stop_groups([self.webserver, self.daemon], grace_s)


def start_ui(config: UiConfig, env: Mapping[str, str] | None = None, log_dir: Path | None = None) -> UiProcesses:
    """Start the webserver and daemon; output goes to `log_dir` (webserver.log, daemon.log) or is inherited."""
    if not config.workspace.is_file():
        raise UiError(f"workspace file {config.workspace} does not exist")
    config.dagster_home.mkdir(parents=True, exist_ok=True)
    child_env = {**(os.environ if env is None else env), "DAGSTER_HOME": str(config.dagster_home)}
    child_env.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    prepare_instance(child_env)
    logs: list[Path] = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        out = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"{name}.log"
            logs.append(path)
            out = path.open("ab")
        try:
            return subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT if out else None, start_new_session=True,
            )  # fmt: skip
        finally:
            if out is not None:
                out.close()  # the child holds its own copy

    webserver = spawn("webserver", webserver_command(config))
    try:
        daemon = spawn("daemon", daemon_command(config))
    except BaseException:
        stop_groups([webserver], 0.0)
        raise
    return UiProcesses(config, webserver, daemon, logs)


def server_info(url: str, timeout_s: float = 5.0) -> dict | None:
    """The webserver's /server_info, or None while it is not answering."""
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_until_serving(ui: UiProcesses, timeout_s: float = 300.0, poll_s: float = 1.0) -> dict:
    """Poll the webserver until it answers; UiError when a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = ui.exited()
        if exited:
            raise UiError(f"stopped while starting: {_describe_exits(exited)}{_log_hint(ui)}")
        info = server_info(ui.config.url)
        if info is not None:
            return info
        time.sleep(poll_s)
    raise UiError(f"webserver did not answer on {ui.config.url} within {timeout_s:.0f}s{_log_hint(ui)}")


def _describe_exits(exited: dict[str, int]) -> str:
    return ", ".join(f"{name} exited with code {code}" for name, code in exited.items())


def _log_hint(ui: UiProcesses) -> str:
    return f" (logs: {', '.join(str(p) for p in ui.logs)})" if ui.logs else ""


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def main() -> int:
    try:
        config = UiConfig.from_environment()
    except UiError as e:
        print(f"[ui] {e}", file=sys.stderr)
        return 2
    if not (config.dagster_home / "dagster.yaml").is_file():
        print(
            f"[ui] warning: {config.dagster_home}/dagster.yaml is missing: no gpu pool limit or run monitoring "
            "(`make ui` copies the repo's dagster.yaml there)",
            file=sys.stderr,
        )
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    ui: UiProcesses | None = None
    code = 0
    try:
        ui = start_ui(config)
        print(f"[ui] webserver on {config.url}, daemon running; DAGSTER_HOME={config.dagster_home}. Ctrl-C stops both.")
        while not (exited := ui.exited()):
            time.sleep(1.0)
        print(f"[ui] {_describe_exits(exited)}; stopping the rest", file=sys.stderr)
        code = 1
    except UiError as e:  # the instance storage could not be made: nothing was started
        print(f"[ui] {e}", file=sys.stderr)
        code = 2
    except _Stop as sig:
        print(f"[ui] {sig}: stopping the webserver and daemon", file=sys.stderr)
    finally:
        # A second Ctrl-C must not interrupt the cleanup and leave servers behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ui is not None:
            ui.stop()
    print("[ui] stopped", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
