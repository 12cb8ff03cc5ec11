"""The `drafter` asset's training job: torchrun started as a child, heard through Dagster Pipes.

Rank 0 of the job (`eagle3_assets.drafter.report`) sends its log lines, a progress observation
every few steps and the finished run's figures; this side turns them into the asset's logs,
observations and materialization. torchrun's own console (every rank, prefixed) goes to this
step's stdout. While the job runs, `watch()` is called every `poll_s` seconds: an exception from it
stops the job. A run that is stopped (terminated from the UI, or `watch` raising) stops the job too,
and so does this process's death (`terminate_with_parent`).
"""

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml
from dagster import (
    AssetExecutionContext,
    MaterializeResult,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    open_pipes_session,
)

from eagle3_assets.defs.observe import observe
from eagle3_assets.drafter.launch import (
    LaunchRefused,
    RankFailed,
    describe_failure,
    ranks_per_node,
    refuse_another_world_size,
    torchrun_command,
)
from eagle3_assets.drafter.report import METRICS_MESSAGE
from eagle3_assets.families import EAGLE3, FamilySpec
from eagle3_assets.leases import RUN_ID_ENV
from eagle3_assets.processes import STOP_GRACE_S, terminate_with_parent
from eagle3_assets.project import Project
from eagle3_assets.settings import CONFIG_ENV, ROOT_ENV

POLL_S = 2.0


def _forward(console: Path, offset: int) -> int:
    """Copy what torchrun wrote since `offset` to this step's stdout (the run's compute log)."""
    with console.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    if chunk:
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(chunk)


def _ended(proc: subprocess.Popen, within_s: float) -> bool:
    """Whether `proc` ended within `within_s`: returns as soon as it does, not at the end of a poll interval."""
    try:
        proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def train_with_torchrun(
    context: AssetExecutionContext,
    project: Project,
    *,
    watch: Callable[[], None] = lambda: None,
    poll_s: float = POLL_S,
    family: FamilySpec = EAGLE3,
) -> MaterializeResult:
    """Run `family`'s training job to its end; its materialization, or an `Eagle3Error` naming the failed rank."""
    settings, store = project.settings, project.store
    if store.url.startswith("memory://"):
        raise LaunchRefused(
            f"the drafter trains in torchrun's processes, which cannot see this process's {store.url} store; "
            f"set {ROOT_ENV} to a directory or an object store"
        )
    launch = settings.training.launch
    nproc = ranks_per_node(launch, settings.training.device)  # refusals, before any rank starts
    refuse_another_world_size(store.child(family.root), launch.nnodes * nproc)
    # Beside the run's compute logs in $DAGSTER_HOME, not in /tmp: a failed job's rank logs stay with its run.
    log_dir = Path(context.instance.storage_directory()) / context.run_id / "torchrun"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "settings.yaml"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    console = log_dir / "torchrun.log"
    cmd = torchrun_command(launch, nproc, log_dir, ["--family", family.name])
    context.log.info(f"drafter: {launch.nnodes} node(s) x {nproc} rank(s): {' '.join(cmd)}")
    seen = 0
    with open_pipes_session(
        context=context,
        context_injector=PipesTempFileContextInjector(),
        message_reader=PipesTempFileMessageReader(),
    ) as session:
        env = {
            **os.environ, CONFIG_ENV: str(config), ROOT_ENV: store.url, RUN_ID_ENV: context.run_id,
            **session.get_bootstrap_env_vars(),
        }  # fmt: skip
        with console.open("wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=terminate_with_parent(),
            )  # fmt: skip
        offset = 0
        try:
            while not _ended(proc, poll_s):
                offset = _forward(console, offset)
                seen = _observe(context, session.get_custom_messages(), seen)
                watch()
        finally:
            _stop(proc)
        _forward(console, offset)
    _observe(context, session.get_custom_messages(), seen)
    if proc.returncode != 0:
        raise describe_failure(console.read_text(errors="replace"), proc.returncode, log_dir, launch)
    results = [r for r in session.get_results() if isinstance(r, MaterializeResult)]
    if not results:
        raise RankFailed(f"the training job exited 0 but rank 0 reported no result; its output: {console}")
    shutil.rmtree(log_dir, ignore_errors=True)
    return results[-1]


def _observe(context: AssetExecutionContext, messages: list, seen: int) -> int:
    for m in messages[seen:]:
        if isinstance(m, dict) and m.get("kind") == METRICS_MESSAGE:
            observe(context, {k: v for k, v in m.items() if k != "kind"})
    return len(messages)
