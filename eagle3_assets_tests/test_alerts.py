"""Stall and crash detection, webhook alerts, and the sensors that run them, against real instances,
real processes and a real HTTP server on 127.0.0.1."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from dagster import (
    AssetKey,
    AssetObservation,
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    EventLogEntry,
    build_run_status_sensor_context,
    build_sensor_context,
)
from dagster._core.definitions.sensor_definition import SensorEvaluationContext
from dagster._core.events import AssetObservationData, EngineEventData
from dagster._core.execution.build_resources import wrap_resources_for_execution
from dagster._core.remote_origin import RegisteredCodeLocationOrigin
from dagster._core.test_utils import instance_for_test

from eagle3_assets.alerts import (
    Alert,
    RunProgress,
    Stall,
    find_stalls,
    post_alert,
    redact,
    run_failure_alert,
    stall_alert,
)
from eagle3_assets.definitions import build_definitions
from eagle3_assets.defs.ops.runs import ALERTED_TAG, PID_TAG, process_tags, record_run_process, sweep_dead_runs
from eagle3_assets.defs.ops.sensors import (
    STALL_SINCE_TAG,
    STALL_TAG,
    build_shard_stall_sensor,
    dead_runs_sensor,
    run_failure_alert_sensor,
)
from eagle3_assets.processes import process_alive
from eagle3_assets.project import Project
from eagle3_assets.settings import AlertSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets_tests.conftest import tiny_settings

WEBHOOK_ENV = "EAGLE3_TEST_ALERT_WEBHOOK"
SECRET_PATH = "/hooks/T000/B000/s3cr3t-t0ken"


class WebhookServer:
    """A webhook receiver on 127.0.0.1: records every POSTed JSON body; answers `statuses` in turn, then 200."""

    def __init__(self, statuses: list[int] | None = None):
        self.received: list[dict] = []
        self.headers: list[dict] = []
        self.statuses = list(statuses or [])
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.received.append(json.loads(body))
                server.headers.append(dict(self.headers))
                status = server.statuses.pop(0) if server.statuses else 200
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}{SECRET_PATH}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "WebhookServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def kinds(self) -> list[str]:
        return [p["alert"]["kind"] for p in self.received]


ALERTS = AlertSettings(stall_after_s=600, webhook_env=WEBHOOK_ENV)


def progress(run_id="r1", **kw) -> RunProgress:
    base = dict(run_id=run_id, partition="rows_0-2000", started_at=1000.0, last_progress_at=None)
    base.update(kw)
    return RunProgress(**base)


# --- stall decisions -----------------------------------------------------------------------------


def test_find_stalls_reports_silent_runs_and_gone_processes():
    runs = [
        progress("fresh", last_progress_at=1500.0),  # silent 500 s: fine
        progress("silent", last_progress_at=1400.0),  # silent exactly 600 s: stalled
        progress("never", last_progress_at=None),  # no observation since its start at 1000: stalled
        progress("gone", last_progress_at=1990.0, pid=4242, process_alive=False),  # reported at once
        progress("alive", last_progress_at=1000.0, pid=4243, process_alive=True),  # alive but silent: stalled
    ]
    stalls = find_stalls(runs, now=2000.0, stall_after_s=600)
    assert [(s.kind, s.run.run_id, s.silent_for_s) for s in stalls] == [
        ("stalled", "silent", 600.0),
        ("stalled", "never", 1000.0),
        ("process_gone", "gone", 10.0),
        ("stalled", "alive", 1000.0),
    ]


def test_a_stall_is_alerted_once_until_progress_resumes_and_stops_again():
    alerted = progress(last_progress_at=1200.0, alerted_silent_since=1200.0)
    assert find_stalls([alerted], now=5000.0, stall_after_s=600) == []
    # Progress came back at 3000 and stopped again: a new stall.
    again = progress(last_progress_at=3000.0, alerted_silent_since=1200.0)
    assert [s.silent_for_s for s in find_stalls([again], now=5000.0, stall_after_s=600)] == [2000.0]
    # A run that started after an (impossible) earlier observation counts from its start.
    assert progress(started_at=1000.0, last_progress_at=900.0).silent_since == 1000.0


def test_stall_messages_name_the_shard_run_and_figures():
    stalled = Stall("stalled", progress(last_progress_at=1000.0, samples_done=120, samples_total=2000), 1500.0)
    assert stalled.message() == "shard rows_0-2000 (run r1): stalled, no progress for 25.0 min (120/2000 samples done)"
    never = Stall("stalled", progress(), 700.0)
    assert never.message() == (
        "shard rows_0-2000 (run r1): stalled, no progress reported in the 11.7 min since it started"
    )
    gone = Stall("process_gone", progress(last_progress_at=1000.0, samples_done=5, samples_total=20, pid=77), 30.0)
    assert gone.message() == (
        "shard rows_0-2000 (run r1): its process (pid 77) is gone, no progress for 30 s (5/20 samples done); "
        "marking the run failed"
    )
    alert = stall_alert(gone, ui_url="http://ui.example:3000/")
    assert alert.kind == "shard_process_gone"
    assert alert.text.endswith("\nhttp://ui.example:3000/runs/r1")
    assert alert.payload()["alert"] == {
        "kind": "shard_process_gone",
        "run_id": "r1",
        "partition": "rows_0-2000",
        "silent_for_s": 30.0,
        "samples_done": 5,
        "samples_total": 20,
        "pid": 77,
    }
    failed = run_failure_alert("r9", "__ASSET_JOB", "rows_20-40", "x" * 2000, max_error_chars=10)
    assert failed.text == "run r9 of __ASSET_JOB [rows_20-40] failed: xxxxxxxxxx …"


def test_process_alive_sees_live_dead_zombie_and_reused_pids():
    assert process_alive(os.getpid())
    assert process_alive(os.getpid(), started_by=time.time())
    # A process that started after `started_by` holds a reused pid: not the one we look for.
    assert not process_alive(os.getpid(), started_by=time.time() - 10 * 365 * 86400)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    assert not process_alive(exited.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and open(f"/proc/{zombie.pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.05)
    try:
        assert not process_alive(zombie.pid)  # exited, not yet reaped
    finally:
        zombie.wait()
    assert not process_alive(0) and not process_alive(-5)


# --- webhook -------------------------------------------------------------------------------------


def test_post_alert_sends_the_alert_as_json(monkeypatch):
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        result = post_alert(Alert("run_failed", "run r1 failed: boom", {"run_id": "r1"}), ALERTS)
    assert result.sent and result.detail == f"webhook ${WEBHOOK_ENV} answered HTTP 200"
    assert hook.received == [{"text": "[eagle3] run r1 failed: boom", "alert": {"kind": "run_failed", "run_id": "r1"}}]
    assert hook.headers[0]["Content-Type"] == "application/json"


def test_post_alert_retries_a_server_error_but_not_a_client_error(monkeypatch):
    alert = Alert("run_failed", "t")
    with WebhookServer(statuses=[503]) as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        assert post_alert(alert, ALERTS).sent
    assert len(hook.received) == 2
    with WebhookServer(statuses=[404]) as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        result = post_alert(alert, ALERTS)
    assert len(hook.received) == 1
    assert not result.sent and result.detail == f"webhook ${WEBHOOK_ENV} failed: HTTP 404 Not Found"


def test_no_webhook_configured_sends_nothing_and_says_why(monkeypatch):
    monkeypatch.delenv(WEBHOOK_ENV, raising=False)
    result = post_alert(Alert("run_failed", "t"), ALERTS)
    assert (result.sent, result.detail) == (False, f"no webhook configured (${WEBHOOK_ENV} is not set)")
    monkeypatch.setenv(WEBHOOK_ENV, "file:///etc/passwd")
    result = post_alert(Alert("run_failed", "t"), ALERTS)
    assert (result.sent, result.detail) == (False, f"${WEBHOOK_ENV} does not hold an http(s) URL; alert not sent")


def test_a_webhook_failure_never_reveals_the_url(monkeypatch):
    with WebhookServer() as hook:
        url = hook.url
    # The server is gone: the port refuses connections.
    monkeypatch.setenv(WEBHOOK_ENV, url)
    result = post_alert(Alert("run_failed", "t"), ALERTS, timeout_s=5, attempts=1)
    assert not result.sent
    assert result.detail == f"webhook ${WEBHOOK_ENV} failed: URLError: <urlopen error [Errno 111] Connection refused>"
    assert redact(f"cannot open {url} (path {SECRET_PATH})", url) == "cannot open <webhook URL> (path <webhook URL>)"
    # http.client quotes the path of a malformed URL in its error: it must not reach the detail.
    monkeypatch.setenv(WEBHOOK_ENV, "http://127.0.0.1:9/hooks/s3cr3t t0ken")
    result = post_alert(Alert("run_failed", "t"), ALERTS, timeout_s=5, attempts=1)
    assert result.detail == (
        f"webhook ${WEBHOOK_ENV} failed: InvalidURL: URL can't contain control characters. "
        "'<webhook URL>' (found at least ' ')"
    )


def test_a_webhook_with_user_info_is_sent_with_basic_auth_and_its_password_never_shown(monkeypatch):
    with WebhookServer() as hook:
        host = hook.url.split("//", 1)[1]
        monkeypatch.setenv(WEBHOOK_ENV, f"http://bot:S3CRET@{host}")
        result = post_alert(Alert("run_failed", "t"), ALERTS, timeout_s=5, attempts=1)
    assert result.sent and result.detail == f"webhook ${WEBHOOK_ENV} answered HTTP 200"
    assert hook.headers[0]["Authorization"] == "Basic Ym90OlMzQ1JFVA=="  # bot:S3CRET
    monkeypatch.setenv(WEBHOOK_ENV, "http://bot:S3CRET@127.0.0.1:notaport/hook")
    result = post_alert(Alert("run_failed", "t"), ALERTS, timeout_s=5, attempts=1)
    assert result.detail == f"${WEBHOOK_ENV} does not hold a valid URL; alert not sent"
    assert "S3CRET" not in redact("InvalidURL: nonnumeric port: 'S3CRET@host'", "http://bot:S3CRET@host/x")


# --- sensors -------------------------------------------------------------------------------------


@pytest.fixture()
def project(tmp_path) -> Project:
    return Project(tiny_settings(alerts=ALERTS), ArtifactStore(str(tmp_path / "store")))


@pytest.fixture()
def instance():
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as inst:
        yield inst


def _entry(run: DagsterRun, event_type: DagsterEventType, timestamp: float, specific=None) -> EventLogEntry:
    return EventLogEntry(
        error_info=None,
        level=logging.INFO,
        user_message="",
        run_id=run.run_id,
        timestamp=timestamp,
        dagster_event=DagsterEvent(event_type.value, job_name=run.job_name, event_specific_data=specific),
    )


def start_shard_run(instance: DagsterInstance, project: Project, partition: str, started_at: float) -> DagsterRun:
    """A `hidden_states` run as the launcher creates it, started at `started_at` (epoch s)."""
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    run = instance.create_run_for_job(
        job, asset_selection={AssetKey("hidden_states")}, tags={"dagster/partition": partition}
    )
    instance.handle_new_event(_entry(run, DagsterEventType.RUN_START, started_at))
    return instance.get_run_by_id(run.run_id)


def record_progress(instance: DagsterInstance, run: DagsterRun, at: float, done: int, total: int) -> None:
    observation = AssetObservation(
        asset_key="hidden_states",
        partition=run.tags["dagster/partition"],
        metadata={"samples_done": done, "samples_total": total, "samples_per_s": 1.5},
    )
    instance.handle_new_event(
        _entry(run, DagsterEventType.ASSET_OBSERVATION, at, AssetObservationData(observation))
    )


def evaluate(sensor, instance: DagsterInstance, project: Project):
    return sensor(build_sensor_context(instance=instance, resources={"project": project}))


def test_stall_sensor_marks_a_silent_shard_run_and_alerts_once(instance, project, monkeypatch):
    now = time.time()
    silent = start_shard_run(instance, project, "rows_0-20", now - 3000)
    record_progress(instance, silent, now - 1000, 7, 20)
    busy = start_shard_run(instance, project, "rows_20-40", now - 3000)
    record_progress(instance, busy, now - 5, 19, 20)
    sensor = build_shard_stall_sensor(check_pids=False)
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        first = evaluate(sensor, instance, project)
        second = evaluate(sensor, instance, project)
    assert first.skip_message == "2 running shard run(s): 1 newly stalled, 0 with their process gone"
    assert second.skip_message == "2 running shard run(s): 0 newly stalled, 0 with their process gone"
    assert hook.kinds() == ["shard_stalled"]
    assert hook.received[0]["alert"]["run_id"] == silent.run_id
    assert hook.received[0]["text"].startswith(
        f"[eagle3] shard rows_0-20 (run {silent.run_id}): stalled, no progress for 16.7 min (7/20 samples done)"
    )
    marked = instance.get_run_by_id(silent.run_id)
    assert marked.status == DagsterRunStatus.STARTED  # left running: it may be in a slow load
    assert marked.tags[STALL_TAG] == "stalled"
    assert float(marked.tags[STALL_SINCE_TAG]) == pytest.approx(now - 1000)
    assert STALL_TAG not in instance.get_run_by_id(busy.run_id).tags
    engine = instance.all_logs(silent.run_id, of_type=DagsterEventType.ENGINE_EVENT)
    messages = [e.dagster_event.message for e in engine]
    assert any(m.startswith(f"shard rows_0-20 (run {silent.run_id}): stalled") for m in messages)


def test_stall_sensor_fails_a_run_whose_process_is_gone_and_frees_its_slot(instance, project, monkeypatch):
    now = time.time()
    run = start_shard_run(instance, project, "rows_40-45", now - 60)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # What Dagster's run worker reports when it starts (dagster/_cli/api.py).
        instance.report_engine_event(
            f"Started process for run (pid: {worker.pid}).", run, EngineEventData.in_process(worker.pid)
        )
        record_progress(instance, run, now - 30, 2, 5)
        instance.event_log_storage.claim_concurrency_slot("gpu", run.run_id, "hidden_states")
        assert run.run_id in instance.event_log_storage.get_concurrency_run_ids()
        sensor = build_shard_stall_sensor(check_pids=True)
        with WebhookServer() as hook:
            monkeypatch.setenv(WEBHOOK_ENV, hook.url)
            alive = evaluate(sensor, instance, project)
            worker.kill()
            worker.wait()
            gone = evaluate(sensor, instance, project)
    finally:
        worker.kill()
        worker.wait()
    assert alive.skip_message == "1 running shard run(s): 0 newly stalled, 0 with their process gone"
    assert gone.skip_message == "1 running shard run(s): 0 newly stalled, 1 with their process gone"
    assert hook.kinds() == ["shard_process_gone"]
    assert hook.received[0]["alert"]["pid"] == worker.pid
    failed = instance.get_run_by_id(run.run_id)
    assert failed.status == DagsterRunStatus.FAILURE
    assert failed.tags[STALL_TAG] == "process_gone"
    assert run.run_id not in instance.event_log_storage.get_concurrency_run_ids()
    failure = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)[-1]
    assert failure.dagster_event.message.startswith(
        f"shard rows_40-45 (run {run.run_id}): its process (pid {worker.pid}) is gone"
    )
    # A failed run is no longer watched.
    assert evaluate(sensor, instance, project).skip_message == (
        "0 running shard run(s): 0 newly stalled, 0 with their process gone"
    )


def test_dead_runs_sensor_fails_any_run_whose_recorded_process_is_gone_and_frees_slots_of_finished_runs(
    instance, project, monkeypatch
):
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # A `drafter` run (not a shard) started from the CLI: the executor recorded its process.
        # A run force-terminated while it held the slot: CANCELED, the slot still claimed.
        canceled = instance.create_run_for_job(job, asset_selection={AssetKey("responses")})
        instance.event_log_storage.claim_concurrency_slot("gpu", canceled.run_id, "responses")
        instance.report_run_canceled(canceled)
        dead = instance.create_run_for_job(job, asset_selection={AssetKey("drafter")})
        instance.add_run_tags(dead.run_id, process_tags(dead.run_id, worker.pid))
        instance.handle_new_event(_entry(dead, DagsterEventType.RUN_START, time.time() - 60))
        instance.event_log_storage.claim_concurrency_slot("gpu", dead.run_id, "drafter")  # waits for the slot
        with WebhookServer() as hook:
            monkeypatch.setenv(WEBHOOK_ENV, hook.url)
            assert evaluate(dead_runs_sensor, instance, project).skip_message == (
                "1 run(s) failed or slot(s) freed"
            )
            worker.kill()
            worker.wait()
            result = evaluate(dead_runs_sensor, instance, project)
            again = evaluate(dead_runs_sensor, instance, project)
    finally:
        worker.kill()
        worker.wait()
    assert result.skip_message == "1 run(s) failed or slot(s) freed"
    assert again.skip_message == "every live run has its process"
    assert hook.kinds() == ["run_process_gone", "run_process_gone"]
    assert hook.received[0]["text"] == f"[eagle3] run {canceled.run_id} is canceled but still held (or waited for) a gpu slot; freed"
    assert hook.received[1]["text"].startswith(
        f"[eagle3] run {dead.run_id} (__ASSET_JOB): its process (pid {worker.pid}) is gone; marked failed"
    )
    failed = instance.get_run_by_id(dead.run_id)
    assert failed.status == DagsterRunStatus.FAILURE and failed.tags[STALL_TAG] == "process_gone"
    assert failed.tags[PID_TAG] == str(worker.pid)
    assert instance.event_log_storage.get_concurrency_run_ids() == set()


def test_stall_sensor_watches_only_shard_runs(instance, project):
    now = time.time()
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    other = instance.create_run_for_job(job, asset_selection={AssetKey("vocab_map")})
    instance.handle_new_event(_entry(other, DagsterEventType.RUN_START, now - 100000))
    result = evaluate(build_shard_stall_sensor(check_pids=True), instance, project)
    assert result.skip_message == "0 running shard run(s): 0 newly stalled, 0 with their process gone"


def _failed_prompts_run(instance: DagsterInstance, project: Project, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": ""}\n')
    broken = Project(project.settings.model_copy(update={"prompts": str(bad)}), project.store)
    job = build_definitions(broken).resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=instance, asset_selection=[AssetKey("prompts")], raise_on_error=False)
    assert not result.success
    return result, bad


def test_run_failure_sensor_posts_the_run_and_its_error(instance, project, tmp_path, monkeypatch):
    result, bad = _failed_prompts_run(instance, project, tmp_path)
    context = build_run_status_sensor_context(
        sensor_name="run_failure_alert",
        dagster_event=result.get_run_failure_event(),
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        resources={"project": project},
    ).for_run_failure()
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        monkeypatch.setenv("EAGLE3_UI_URL", "http://127.0.0.1:3000")
        run_failure_alert_sensor(context)
    assert hook.kinds() == ["run_failed"]
    assert hook.received[0]["alert"] == {
        "kind": "run_failed",
        "run_id": result.run_id,
        "job": "__ASSET_JOB",
        "partition": None,
    }
    text = hook.received[0]["text"]
    assert text.startswith(f"[eagle3] run {result.run_id} of __ASSET_JOB failed: prompts: ")
    assert f"{bad}:2 (id b): empty prompt" in text
    assert text.endswith(f"\nhttp://127.0.0.1:3000/runs/{result.run_id}")


def test_run_failure_sensor_leaves_runs_the_stall_sensor_failed(instance, project, tmp_path, monkeypatch):
    result, _ = _failed_prompts_run(instance, project, tmp_path)
    instance.add_run_tags(result.run_id, {STALL_TAG: "process_gone", ALERTED_TAG: "shard_stall"})
    context = build_run_status_sensor_context(
        sensor_name="run_failure_alert",
        dagster_event=result.get_run_failure_event(),
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(result.run_id),
        resources={"project": project},
    ).for_run_failure()
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        run_failure_alert_sensor(context)
    assert hook.received == []


def alert_texts(instance: DagsterInstance, project: Project, run_id: str, failure: DagsterEvent, monkeypatch) -> list[str]:
    """What `run_failure_alert` posts for the run's failure event (no UI link)."""
    context = build_run_status_sensor_context(
        sensor_name="run_failure_alert",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(run_id),
        resources={"project": project},
    ).for_run_failure()
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        monkeypatch.delenv("EAGLE3_UI_URL", raising=False)
        run_failure_alert_sensor(context)
    return [p["text"] for p in hook.received]


