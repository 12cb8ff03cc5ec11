"""The torchrun job that trains the drafter: how many ranks, its command line, and what a failed job says.

The `drafter` asset starts `python -m torch.distributed.run … -m eagle3_assets.drafter` (torchrun
owns the process group, the rendezvous and the teardown: a rank that dies makes its agent stop
every other rank). Each rank's output lands in `<log_dir>/…/attempt_0/<local_rank>/`; when the job
fails, torchrun names the first rank to fail and its exit code, and that rank's log says why.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_assets.drafter.checkpoint import CHECKPOINTS_DIR, latest_checkpoint, read_checkpoint_state
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.training_settings import LaunchSettings
from eagle3_assets.storage import ArtifactStore

# A rank's exit status when it refused to train (settings, inputs, a checkpoint of another run):
# the same refusal would meet a retry, so the asset fails without one.
EXIT_REFUSED = 3


class LaunchRefused(TrainingError):
    """The job cannot start as configured; no rank was started."""

    retryable = False


class RankFailed(TrainingError):
    """A rank of the training job failed (killed, out of memory, an error); the message names it."""


class RankRefused(RankFailed):
    """A rank refused to train (it exited EXIT_REFUSED); a retry would meet the same refusal."""

    retryable = False


def ranks_per_node(launch: LaunchSettings, device: str, *, visible_gpus: int | None = None) -> int:
    """`training.launch.nproc_per_node` resolved on this node; refuses what cannot run here."""
    gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"this node shows {gpus} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    if device == "cuda" and gpus == 0:
        raise LaunchRefused(f"training.device is 'cuda' but {where}; run on a GPU node or set training.device: cpu")
    on_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if launch.nproc_per_node == "auto":
        return gpus if on_gpu else 1
    nproc = launch.nproc_per_node
    if on_gpu and nproc > gpus:
        raise LaunchRefused(
            f"training.launch.nproc_per_node: {nproc} ranks, one per GPU, but {where}; set it to {gpus} or 'auto'"
        )
    if not on_gpu and device == "auto" and nproc > 1:
        # Ranks asked for GPUs that are not there: training them on the CPU is hours slower, never meant.
        raise LaunchRefused(
            f"training.launch.nproc_per_node: {nproc} ranks with training.device 'auto', but {where}: they would "
            f"all train on the CPU. Run on a node with {nproc} GPUs, or set training.device: cpu to train {nproc} "
            "CPU ranks on purpose"
        )
    cpus = os.cpu_count() or 1
    if not on_gpu and nproc > cpus:
        raise LaunchRefused(
            f"training.launch.nproc_per_node: {nproc} CPU ranks, but this node has {cpus} CPU(s); set it to {cpus} "
            "or fewer"
        )
    return nproc


def refuse_another_world_size(store: ArtifactStore, world_size: int) -> None:
    """Refuse to resume a checkpoint another number of ranks wrote: the data plan skips the batches
    with fewer samples than ranks, so the step a checkpoint names is another batch on another count."""
    rel = latest_checkpoint(store)
    if rel is None:
        return
    saved = read_checkpoint_state(store, rel).world_size
    if saved != world_size:
        raise LaunchRefused(
            f"{store.url_of(rel)} was written by {saved} rank(s) and this job would run {world_size}: resume it on "
            f"{saved} (training.launch.nnodes x nproc_per_node = {saved}), or remove "
            f"{store.url_of(CHECKPOINTS_DIR)} to start over on {world_size}"
        )


def torchrun_command(launch: LaunchSettings, nproc: int, log_dir: Path, args: Sequence[str] = ()) -> list[str]:
    """The command every node runs; on one node torchrun meets itself (`--standalone`)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
        f"--log-dir={log_dir}", "--tee=3",
    ]  # fmt: skip
    if launch.nnodes == 1:
        cmd.append("--standalone")
    else:
        # A connection to the rendezvous that takes longer than the join is a failure anyway: torchrun's own 60 s
        # read timeout would outlast a short join timeout.
        join = f"join_timeout={launch.join_timeout_s:g},read_timeout={min(60.0, launch.join_timeout_s):g}"
        cmd += [
            f"--nnodes={launch.nnodes}", f"--rdzv-backend={launch.rdzv_backend}",
            f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={launch.rdzv_id}", f"--rdzv-conf={join}",
        ]  # fmt: skip
    return [*cmd, "-m", "eagle3_assets.drafter", *args]


