"""Training figures: per-step counts summed over batches and ranks, reported as loss / loss_k / acc_k and the
acceptance length they estimate (`acceptance.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle3_assets.drafter.acceptance import acceptance_estimates
from eagle3_assets.drafter.distributed import all_reduce_sum
from eagle3_assets.drafter.ttt import TTTOutput

# float64 [K]: the K positions' mean losses' coefficients, from the positions each is over (`Family.loss_weights`).
LossWeights = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepCounts:
    """Sums over ranks and batches, from which loss/acc_k are reported."""

    # Losses are weighted by the positions they average over, so a step's figures are the same
    # however its batch is split between ranks, and an evaluation's are a mean over all positions.
    loss_sum: torch.Tensor  # [K] sum over batches of step loss x positions averaged
    positions: torch.Tensor  # [K] positions averaged
    correct: torch.Tensor  # [K]
    kept: torch.Tensor  # [K]
    runs: torch.Tensor  # [K+1] chain run-length histogram

    @classmethod
    def zeros(cls, k: int) -> StepCounts:
        zeros = torch.zeros(k, dtype=torch.int64)
        return cls(
            torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64), zeros, zeros.clone(),
            torch.zeros(k + 1, dtype=torch.int64),
        )  # fmt: skip

    def add(self, out: TTTOutput) -> None:
        n = out.averaged_over.double().cpu()
        self.loss_sum += out.step_losses.detach().double().cpu() * n
        self.positions += n
        self.correct += out.correct.cpu()
        self.kept += out.kept.cpu()
        self.runs += out.runs.cpu()

    def all_reduce(self) -> StepCounts:
        k = len(self.kept)
        packed = all_reduce_sum(
            torch.cat([self.loss_sum, self.positions, self.correct.double(), self.kept.double(), self.runs.double()])
        )
        loss_sum, positions, correct, kept, runs = packed.split([k, k, k, k, k + 1])
        return StepCounts(loss_sum, positions, correct.long(), kept.long(), runs.long())

    def metrics(self, loss_weights: LossWeights | float, prefix: str = "") -> dict[str, float]:
        """loss, loss_k, acc_k and the acceptance estimates; the loss combines the loss_k by the family's
        `loss_weights` of the positions counted (a float w: w**k, EAGLE-3's step weights)."""
        losses = self.loss_sum / self.positions.clamp(min=1)
        if callable(loss_weights):
            w = loss_weights(self.positions)
            m = {f"{prefix}loss": float(sum(w[k] * losses[k] for k in range(len(losses))))}
        else:
            m = {f"{prefix}loss": float(sum(loss_weights**k * losses[k] for k in range(len(losses))))}
        for k in range(len(losses)):
            m[f"{prefix}loss_{k}"] = float(losses[k])
            m[f"{prefix}acc_{k}"] = float(self.correct[k]) / max(int(self.kept[k]), 1)
        return m | acceptance_estimates(self.runs, prefix)


def heldout_line(heldout: dict[str, float], ttt_steps: int) -> str:
    """loss, acc_k and the acceptance estimate, as the progress lines print them."""
    accs = " ".join(f"{heldout[f'acc_{k}']:.3f}" for k in range(ttt_steps))
    return (
        f"loss {heldout['loss']:.4f} acc_k {accs} accept_len k=3 {heldout['accept_len_k3']:.3f} "
        f"k=7 {heldout['accept_len_k7']:.3f}"
    )