def test_a_run_failed_from_outside_is_alerted_with_what_killed_it(instance, project, monkeypatch):
    run = start_shard_run(instance, project, "rows_0-20", time.time() - 30)
    killed = f"[DagsterApiServer] Run execution process for {run.run_id} was terminated by signal 9 (SIGKILL)."
    instance.report_engine_event(killed, run)
    failure = instance.report_run_failed(run)  # what the code server does when its child dies
    assert alert_texts(instance, project, run.run_id, failure, monkeypatch) == [
        f"[eagle3] run {run.run_id} of __ASSET_JOB [rows_0-20] failed: "
        f"This run has been marked as failed from outside the execution context. {killed}"
    ]


def dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_retried_or_reexecuted_run_is_not_failed_for_its_parents_dead_process(instance, project):
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    parent = instance.create_run_for_job(job, asset_selection={AssetKey("drafter")})
    instance.add_run_tags(parent.run_id, process_tags(parent.run_id, dead_pid()))
    instance.report_run_failed(instance.get_run_by_id(parent.run_id), "killed")
    parent = instance.get_run_by_id(parent.run_id)
    # A retry or a re-execution starts with a copy of its parent's tags (`use_parent_run_tags`),
    # the parent's dead pid among them, until its own process records itself.
    child = instance.create_run_for_job(
        job, asset_selection={AssetKey("drafter")}, tags=parent.tags,
        parent_run_id=parent.run_id, root_run_id=parent.run_id,
    )  # fmt: skip
    instance.handle_new_event(_entry(child, DagsterEventType.RUN_START, time.time()))
    assert instance.get_run_by_id(child.run_id).tags[PID_TAG] == parent.tags[PID_TAG]
    assert sweep_dead_runs(instance) == []
    assert evaluate(build_shard_stall_sensor(check_pids=True), instance, project).skip_message.startswith("0 running")
    assert instance.get_run_by_id(child.run_id).status == DagsterRunStatus.STARTED
    record_run_process(instance, child.run_id)
    assert sweep_dead_runs(instance) == []
    assert instance.get_run_by_id(child.run_id).tags[PID_TAG] == str(os.getpid())