@dataclass(frozen=True)
class FailedRank:
    rank: int
    local_rank: int
    host: str
    exitcode: int


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?host\s*:\s*(?P<host>\S+)\s*"
    r"rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)\s*exitcode\s*:\s*(?P<code>-?\d+)",
    re.S,
)


def failed_rank(torchrun_output: str) -> FailedRank | None:
    """The first rank to fail, from torchrun's closing report (None when it printed none)."""
    m = _ROOT_CAUSE.search(torchrun_output)
    if m is None:
        return None
    return FailedRank(int(m["rank"]), int(m["local"]), m["host"], int(m["code"]))


def last_log_line(log_dir: Path, local_rank: int) -> str:
    """The last line a local rank wrote (its error, when it raised one), from torchrun's per-rank logs."""
    lines: list[tuple[float, bool, str]] = []
    for name in ("stderr.log", "stdout.log"):
        for path in log_dir.glob(f"*/attempt_*/{local_rank}/{name}"):
            text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
            if text:  # the newer file's last line; on a tie stderr's, where an error goes
                lines.append((path.stat().st_mtime, name == "stderr.log", text[-1].strip()))
    return max(lines)[2] if lines else "(it wrote nothing)"


class RendezvousFailed(TrainingError):
    """The nodes did not meet: the rendezvous endpoint cannot be reached, or a node never arrived; the message names
    the endpoint and the settings. Retried: a node still being scheduled may arrive on the next run."""


def rendezvous_failure(torchrun_output: str, launch: LaunchSettings) -> RendezvousFailed | None:
    """What a job whose nodes never met (torchrun's rendezvous errors) says, naming the endpoint and the settings;
    None when the output shows no rendezvous error."""
    where = f"training.launch.rdzv_endpoint {launch.rdzv_endpoint}"
    if "RendezvousTimeoutError" in torchrun_output:
        return RendezvousFailed(
            f"the training job's nodes did not all meet at {where} within training.launch.join_timeout_s "
            f"({launch.join_timeout_s:g} s): of training.launch.nnodes={launch.nnodes}, at least one never arrived. "
            f"Every node must run the same torchrun command (rdzv_id {launch.rdzv_id!r}) and reach {launch.rdzv_endpoint}"
        )
    if "RendezvousConnectionError" in torchrun_output or "DistNetworkError" in torchrun_output:
        cause = [ln for ln in torchrun_output.splitlines() if "DistNetworkError" in ln or "timed out" in ln][-1:]
        return RendezvousFailed(
            f"the training job cannot reach its rendezvous at {where}"
            + (f" ({cause[0].split(': ', 1)[-1].strip()})" if cause else "")
            + ": check the host and port (the node, or on Kubernetes the Service, that hosts the rendezvous) and "
            "that this node reaches it"
        )
    return None


def describe_failure(
    torchrun_output: str, returncode: int, log_dir: Path, launch: LaunchSettings | None = None
) -> TrainingError:
    """The error a failed job ends with: which rank, how it ended, and its last log line; or, for a job of several
    nodes (`launch`) that never met, the endpoint they were to meet at."""
    rank = failed_rank(torchrun_output)
    if rank is None and launch is not None and launch.nnodes > 1 and (met := rendezvous_failure(torchrun_output, launch)):
        return met
    if rank is None:
        tail = [ln for ln in torchrun_output.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return RankFailed(f"the training job (torchrun) exited {returncode}: {tail[0]}")
    if rank.exitcode < 0:
        how = f"was killed by {signal.Signals(-rank.exitcode).name}"
    else:
        how = f"exited {rank.exitcode}"
    line = last_log_line(log_dir, rank.local_rank)
    kind = RankRefused if rank.exitcode == EXIT_REFUSED else RankFailed
    return kind(
        f"training rank {rank.rank} (local rank {rank.local_rank} on {rank.host}) {how}; its last log line: {line}. "
        f"Every rank's log: {log_dir}"
    )
