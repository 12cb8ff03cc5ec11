"""Stop means stop: the first SIGINT or SIGTERM to `python -m eagle3_assets.start` ends the run in flight,
launches no other, and the same command resumes with nothing redone."""

from __future__ import annotations

import os
import signal
import time

import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterRunStatus

from eagle3_assets.processes import group_members
from eagle3_assets.stopping import Stopped, StopSignals

from .helpers import Operator, kill_group, processes_with_env, wait_until_stalled
from .test_start import started

def test_a_stop_signal_is_heard_under_any_handler_and_raises_once():
    """Dagster swaps the handlers while a run executes (it only notes the signal): the wakeup fd still hears it.
    Outside a run the first signal raises; a second, during the first one's cleanup, does not."""
    stop = StopSignals()
    before = signal.getsignal(signal.SIGTERM)
    with stop.installed():
        noted = []
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: noted.append(signum))  # as Dagster's capture
        os.kill(os.getpid(), signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
        assert noted == [signal.SIGINT] and stop.received() == signal.SIGINT
        with pytest.raises(Stopped) as stopped:
            stop.check()
        assert (stopped.value.signal, stopped.value.exit_status) == (signal.SIGINT, 130)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: remembered as the first, not raised again
        time.sleep(0.1)
        assert stop.received() == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_a_run_the_first_signal_raises_where_the_command_waits():
    with StopSignals().installed(), pytest.raises(Stopped) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert stopped.value.exit_status == 143


@pytest.mark.slow  # the tiny data graph and three shards, in subprocesses
def test_the_first_sigint_or_sigterm_ends_the_run_in_flight_and_the_same_command_resumes(tmp_path, tiny_target_dir):
    op = Operator(tmp_path, tiny_target_dir)
    outputs = []
    for sig, key, at in [(signal.SIGINT, "rows_20-40", 3), (signal.SIGTERM, "rows_40-45", 2)]:
        proc = op.spawn("--through", "hidden_states", stall_at=f"extracted:{key}:{at}")
        try:
            out = wait_until_stalled(proc, f"extracted:{key}:{at}")
            os.kill(proc.pid, sig)  # the command alone, as systemd or a kubelet signals it
            stopped_at = time.monotonic()
            out += proc.communicate(timeout=30)[0]
        finally:
            kill_group(proc.pid)
        assert time.monotonic() - stopped_at < 30
        assert proc.returncode == 128 + sig, out[-3000:]
        outputs.append(out)
        assert started(out)[-3:] == [
            f"hidden_states[{key}]: starting", f"hidden_states[{key}]: stopped by {sig.name}",
            f"stopped by {sig.name}: nothing more was launched. Run the same command to resume: "
            "python -m eagle3_assets.start --through hidden_states",
        ]  # fmt: skip
        assert group_members(proc.pid) == []  # Dagster's log tailers too
        with op.instance() as instance:
            (run,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == key]
            assert run.status == DagsterRunStatus.FAILURE
            assert (run.tags["dagster/will_retry"], run.tags["eagle3/stopped_by"]) == ("false", sig.name)
    assert "hidden_states[rows_40-45]: starting" not in outputs[0]  # no further run after the first signal

    resumed = op.start("--through", "hidden_states")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [line for line in started(resumed.stdout) if line.endswith(": starting")] == ["hidden_states[rows_40-45]: starting"]
    with op.instance() as instance:
        records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("hidden_states")), limit=10)
        computed = {
            r.event_log_entry.asset_materialization.partition: r.event_log_entry.asset_materialization.metadata[
                "rows_computed"
            ].value
            for r in records.records
        }
    # The samples written before each stop were kept, not redone.
    assert computed == {"rows_0-20": 20, "rows_20-40": 17, "rows_40-45": 3}


@pytest.mark.slow  # the tiny graph and a rolling trainer, in subprocesses
def test_no_training_process_outlives_a_sigkill_of_everything_above_the_ranks(tmp_path, tiny_target_dir):
    """The start command's group and the trainer's (torchrun with it) SIGKILLed mid-training, as a lost pod
    or an OOM kill of the lot would: the rank, in a session of its own, dies too; the rerun trains every row
    exactly once (the sample ledger)."""
    from collections import Counter

    from eagle3_assets.drafter.checkpoint import latest_checkpoint, read_checkpoint_state
    from eagle3_assets.settings import TrainingSettings

    training = TrainingSettings(
        mode="rolling", window_shards=1, batch_tokens=512, warmup_steps=2, checkpoint_every=2, heldout_rows=4,
        sample_ledger=True,
    )  # fmt: skip
    op = Operator(tmp_path, tiny_target_dir, training=training)
    proc = op.spawn("--through", "drafter", stall_at="rank0:step:3")
    try:
        wait_until_stalled(proc, "step:3")
        ours = processes_with_env("EAGLE3_ROOT", str(op.root))
        groups = {os.getpgid(pid) for pid in ours}
        assert len(groups) >= 3  # this command's, the trainer's (its materialize and torchrun), the rank's own
        # torchrun's command line names the module too: the rank is the process that runs it without torchrun
        ranks = [pid for pid in ours if "eagle3_assets.drafter" in cmdline(pid) and "torch.distributed" not in cmdline(pid)]
        assert len(ranks) == 1, [cmdline(pid) for pid in ours]
        for group in groups - {os.getpgid(ranks[0])}:
            kill_group(group)
        deadline = time.monotonic() + 30  # no grace to wait out: the kernel kills the rank with its parent
        while (left := [cmdline(pid) for pid in processes_with_env("EAGLE3_ROOT", str(op.root))]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == []
    finally:
        kill_group(proc.pid)
        proc.communicate()

    rerun = op.start("--through", "drafter")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    store = op.project.store
    ledger = read_checkpoint_state(store, latest_checkpoint(store)).state["ledger"]
    assert [step for step, _ in ledger] == list(range(1, len(ledger) + 1))
    assert Counter(Counter(row for _, rows in ledger for row in rows).values()) == {1: 45 - 4}  # held-out rows aside


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
