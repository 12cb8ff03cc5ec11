"""Where training runs: one process on CPU or a GPU, or one rank of a torchrun data-parallel job.

torchrun describes the job in WORLD_SIZE / RANK / LOCAL_RANK; without them this is rank 0 of 1.
"""

from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3_assets.drafter.errors import TrainingError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(setting: str, env: DistEnv) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise TrainingError("training.device is 'cuda' but no CUDA device is visible")
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(env: DistEnv, device: torch.device, *, timeout_s: float = 600.0) -> bool:
    """Join the process group torchrun describes; True when this call created it (and so must destroy it).

    A collective that waits longer than `timeout_s` raises on every rank still alive, so a rank lost
    where torchrun cannot see it (another node) still ends the job in bounded time."""
    if env.world_size <= 1 or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return True


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over ranks (itself outside a process group), on the CPU; `t` is left as it is (a copy is reduced:
    `.to` the device it is on already would hand back `t` itself, and gloo would sum into the caller's tensor)."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    packed = t.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
    dist.all_reduce(packed)
    return packed.cpu()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather_ints(values: list[int]) -> list[int]:
    """Every rank's `values`, concatenated in rank order (`values` itself outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    count = torch.tensor([len(values)], device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    width = int(max(c.item() for c in counts))
    mine = torch.zeros(width, dtype=torch.int64, device=device)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    rows = [torch.zeros_like(mine) for _ in counts]
    dist.all_gather(rows, mine)
    return [int(v) for r, c in zip(rows, counts, strict=True) for v in r[: int(c.item())].tolist()]
