"""`python -m eagle3_assets.vllm_server --serve --role extract|generate`: the long-lived server of a phase.

It reads the pipeline settings ($EAGLE3_CONFIG) and the artifact root ($EAGLE3_ROOT),
prints the URL to put in `vllm.server_urls`, and serves until Ctrl-C / SIGTERM. An
extraction server may write sample files straight into the artifact store when it is
on a filesystem the server sees (`--write-root`, default $EAGLE3_ROOT when local).

`--supervise PARENT_PID -- COMMAND…` is the supervisor every started server runs
under (`supervisor.py`); it imports nothing heavy.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_assets.settings import Settings
    from eagle3_assets.target import TargetModel
    from eagle3_assets.vllm_server.protocol import Role


def serve_forever(
    target: TargetModel, settings: Settings, role: Role, *, host: str | None, port: int | None, workdir: Path, write_roots: list[str]
) -> int:
    """Start, print the URL, block until Ctrl-C / SIGTERM or the server exits."""
    from eagle3_assets.vllm_server.server import SERVER_LOG_FILE, VllmServer

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM like Ctrl-C, also during the (long) startup: both end in server.stop().
    signal.signal(signal.SIGTERM, interrupt)
    print(f"starting vLLM ({role}) for {target.path}; log {workdir / SERVER_LOG_FILE}", flush=True)
    try:
        server = VllmServer.start(
            target, settings.vllm, role, host=host, port=port, workdir=workdir, write_roots=write_roots
        )
    except KeyboardInterrupt:
        print("interrupted before the server was ready; stopped", flush=True)
        return 0
    assert server.process is not None
    layers = f", extracting layers {server.plan.layer_ids}" if server.plan and server.plan.layer_ids else ""
    writes = f"; writes sample files under {write_roots}" if layers and write_roots else ""
    print(f"vLLM server ready at {server.url} (role {role}{layers}{writes}; process group {server.process.pid})")
    print(f"use it from the pipeline with   vllm: {{server_urls: [{server.url}]}}")
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
        from eagle3_assets.vllm_server.supervisor import supervise

        if len(argv) < 4 or argv[2] != "--":
            print("usage: --supervise PARENT_PID -- COMMAND...", file=sys.stderr)
            return 2
        return supervise(int(argv[1]), argv[3:])

    from eagle3_assets.vllm_server.protocol import ROLES

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
        help="server.log and raw hidden-state files; default $TMPDIR/eagle3-vllm-<port> (use local NVMe on a GPU node)",
    )  # fmt: skip
    parser.add_argument(
        "--write-root", action="append", default=None,
        help="a local store the server may write sample files into (repeatable); default $EAGLE3_ROOT when local",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from eagle3_assets.errors import Eagle3Error
    from eagle3_assets.project import Project

    try:
        project = Project.from_environment()
        settings = project.settings
        port = args.port or settings.vllm.port
        workdir = args.workdir or Path(tempfile.gettempdir()) / f"eagle3-vllm-{port}"
        local_root = project.store.local_path("")
        roots = args.write_root if args.write_root is not None else ([str(local_root)] if local_root else [])
        return serve_forever(
            project.target(), settings, args.role, host=args.host, port=port, workdir=workdir, write_roots=roots
        )
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