def test_a_run_the_run_start_sweep_failed_is_alerted_by_run_failure_alert(instance, project, monkeypatch):
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    dead = instance.create_run_for_job(job, asset_selection={AssetKey("drafter")})
    pid = dead_pid()
    instance.add_run_tags(dead.run_id, process_tags(dead.run_id, pid))
    instance.handle_new_event(_entry(dead, DagsterEventType.RUN_START, time.time() - 60))
    (line,) = sweep_dead_runs(instance)  # what a starting run's executor does: it sends no alert itself
    failure = instance.all_logs(dead.run_id, of_type=DagsterEventType.RUN_FAILURE)[-1].dagster_event
    assert alert_texts(instance, project, dead.run_id, failure, monkeypatch) == [
        f"[eagle3] run {dead.run_id} of __ASSET_JOB failed: {line}"
    ]


def test_run_failure_alert_sees_runs_launched_outside_the_code_location(instance, project, tmp_path, monkeypatch):
    """The daemon evaluates the sensor for the workspace's location; `dagster asset materialize` (and
    `execute_in_process`, as here) records runs that belong to no location of the workspace."""

    def tick(cursor: str | None) -> SensorEvaluationContext:
        context = SensorEvaluationContext(
            instance_ref=None, instance=instance, cursor=cursor, repository_name="__repository__",
            code_location_origin=RegisteredCodeLocationOrigin("eagle3_assets"), sensor_name="run_failure_alert",
            resources=wrap_resources_for_execution({"project": project}),
        )  # fmt: skip
        list(run_failure_alert_sensor.evaluate_tick(context).skip_message or [])
        return context

    first = tick(None)  # the first tick only places the cursor
    result, bad = _failed_prompts_run(instance, project, tmp_path)
    assert result.dagster_run.remote_job_origin is None
    with WebhookServer() as hook:
        monkeypatch.setenv(WEBHOOK_ENV, hook.url)
        tick(first.cursor)
    assert [p["alert"]["run_id"] for p in hook.received] == [result.run_id]
    assert f"{bad}:2 (id b): empty prompt" in hook.received[0]["text"]


