"""The training job's launch: `training.launch` settings, the ranks a node runs, torchrun's command
line, and what a failed job says (a real torchrun job whose rank 1 is SIGKILLed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_assets.drafter.launch import (
    LaunchRefused,
    RankFailed,
    RankRefused,
    RendezvousFailed,
    describe_failure,
    ranks_per_node,
    torchrun_command,
)
from eagle3_assets.processes import process_alive
from eagle3_assets.vllm_server.client import free_port
from eagle3_assets.settings import SettingsError, parse_settings
from eagle3_assets.training_settings import LaunchSettings


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ({"nnodes": 2}, "training.launch: Value error, nnodes: 2 nodes must meet somewhere: set "
         "training.launch.rdzv_endpoint to host:port of a node every node reaches (on Kubernetes, the rendezvous Service)"),
        ({"nproc_per_node": 0}, "training.launch.nproc_per_node: Value error, 0: give 'auto' (one rank per visible GPU) "
         "or a whole number of ranks, 1 or more"),
        ({"nproc_per_node": "all"}, "training.launch.nproc_per_node: Value error, 'all': give 'auto'"),
        ({"nproc_per_node": 100000}, "training.launch.nproc_per_node: Value error, 100000 ranks on one node: no node "
         "runs more than 256 (one per GPU, or a few CPU ranks); give 'auto' (one rank per visible GPU) or the node's "
         "GPU count"),
        ({"nnodes": 2, "rdzv_endpoint": "node0"}, "training.launch.rdzv_endpoint: Value error, 'node0' is not host:port, "
         "e.g. 'eagle3-drafter-0.eagle3-drafter-pods:29400'"),
        ({"collective_timeout_s": 0}, "training.launch.collective_timeout_s: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_launch_settings_that_cannot_work_are_refused_naming_the_field(launch, message):
    with pytest.raises(SettingsError) as e:
        parse_settings({"training": {"launch": launch}})
    assert message in str(e.value)


def test_ranks_per_node_follow_the_visible_gpus_and_refuse_what_the_node_lacks():
    auto, two = LaunchSettings(), LaunchSettings(nproc_per_node=2)
    assert ranks_per_node(auto, "auto", visible_gpus=0) == 1
    assert ranks_per_node(auto, "auto", visible_gpus=8) == 8
    assert ranks_per_node(auto, "cpu", visible_gpus=8) == 1
    assert ranks_per_node(two, "cpu", visible_gpus=0) == 2  # gloo ranks on the CPU
    with pytest.raises(LaunchRefused, match=r"training.device is 'cuda' but this node shows 0 GPU\(s\)"):
        ranks_per_node(auto, "cuda", visible_gpus=0)
    with pytest.raises(LaunchRefused) as e:
        ranks_per_node(LaunchSettings(nproc_per_node=8), "cuda", visible_gpus=4)
    assert "training.launch.nproc_per_node: 8 ranks, one per GPU, but this node shows 4 GPU(s)" in str(e.value)
    assert str(e.value).endswith("set it to 4 or 'auto'")
    assert not e.value.retryable


def test_ranks_meant_for_gpus_are_not_trained_on_the_cpu_and_cpu_ranks_are_bounded_by_its_cores():
    eight, cpus = LaunchSettings(nproc_per_node=8), os.cpu_count() or 1
    with pytest.raises(LaunchRefused) as e:
        ranks_per_node(eight, "auto", visible_gpus=0)
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "this node shows 0 GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    assert str(e.value) == (
        f"training.launch.nproc_per_node: 8 ranks with training.device 'auto', but {where}: they would all train on "
        "the CPU. Run on a node with 8 GPUs, or set training.device: cpu to train 8 CPU ranks on purpose"
    )
    with pytest.raises(LaunchRefused) as e:
        ranks_per_node(LaunchSettings(nproc_per_node=cpus + 1), "cpu", visible_gpus=0)
    assert str(e.value) == (
        f"training.launch.nproc_per_node: {cpus + 1} CPU ranks, but this node has {cpus} CPU(s); set it to {cpus} or fewer"
    )
    assert ranks_per_node(LaunchSettings(nproc_per_node=1), "auto", visible_gpus=0) == 1


def test_the_torchrun_command_of_one_node_and_of_several(tmp_path):
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
            f"--log-dir={tmp_path}", "--tee=3"]  # fmt: skip
    assert torchrun_command(LaunchSettings(), 2, tmp_path) == [*head, "--standalone", "-m", "eagle3_assets.drafter"]
    several = LaunchSettings(nnodes=3, rdzv_endpoint="node0:29400", rdzv_id="run-7")
    assert torchrun_command(several, 2, tmp_path, ["--max-steps", "5"]) == [
        *head, "--nnodes=3", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=run-7",
        "--rdzv-conf=join_timeout=600,read_timeout=60", "-m", "eagle3_assets.drafter", "--max-steps", "5",
    ]  # fmt: skip


KILLED_RANK = textwrap.dedent(
    """
    import os, signal, sys, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    print(f"rank {rank} joined", flush=True)
    if rank == 1:
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("error: a refusal", file=sys.stderr, flush=True)
        sys.exit(3)
    dist.barrier()  # rank 0 waits here for a rank that is gone: torchrun must stop it
    """
)


@pytest.mark.parametrize("how", ["kill", "refuse"])
def test_a_failed_rank_is_named_with_how_it_ended_and_its_last_log_line(tmp_path, how):
    script = tmp_path / "job.py"
    script.write_text(KILLED_RANK)
    cmd = torchrun_command(LaunchSettings(nproc_per_node=2), 2, tmp_path / "logs")
    cmd = [*cmd[: cmd.index("-m", 3)], str(script), how]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    error = describe_failure(proc.stdout + proc.stderr, proc.returncode, tmp_path / "logs")
    if how == "kill":
        assert type(error) is RankFailed and error.retryable
        assert str(error).startswith("training rank 1 (local rank 1 on ")
        assert ") was killed by SIGKILL; its last log line: rank 1 joined. Every rank's log: " in str(error)
    else:
        assert type(error) is RankRefused and not error.retryable
        assert ") exited 3; its last log line: error: a refusal. Every rank's log: " in str(error)
    # rank 0, left in a collective, was stopped by torchrun rather than waiting
    assert "rank      : 0 (local_rank: 0)" in proc.stderr or "NO_OTHER_FAILURES" in proc.stderr


@pytest.mark.parametrize("fault", ["never arrives", "bad endpoint"])
def test_nodes_that_never_meet_are_named_with_the_endpoint_and_the_settings(tmp_path, fault):
    """Issue 44, item 9 (left from issue 33): a node that never arrives, or an endpoint this node cannot reach, ended
    the job with torchrun's bare exception; now it names the endpoint and the settings. One node of two is started
    (the other never comes) with a 3 s join timeout."""
    endpoint = f"127.0.0.1:{free_port()}" if fault == "never arrives" else "no-such-node.invalid:29400"
    launch = LaunchSettings(nproc_per_node=1, nnodes=2, rdzv_endpoint=endpoint, join_timeout_s=3)
    cmd = torchrun_command(launch, 1, tmp_path / "logs")
    cmd = [*cmd[: cmd.index("-m", 3)], "-m", "json.tool", os.devnull]  # never started: the nodes never meet
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    error = describe_failure(proc.stdout + proc.stderr, proc.returncode, tmp_path / "logs", launch)
    assert type(error) is RendezvousFailed and error.retryable
    if fault == "never arrives":
        assert str(error) == (
            f"the training job's nodes did not all meet at training.launch.rdzv_endpoint {endpoint} within "
            "training.launch.join_timeout_s (3 s): of training.launch.nnodes=2, at least one never arrived. Every node "
            f"must run the same torchrun command (rdzv_id 'eagle3-drafter') and reach {endpoint}"
        )
    else:
        assert str(error).startswith(
            "the training job cannot reach its rendezvous at training.launch.rdzv_endpoint no-such-node.invalid:29400 ("
        )
        assert str(error).endswith(
            "): check the host and port (the node, or on Kubernetes the Service, that hosts the rendezvous) and that "
            "this node reaches it"
        )


def test_a_job_that_failed_without_torchrun_s_report_is_described_by_its_last_line(tmp_path):
    error = describe_failure("starting\nrendezvous timed out\n", 1, tmp_path)
    assert str(error) == "the training job (torchrun) exited 1: rendezvous timed out"


ORPHAN = textwrap.dedent(
    """
    import subprocess, sys, time
    from eagle3_assets.processes import terminate_with_parent
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=terminate_with_parent())
    print(job.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_job_does_not_outlive_the_process_that_started_it():
    """The asset's process SIGKILLed (an OOM kill, a lost pod): its training job is stopped, not orphaned."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    job = int(parent.stdout.readline())
    assert process_alive(job)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    # The kernel signals the job as the parent exits; a loaded machine may take a while to run it. This failed
    # once in a full suite run (job alive after 10 s) and never alone: the message says what state it was in.
    deadline = time.monotonic() + 60
    while process_alive(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not process_alive(job), job_status(job)
    finally:
        if process_alive(job):
            os.kill(job, signal.SIGKILL)


def job_status(pid: int) -> str:
    """The lines of /proc/<pid>/status that say why a process did not die of a signal."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return f"no /proc/{pid}/status: {e}"
    keep = ("State", "PPid", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return f"job {pid} still alive: " + "; ".join(line for line in lines if line.startswith(keep))
