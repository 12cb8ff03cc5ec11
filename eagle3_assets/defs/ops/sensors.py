"""`dead_runs`: runs of any job whose process is gone, and pool slots held by finished runs.
`shard_stall`: running shard runs that stopped reporting progress, or whose process is gone.
`run_failure_alert`: every failed run of the instance, launched from the UI, the CLI or
automation. All log and, when a webhook is configured, post.

A stalled run is marked (run tags and an event in its log, both visible in the UI) and
left running: it may be in a slow model load. A run whose process is gone is marked
failed and its `gpu` slot freed (`runs.sweep_dead_runs`), so the `shard_backfill`
sensor retries a shard (which resumes at sample level) and no later GPU run waits on it.
"""

from __future__ import annotations

import os
import time

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultRunLauncher,
    DefaultSensorStatus,
    ResourceParam,
    RunFailureSensorContext,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    run_failure_sensor,
    sensor,
)

from eagle3_assets.alerts import (
    Alert,
    RunProgress,
    Stall,
    find_stalls,
    post_alert,
    run_failure_alert,
    stall_alert,
)
from eagle3_assets.defs.ops.runs import ALERTED_TAG, PID_TAG, STALL_TAG, process_gone, sweep_dead_runs
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.processes import process_alive
from eagle3_assets.project import Project

STALL_SINCE_TAG = "eagle3/stall_silent_since"  # the `silent_since` (epoch s) already alerted
UI_URL_ENV = "EAGLE3_UI_URL"  # optional: base URL of the UI, for links in alerts
PARTITION_TAG = "dagster/partition"
RUN_WORKER_STARTED = "Started process for run"  # Dagster's engine event, carries the worker's pid
FAILED_FROM_OUTSIDE = "This run has been marked as failed from outside the execution context."
# A worker reports its pid while the run is still STARTING (loading code): it can die there too.
WATCHED = (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED)


def pids_are_local(instance: DagsterInstance) -> bool:
    """Run workers are processes on this machine: the default launcher on a SQLite (one-machine) instance.

    With PostgreSQL, runs may be launched from another machine, where a pid means nothing
    here; a k8s launcher has its own health check (run monitoring). Stalls are still seen.
    """
    from dagster._core.storage.runs import SqliteRunStorage  # which storage an instance has: no public type to ask

    return isinstance(instance.run_launcher, DefaultRunLauncher) and isinstance(instance.run_storage, SqliteRunStorage)


def run_worker_pid(instance: DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """The pid of the run's worker process and when it reported itself (the latest, if resumed)."""
    found = None
    records = instance.event_log_storage.get_records_for_run(run_id, of_type=DagsterEventType.ENGINE_EVENT).records
    for record in records:
        entry = record.event_log_entry
        event = entry.dagster_event
        if event is None or not (event.message or "").startswith(RUN_WORKER_STARTED):
            continue
        data = event.engine_event_data
        pid = data.metadata.get("pid") if data is not None else None
        if pid is not None:
            try:
                found = (int(pid.value), entry.timestamp)
            except (TypeError, ValueError):
                continue
    return found


def _latest_progress(instance: DagsterInstance, run_id: str) -> tuple[float, dict] | None:
    records = instance.event_log_storage.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_OBSERVATION, ascending=False, limit=1
    ).records
    if not records:
        return None
    entry = records[0].event_log_entry
    observation = entry.dagster_event.asset_observation_data.asset_observation
    return entry.timestamp, {k: v.value for k, v in observation.metadata.items()}


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def running_shard_runs(instance: DagsterInstance, check_pids: bool) -> list[tuple[DagsterRun, RunProgress]]:
    """Every starting or started run that materializes `hidden_states`, with its progress and liveness."""
    out = []
    for record in instance.get_run_records(RunsFilter(statuses=list(WATCHED))):
        run = record.dagster_run
        if run.asset_selection is None or HIDDEN_STATES not in run.asset_selection:
            continue
        progress = _latest_progress(instance, run.run_id)
        figures = progress[1] if progress else {}
        pid, alive = None, None
        gone = process_gone(run)  # the process our executor recorded, when it is on this machine
        if gone is not None:
            pid, alive = int(run.tags[PID_TAG]), not gone
        elif check_pids and (worker := run_worker_pid(instance, run.run_id)) is not None:
            pid = worker[0]
            alive = process_alive(pid, started_by=worker[1])
        alerted = run.tags.get(STALL_SINCE_TAG)
        out.append(
            (
                run,
                RunProgress(
                    run_id=run.run_id,
                    partition=run.tags.get(PARTITION_TAG),
                    started_at=record.start_time or record.create_timestamp.timestamp(),
                    last_progress_at=progress[0] if progress else None,
                    samples_done=_int_or_none(figures.get("samples_done")),
                    samples_total=_int_or_none(figures.get("samples_total")),
                    pid=pid,
                    process_alive=alive,
                    alerted_silent_since=float(alerted) if alerted else None,
                ),
            )
        )
    return out


