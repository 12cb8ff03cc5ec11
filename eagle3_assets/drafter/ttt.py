"""The training-time-test objective: unroll the drafter, score each step against the target.

Alignment (docs/DESIGN.md §5). Index t of a sequence (t = 0..T-1; index t holds token t):
  step k reads token t+1+k and (k = 0) the target features of position t or (k > 0)
  its own step k-1 output at index t; it predicts token t+2+k, whose target
  distribution is the target's output at position t+1+k.
A prediction counts (is "kept") when
  - token t+2+k exists (t+2+k < length of the row),
  - it is trained: with `loss_positions="predicted"` the predicted token t+2+k is a
    generated one (loss_mask[t+2+k] == 1: the first answer token, predicted from the
    prompt's last position, included); with "input" the token read, t+1+k, is
    (speculators' alignment, which never trains the first generated token),
  - the target's top-1 at position t+1+k, over the FULL vocab, is in the draft vocab.
acc_k is the share of kept predictions whose draft argmax, mapped through d2t, equals
the target's top-1. With p the target softmax over the draft-vocab columns and q the
drafter's, step k's loss, averaged over its positions, is
  soft_ce  -sum_v p_v log q_v over the kept predictions;
  kl       sum_v p_v (log p_v - log q_v), the same gradient, but over every trained
           prediction, those whose target top-1 is outside the draft vocab included;
  lk       -log sum_v min(p_v, q_v): minus the log of the probability that speculative
           sampling accepts the draft token (1 - total variation), over every trained one.
The total is sum_k step_weight**k * loss_k.

Step k >= 1 is computed only at the indices where its own or a later step's prediction
is trained (`needed_indices`): on chat rows most prompt indices feed no scored
prediction past step 0, and skipping them changes no loss and no count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.drafter.acceptance import chain_runs
from eagle3_assets.drafter.model import Eagle3Drafter, StepIndices, step_indices
from eagle3_assets.drafter.target_head import Targets


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable: sum_k w^k loss_k
    step_losses: torch.Tensor  # [K] detached
    correct: torch.Tensor  # [K] int64: kept predictions whose draft top-1 is the target's
    kept: torch.Tensor  # [K] int64: predictions that count
    # [K] int64: the positions each step's loss is a mean over (weights to combine batches and ranks)
    averaged_over: torch.Tensor
    # [K] differentiable loss_k (`loss` is their weighted sum): data-parallel training reweights them
    step_terms: torch.Tensor
    # [K+1] int64: positions by how many leading steps were correct there (`acceptance.chain_runs`)
    runs: torch.Tensor

    def metrics(self) -> dict[str, float]:
        m = {"loss": float(self.loss.detach())}
        for k in range(len(self.kept)):
            m[f"loss_{k}"] = float(self.step_losses[k])
            m[f"acc_{k}"] = float(self.correct[k]) / max(int(self.kept[k]), 1)
        return m


def shift_left(x: torch.Tensor, by: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + by] along dim 1, `fill` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


Loss = Literal["soft_ce", "kl", "lk"]
LossPositions = Literal["predicted", "input"]


def trained_positions(
    loss_mask: torch.Tensor, lengths: torch.Tensor, step: int, loss_positions: LossPositions = "predicted",
    segments: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """bool [B, T]: step-`step` predictions of an existing, trained token (see the module docstring).

    In a packed row (`segments` [B, T], -1 = padding) token t+2+step must be in the same sample as token t.
    """
    B, T = loss_mask.shape
    if segments is None:
        index = torch.arange(T, device=loss_mask.device).expand(B, T)
        exists = index + 2 + step < lengths.to(loss_mask.device)[:, None]
    else:
        exists = (segments >= 0) & (shift_left(segments, 2 + step, -1) == segments)
    return exists & shift_left(loss_mask.bool(), (2 if loss_positions == "predicted" else 1) + step, False)


def kept_positions(
    loss_mask: torch.Tensor, lengths: torch.Tensor, in_draft: torch.Tensor, step: int,
    loss_positions: LossPositions = "predicted", segments: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """bool [B, T]: which step-`step` predictions count for acc_k (and the soft_ce loss)."""
    trained = trained_positions(loss_mask, lengths, step, loss_positions, segments)
    return trained & shift_left(in_draft, 1 + step, False)


def needed_indices(trained: torch.Tensor) -> torch.Tensor:
    """bool [K, B, T] from trained [K, B, T]: index t's step-k output is used by a trained step-j prediction, j >= k."""
    return trained.flip(0).cummax(0).values.flip(0)


def predicted_targets(targets: Targets, index: torch.Tensor, step: int) -> Targets:
    """What the step-`step` predictions at `index` [B, Tk] are scored against: the target at index + 1 + step.

    Past a row's end the last position stands in: those predictions never count.
    """
    at = (index + 1 + step).clamp(max=targets.argmax.shape[1] - 1)  # [B, Tk]
    probs = targets.probs.gather(1, at[..., None].expand(-1, -1, targets.probs.shape[-1]))
    exists = index + 1 + step < targets.argmax.shape[1]
    return Targets(probs, targets.argmax.gather(1, at), targets.in_draft.gather(1, at) & exists)