_RUN_RETRIES_PROJECT: list[Project] = []  # the project `_retries_job` builds from, set by the test


def _retries_job():
    from dagster import Definitions, define_asset_job

    job = define_asset_job("prompts_only", selection="prompts")  # an implicit job cannot be reconstructed
    return Definitions.merge(build_definitions(_RUN_RETRIES_PROJECT[0]), Definitions(jobs=[job])).resolve_job_def(
        "prompts_only"
    )


def test_the_instance_does_not_relaunch_a_refusal_but_a_crash(project, tmp_path):
    """Through the job's own executor (in process), as `dagster asset materialize` runs it: a refused
    step tags its run `dagster/max_retries: 0`, so `run_retries` leaves it; a run whose process is gone
    keeps its one relaunch."""
    from dagster import execute_job, reconstructable

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": ""}\n')
    _RUN_RETRIES_PROJECT[:] = [Project(project.settings.model_copy(update={"prompts": str(bad)}), project.store)]
    retries = {"concurrency": {"pools": {"default_limit": 1}}, "run_retries": {"enabled": True, "max_retries": 1}}
    with instance_for_test(overrides=retries) as instance:
        with execute_job(
            reconstructable(_retries_job), instance,
            run_config={"execution": {"config": {"in_process": {}}}},
        ) as result:  # fmt: skip
            assert not result.success
        refused = instance.get_run_by_id(result.run_id)
        assert (refused.tags["dagster/max_retries"], refused.tags["dagster/will_retry"]) == ("0", "false")

        crashed = instance.create_run_for_job(_retries_job())
        instance.add_run_tags(crashed.run_id, process_tags(crashed.run_id, dead_pid()))
        instance.handle_new_event(_entry(crashed, DagsterEventType.RUN_START, time.time()))
        assert len(sweep_dead_runs(instance)) == 1
        assert instance.get_run_by_id(crashed.run_id).tags["dagster/will_retry"] == "true"
