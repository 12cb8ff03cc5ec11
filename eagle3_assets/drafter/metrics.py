"""Training figures: per-step counts summed over batches and ranks, reported as loss / loss_k / acc_k."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_assets.drafter.distributed import all_reduce_sum
from eagle3_assets.drafter.ttt import TTTOutput


@dataclass
class StepCounts:
    """Sums over ranks and batches, from which loss/acc_k are reported."""

    loss_sum: torch.Tensor  # [K] sum over batches of step losses
    correct: torch.Tensor  # [K]
    kept: torch.Tensor  # [K]
    batches: int = 0

    @classmethod
    def zeros(cls, k: int) -> StepCounts:
        zeros = torch.zeros(k, dtype=torch.int64)
        return cls(torch.zeros(k, dtype=torch.float64), zeros, zeros.clone())

    def add(self, out: TTTOutput) -> None:
        self.loss_sum += out.step_losses.detach().double().cpu()
        self.correct += out.correct.cpu()
        self.kept += out.kept.cpu()
        self.batches += 1

    def all_reduce(self) -> StepCounts:
        k = len(self.kept)
        packed = torch.cat([self.loss_sum, self.correct.double(), self.kept.double(), torch.tensor([float(self.batches)])])
        packed = all_reduce_sum(packed)
        return StepCounts(packed[:k], packed[k : 2 * k].long(), packed[2 * k : 3 * k].long(), int(packed[-1]))

    def metrics(self, step_weight: float, prefix: str = "") -> dict[str, float]:
        losses = self.loss_sum / max(self.batches, 1)
        m = {f"{prefix}loss": float(sum(step_weight**k * losses[k] for k in range(len(losses))))}
        for k in range(len(losses)):
            m[f"{prefix}loss_{k}"] = float(losses[k])
            m[f"{prefix}acc_{k}"] = float(self.correct[k]) / max(int(self.kept[k]), 1)
        return m