def _send(context, project: Project, alert: Alert) -> None:
    result = post_alert(alert, project.settings.alerts)
    context.log.info(f"alert {alert.kind}: {result.detail}")


def _handle(context: SensorEvaluationContext, project: Project, run: DagsterRun, stall: Stall) -> bool:
    """Mark the run and alert; False when the run finished meanwhile (nothing to do)."""
    instance = context.instance
    message = stall.message()
    if stall.kind == "process_gone":
        # Re-read after the pid check: a worker writes its final status before it exits,
        # so a run still starting or started now really lost its process.
        current = instance.get_run_by_id(run.run_id)
        if current is None or current.status not in WATCHED:
            return False
        instance.add_run_tags(run.run_id, {STALL_TAG: "process_gone", ALERTED_TAG: "shard_stall"})
        instance.report_run_failed(current, message)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        context.log.error(message)
    else:
        instance.add_run_tags(run.run_id, {STALL_TAG: "stalled", STALL_SINCE_TAG: repr(stall.run.silent_since)})
        instance.report_engine_event(message, run)
        context.log.warning(message)
    _send(context, project, stall_alert(stall, os.environ.get(UI_URL_ENV)))
    return True


def build_shard_stall_sensor(
    check_pids: bool | None = None, name: str = "shard_stall", minimum_interval_seconds: int = 60
) -> SensorDefinition:
    """`check_pids`: look for dead run workers by pid; None = when `pids_are_local` says it is safe."""

    @sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            "Alerts on shard runs with no progress for alerts.stall_after_s, and fails runs whose process is gone."
        ),
    )
    def shard_stall(context: SensorEvaluationContext, project: ResourceParam[Project]) -> SkipReason:
        pids = pids_are_local(context.instance) if check_pids is None else check_pids
        runs = running_shard_runs(context.instance, pids)
        by_id = {progress.run_id: run for run, progress in runs}
        stalls = find_stalls([p for _, p in runs], time.time(), project.settings.alerts.stall_after_s)
        handled = [s for s in stalls if _handle(context, project, by_id[s.run.run_id], s)]
        gone = sum(s.kind == "process_gone" for s in handled)
        return SkipReason(
            f"{len(runs)} running shard run(s): {len(handled) - gone} newly stalled, {gone} with their process gone"
        )

    return shard_stall


shard_stall_sensor = build_shard_stall_sensor()


@sensor(
    name="dead_runs",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Fails runs whose process is gone and frees the pool slots they, or finished runs, still hold.",
)
def dead_runs_sensor(context: SensorEvaluationContext, project: ResourceParam[Project]) -> SkipReason:
    acted = sweep_dead_runs(context.instance, alerted_by="dead_runs")
    for line in acted:
        context.log.error(line)
        _send(context, project, Alert("run_process_gone", line))
    return SkipReason(f"{len(acted)} run(s) failed or slot(s) freed" if acted else "every live run has its process")


def _failure_text(context: RunFailureSensorContext) -> str:
    """The error of each failed step; for a run failed from outside (its process was killed),
    Dagster's generic message plus the last engine event, which says what happened."""
    steps = context.get_step_failure_events()
    errors = [
        f"{e.step_key}: {e.step_failure_data.error.message.strip()}"
        for e in steps
        if e.step_failure_data is not None and e.step_failure_data.error is not None
    ]
    if errors:
        return "; ".join(errors)
    message = context.failure_event.message or ""
    if message.startswith(FAILED_FROM_OUTSIDE):
        engine = context.instance.all_logs(context.dagster_run.run_id, of_type=DagsterEventType.ENGINE_EVENT)
        said = [e.dagster_event.message for e in engine if e.dagster_event and e.dagster_event.message]
        said = [m for m in said if not m.startswith(RUN_WORKER_STARTED)]
        if said:
            message = f"{message} {said[-1]}"
    return message


@run_failure_sensor(
    name="run_failure_alert",
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    # Runs of `dagster asset materialize` and `make demo` belong to no code location of the
    # workspace: a sensor watching its own location would never see them.
    monitor_all_code_locations=True,
    description="Logs every failed run with its error, and posts it to the alert webhook when one is configured.",
)
def run_failure_alert_sensor(context: RunFailureSensorContext, project: ResourceParam[Project]) -> None:
    run = context.dagster_run
    if ALERTED_TAG in run.tags:
        return  # `shard_stall` or `dead_runs` failed this run and alerted already
    alert = run_failure_alert(
        run.run_id, run.job_name, run.tags.get(PARTITION_TAG), _failure_text(context), os.environ.get(UI_URL_ENV)
    )
    context.log.error(alert.text)
    _send(context, project, alert)
