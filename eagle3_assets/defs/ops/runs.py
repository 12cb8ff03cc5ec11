"""Runs whose process is gone, and the pool slots they still hold.

A run killed with SIGKILL (an OOM kill, a node reboot, `kill -9` of a CLI
materialization) never reports its end, so it stays STARTED and keeps its `gpu` pool
slot: every later GPU run would wait for it forever. Every run of this code location
records which process orchestrates it (run tags: pid, its start time, the machine and
boot it runs on; `record_run_process`), and `sweep_dead_runs` fails each run whose
process is gone and frees its slots, and frees slots still held by runs that already
finished (a force-terminated run). It runs when any run starts (`executor.py`), in the
`dead_runs` sensor every minute under the daemon, and at the start of `make demo`.

The tags also name the run they were recorded for: a retry or a re-execution is created
with a copy of its parent's tags, the parent's (dead) pid among them, and must not be
judged by it before it records its own process.

A pid means something only on the machine that recorded it: runs of other machines are
left to their own machine's sweep (or to run monitoring, on Kubernetes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

from eagle3_assets.families import FAMILIES
from eagle3_assets.processes import machine_id, process_alive, process_started_at

# The run tag Dagster's run retries read (documented under "Run retries"; its constant is not public).
MAX_RETRIES_TAG = "dagster/max_retries"
PID_TAG = "eagle3/pid"
STALL_TAG = "eagle3/stall"  # "stalled" or "process_gone": the alert for it was sent
PID_STARTED_TAG = "eagle3/pid_started"  # epoch seconds: tells a reused pid from the recorded process
PID_RUN_TAG = "eagle3/pid_run"  # the run whose process the pid is: a copy on a retried run names its parent
ALERTED_TAG = "eagle3/alerted_by"  # the sensor that alerted on this run's death: `run_failure_alert` need not
MACHINE_TAG = "eagle3/machine"
GPU_POOL = "gpu"
LIVE = (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING)


# Every family's rolling trainer pool (`FamilySpec.trainer_pool`: `trainer` for EAGLE-3, as before there were
# families, `trainer_<family>` for the others). One per family, each of the instance's default limit (1): the families
# train from one window at once (a shard is released once all of them consumed it), so two trainers in one pool of one
# slot would wait on each other until `training.shard_wait_s` ran out.
TRAINER_POOLS = tuple(f.trainer_pool for f in FAMILIES.values())


def process_tags(run_id: str, pid: int | None = None) -> dict[str, str]:
    """The tags that name the process orchestrating run `run_id` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    started = process_started_at(pid)
    return {PID_TAG: str(pid), PID_STARTED_TAG: f"{started or 0:.0f}", MACHINE_TAG: machine_id(), PID_RUN_TAG: run_id}


def record_run_process(instance: DagsterInstance, run_id: str) -> None:
    instance.add_run_tags(run_id, process_tags(run_id))


def process_gone(run: DagsterRun) -> bool | None:
    """True when the run's recorded process is gone; None when it cannot be told here (no tags, tags
    copied from the run it retries, other machine)."""
    tags = run.tags
    if PID_TAG not in tags or tags.get(PID_RUN_TAG) != run.run_id or tags.get(MACHINE_TAG) != machine_id():
        return None
    started = float(tags.get(PID_STARTED_TAG) or 0) or None
    return not process_alive(int(tags[PID_TAG]), started_by=started)


@dataclass(frozen=True)
class Holder:
    """A run holding (or waiting for) slots of a pool."""

    run_id: str
    step_key: str
    status: str
    what: str  # job and partition
    pid: str | None
    alive: bool | None

    def describe(self) -> str:
        proc = "" if self.pid is None else f", pid {self.pid} " + ("alive" if self.alive else "gone" if self.alive is False else "elsewhere")
        return f"run {self.run_id} ({self.what}, step {self.step_key}, {self.status.lower()}{proc})"


def _what(run: DagsterRun) -> str:
    partition = run.tags.get("dagster/partition")
    return run.job_name + (f" [{partition}]" if partition else "")


def pool_holders(instance: DagsterInstance, pool: str = GPU_POOL) -> list[Holder]:
    """Who holds the pool's slots now."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    out = []
    for slot in info.claimed_slots:
        run = instance.get_run_by_id(slot.run_id)
        if run is None:
            out.append(Holder(slot.run_id, slot.step_key, "DELETED", "?", None, False))
            continue
        gone = process_gone(run)
        out.append(Holder(run.run_id, slot.step_key, run.status.value, _what(run), run.tags.get(PID_TAG), None if gone is None else not gone))
    return out


def pool_limit(instance: DagsterInstance, pool: str = GPU_POOL) -> int | None:
    """The pool's slot count (the instance default for a pool not yet used); None: unlimited."""
    return instance.event_log_storage.get_concurrency_info(pool).limit


def sweep_dead_runs(
    instance: DagsterInstance, *, pools: tuple[str, ...] = (GPU_POOL, *TRAINER_POOLS), alerted_by: str | None = None
) -> list[str]:
    """Fail every live-looking run of this machine whose process is gone and free its slots; free slots
    of finished runs. Returns one line per run it acted on. `alerted_by`: the sensor that alerts on
    these lines itself; without it (the sweep at run start) `run_failure_alert` sends the alert."""
    acted: list[str] = []
    for run in instance.get_runs(RunsFilter(statuses=list(LIVE))):
        if process_gone(run):
            message = (
                f"run {run.run_id} ({_what(run)}): its process (pid {run.tags[PID_TAG]}) is gone; "
                "marked failed and its pool slots freed"
            )
            tags = {STALL_TAG: "process_gone"} | ({ALERTED_TAG: alerted_by} if alerted_by else {})
            instance.add_run_tags(run.run_id, tags)
            instance.report_run_failed(run, message)
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            acted.append(message)
    for pool in pools:
        info = instance.event_log_storage.get_concurrency_info(pool)
        for run_id in {s.run_id for s in info.claimed_slots} | {s.run_id for s in info.pending_steps}:
            run = instance.get_run_by_id(run_id)
            if run is None or run.is_finished:
                state = "was deleted" if run is None else f"is {run.status.value.lower()}"
                instance.event_log_storage.free_concurrency_slots_for_run(run_id)
                acted.append(f"run {run_id} {state} but still held (or waited for) a {pool} slot; freed")
    return acted