def averaged_positions(trained: torch.Tensor, kept: torch.Tensor, loss: Loss) -> torch.Tensor:
    """The positions a step's loss averages over: the kept ones for soft_ce, every trained one otherwise."""
    return kept if loss == "soft_ce" else trained


def ttt_step_loss(
    logits: torch.Tensor, predicted: Targets, trained: torch.Tensor, kept: torch.Tensor, d2t: torch.Tensor,
    loss: Loss = "soft_ce",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, correct, kept count) of one step: logits [B, Tk, Vd] against `predicted` (`predicted_targets`)."""
    p, top1 = predicted.probs, predicted.argmax  # [B, Tk, Vd], [B, Tk] target ids
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, Tk, Vd]
    if loss == "lk":
        per_position = -torch.log(torch.minimum(p, logq.exp()).sum(-1).clamp(min=1e-9))  # [B, Tk]
    else:
        per_position = -(p * logq).sum(-1)  # [B, Tk]; KL differs from it by the constant entropy of p
        if loss == "kl":
            per_position = per_position + (p * torch.log(p.clamp(min=1e-30))).sum(-1)
    counted = averaged_positions(trained, kept, loss)
    value = (per_position * counted).sum() / counted.sum().clamp(min=1)
    return value, draft_hits(logits, top1, kept, d2t).sum(), kept.sum()


@torch.no_grad()
def draft_hits(logits: torch.Tensor, top1: torch.Tensor, kept: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """bool [B, Tk]: kept predictions whose draft argmax, mapped through d2t, is the target's top-1."""
    draft_top1 = logits.argmax(-1)  # [B, Tk] draft ids
    return ((draft_top1 + d2t[draft_top1]) == top1) & kept


class StepScores:
    """Step k's (or a block's slot k's) logits scored as they come, into one `TTTOutput`: the loss against the
    target's distribution at each index's step-k position, weighted `weight`**k, the acc_k counts and the draft hits
    behind the acceptance estimate. Both families' objectives score through it (`dflash_loss.py`)."""

    def __init__(self, targets: Targets, d2t: torch.Tensor, loss: Loss, weight: float, device: torch.device):
        self.targets, self.d2t, self.loss, self.weight = targets, d2t, loss, weight
        self.total = torch.zeros((), device=device)
        self.losses: list[torch.Tensor] = []
        self.correct: list[torch.Tensor] = []
        self.counted: list[torch.Tensor] = []
        self.averaged: list[torch.Tensor] = []

    def add(self, k: int, logits: torch.Tensor, index: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        """Score step k's logits [B, Tk, Vd] at `index` [B, Tk] where `trained` [B, Tk]; its hits, bool [B, Tk]."""
        predicted = predicted_targets(self.targets, index, k)
        kept = trained & predicted.in_draft
        loss_k, correct, counted = ttt_step_loss(logits, predicted, trained, kept, self.d2t, self.loss)
        self.total = self.total + self.weight**k * loss_k
        self.losses.append(loss_k)
        self.correct.append(correct)
        self.counted.append(counted)
        self.averaged.append(averaged_positions(trained, kept, self.loss).sum())
        return draft_hits(logits, predicted.argmax, kept, self.d2t)

    def output(self, runs: torch.Tensor) -> TTTOutput:
        terms = torch.stack(self.losses)
        return TTTOutput(
            self.total,
            terms.detach(),
            torch.stack(self.correct),
            torch.stack(self.counted),
            torch.stack(self.averaged),
            terms,
            runs,
        )


def ttt_forward(
    model: Eagle3Drafter | nn.Module,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    targets: Targets,
    *,
    num_steps: int,
    step_weight: float,
    loss: Loss = "soft_ce",
    loss_positions: LossPositions = "predicted",
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    skip_unscored: bool = True,
) -> TTTOutput:
    """Unroll `num_steps` and score them. input_ids/loss_mask [B, T], aux [B, T, 3H], lengths [B];
    packed rows also pass positions/segments [B, T] (`Eagle3Drafter.unroll`). `skip_unscored=False`
    computes every step at every index (the same result, at more cost: tests and benchmarks)."""
    # Called through a DistributedDataParallel wrapper when there is one (gradient sync);
    # d2t is read from the drafter inside it.
    inner: Eagle3Drafter = getattr(model, "module", model)
    B, T = input_ids.shape
    trained = torch.stack([trained_positions(loss_mask, lengths, k, loss_positions, segments) for k in range(num_steps)])
    indices = step_indices(needed_indices(trained)) if skip_unscored else None
    every_index = torch.arange(T, device=aux.device).expand(B, T)  # step 0 runs at all of them
    scores = StepScores(targets, inner.d2t, loss, step_weight, aux.device)
    hits = []
    for k, logits in enumerate(model(input_ids, aux, num_steps, positions, segments, indices)):
        at: StepIndices | None = indices[k - 1] if indices is not None and k > 0 else None
        index = every_index if at is None else at.index
        trained_k = trained[k].gather(1, index)  # [B, Tk]
        if at is not None:
            trained_k &= at.valid
        hit = scores.add(k, logits, index, trained_k).long()
        # Back to [B, T]: padding slots of a step's layout are never kept, so they add nothing.
        hits.append(torch.zeros(B, T, dtype=torch.long, device=aux.device).scatter_add_(1, index, hit) > 0)
    return scores.output(chain_runs(torch.stack(hits), trained[0]))
