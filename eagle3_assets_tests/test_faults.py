"""Faults an operator meets, through the real CLI: a killed run must not wedge the `gpu` pool, a
refusal is not retried (and runs before any model loads), an instance without the pool limit
refuses GPU runs.

Each test runs `dagster asset materialize -m eagle3_assets.definitions` as an operator does, with
`$DAGSTER_HOME` holding the repo's dagster.yaml (or not) and settings from `$EAGLE3_CONFIG`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from dagster import DagsterRunStatus

from .helpers import Operator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]



def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def wait_for_the_gpu_slot(proc: subprocess.Popen, instance) -> None:
    deadline = time.monotonic() + 300
    while not instance.event_log_storage.get_concurrency_info("gpu").claimed_slots:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)


def test_a_killed_cli_shard_run_does_not_wedge_the_gpu_pool(tmp_path, tiny_target_dir):
    """And the instance's `run_retries` relaunches the killed run (a crash), not the Ctrl-C'd one."""
    op = Operator(tmp_path, tiny_target_dir)
    op.data_assets()
    stopped = op.materialize("hidden_states", "rows_0-20")
    with op.instance() as instance:
        wait_for_the_gpu_slot(stopped, instance)
        os.killpg(stopped.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
        finish(stopped)
        (interrupted,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == "rows_0-20"]
        assert interrupted.status == DagsterRunStatus.FAILURE
        assert (interrupted.tags["dagster/max_retries"], interrupted.tags["dagster/will_retry"]) == ("0", "false")
    first = op.materialize("hidden_states", "rows_0-20")
    with op.instance() as instance:
        # Killed (-9, its whole process group: an OOM kill, a node reboot) while it holds the pool's slot.
        wait_for_the_gpu_slot(first, instance)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        (dead,) = [r for r in instance.get_runs() if r.status == DagsterRunStatus.STARTED]
        assert [s.run_id for s in instance.event_log_storage.get_concurrency_info("gpu").claimed_slots] == [dead.run_id]

    # The same command again proceeds on its own: its start fails the dead run and frees the slot.
    second = op.materialize("hidden_states", "rows_0-20")
    out = finish(second)
    assert second.returncode == 0, out[-4000:]
    with op.instance() as instance:
        failed = instance.get_run_by_id(dead.run_id)
        assert failed.status == DagsterRunStatus.FAILURE and failed.tags["eagle3/stall"] == "process_gone"
        assert failed.tags["dagster/will_retry"] == "true"  # a crash: the daemon would relaunch it
        (rerun,) = [r for r in instance.get_runs() if r.status == DagsterRunStatus.SUCCESS and r.run_id != dead.run_id
                    and r.tags.get("dagster/partition") == "rows_0-20"]  # fmt: skip
        said = [e.dagster_event.message for e in instance.all_logs(rerun.run_id) if e.dagster_event]
        assert f"run {dead.run_id} (__ASSET_JOB [rows_0-20]): its process (pid {dead.tags['eagle3/pid']}) is gone; " \
               "marked failed and its pool slots freed" in said
        assert instance.event_log_storage.get_concurrency_info("gpu").claimed_slots == []
        # A run of one step runs it in the run's own process: no second interpreter importing it all again.
        assert f"Executing steps in process (pid: {rerun.tags['eagle3/pid']})" in said
        assert not [m for m in said if m and "in subprocess" in m], said
    assert op.project.store.exists("hidden_states/rows_0-20/_SUCCESS.json")


def test_a_refused_shard_is_not_retried_and_no_model_loads_first(tmp_path, tiny_target_dir):
    """The store cannot hold the shard (disk_margin absurdly high): one attempt, refused in preflight.
    The backend is vLLM with a server URL where nothing listens: had it been opened before the
    preflight, the failure would name the server instead."""
    from eagle3_assets.settings import ExtractionSettings, VllmSettings

    op = Operator(
        tmp_path, tiny_target_dir,
        extraction=ExtractionSettings(backend="vllm", disk_margin=1e12, max_retries=2),
        vllm=VllmSettings(server_url="http://127.0.0.1:9"),
    )  # fmt: skip
    op.data_assets()
    proc = op.materialize("hidden_states", "rows_0-20")
    out = finish(proc)
    assert proc.returncode != 0
    assert "shard rows_0-20: not enough free space on" in out
    assert "not answering /health" not in out
    with op.instance() as instance:
        (run,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == "rows_0-20"]
        retries = [e for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"]
    assert retries == []  # RetryPolicy(max_retries=2) does not apply to a refusal
    assert run.tags["dagster/will_retry"] == "false"  # nor the instance's run_retries


def test_gpu_runs_are_refused_without_the_pool_limit(tmp_path, tiny_target_dir):
    op = Operator(tmp_path, tiny_target_dir, pool_limit=False)
    op.data_assets()
    proc = op.materialize("hidden_states", "rows_0-20")
    out = finish(proc)
    assert proc.returncode != 0
    assert "this Dagster instance has no limit for the `gpu` pool: GPU runs will be refused" in out  # at load
    assert (
        "steps ['hidden_states'] use the gpu pool, but this instance has no limit for it, so two runs could "
        "extract one shard at once: copy the repo's dagster.yaml into $DAGSTER_HOME"
    ) in out
    assert not op.project.store.exists("hidden_states/rows_0-20")
    with op.instance() as instance:
        (run,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == "rows_0-20"]
        # No dagster.yaml, so no run_retries here; the tag keeps one that gets it later from relaunching the run.
        assert run.tags["dagster/max_retries"] == "0"


def test_a_read_only_store_refuses_responses_before_the_model_loads(small_tmpfs):
    """The target named here does not exist: had `responses` loaded it before writing, the error would name it."""
    from dagster import AssetKey, DagsterEventType
    from dagster._core.test_utils import instance_for_test

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.project import Project
    from eagle3_assets.prompts import PROMPTS_FILE, Prompt, dump_prompts
    from eagle3_assets.storage import ArtifactStore

    from .conftest import tiny_settings

    store = ArtifactStore(small_tmpfs / "store")
    store.write_text(PROMPTS_FILE, dump_prompts([Prompt("a", [{"role": "user", "content": "hi"}], {})]))
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    project = Project(tiny_settings(target_model=str(small_tmpfs / "no-model")), store)
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    with instance_for_test() as instance:
        result = job.execute_in_process(instance=instance, asset_selection=[AssetKey("responses")], raise_on_error=False)
        events = [e.dagster_event.event_type for e in instance.all_logs(result.run_id) if e.dagster_event]
    assert not result.success
    (failure,) = result.get_step_failure_events()
    message = failure.step_failure_data.error.message
    assert f"cannot create directory file://{small_tmpfs}/store/responses/parts: [Errno 30] Read-only" in message
    assert "Read-only file system" in message and "no-model" not in message
    assert DagsterEventType.STEP_UP_FOR_RETRY not in events

    source = small_tmpfs.parent / "prompts.jsonl"
    source.write_text('{"id": "a", "prompt": "hi"}\n')
    with instance_for_test() as instance:
        project = Project(tiny_settings(prompts=str(source)), store)
        prompts = build_definitions(project).resolve_implicit_global_asset_job_def()
        result = prompts.execute_in_process(instance=instance, asset_selection=[AssetKey("prompts")], raise_on_error=False)
    (failure,) = result.get_step_failure_events()
    assert failure.step_failure_data.error.cls_name == "Failure"  # a named refusal, not a raw store error
    assert f"cannot write file://{small_tmpfs}/store/prompts/prompts.jsonl: [Errno 30] Read-only" in (
        failure.step_failure_data.error.message
    )
