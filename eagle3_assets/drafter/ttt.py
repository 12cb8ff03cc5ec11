"""The training-time-test objective: unroll the drafter, score each step against the target.

Alignment (DESIGN §5). Index t of a sequence (t = 0..T-1; index t holds token t):
  step k reads token t+1+k and (k = 0) the target features of position t or (k > 0)
  its own step k-1 output at index t; it predicts token t+2+k, whose target
  distribution is the target's output at position t+1+k.
A prediction counts (is "kept") when
  - token t+2+k exists (t+2+k < length of the row),
  - that token is a trained token (loss_mask[t+2+k] == 1: the drafter learns to draft
    assistant tokens, including the first one, predicted from the prompt's last position),
  - the target's top-1 at position t+1+k, over the FULL vocab, is in the draft vocab.
Step k's loss is the soft cross-entropy -sum_v p_v log q_v, with p the target softmax
over the draft-vocab columns and q the drafter's softmax, averaged over kept
predictions; the total is sum_k step_weight**k * loss_k. acc_k is the share of kept
predictions whose draft argmax, mapped through d2t, equals the target's top-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.drafter.model import Eagle3Drafter
from eagle3_assets.drafter.target_head import Targets


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable: sum_k w^k loss_k
    step_losses: torch.Tensor  # [K] detached
    correct: torch.Tensor  # [K] int64: kept predictions whose draft top-1 is the target's
    kept: torch.Tensor  # [K] int64: predictions that count

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


def kept_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, in_draft: torch.Tensor, step: int) -> torch.Tensor:
    """bool [B, T]: which step-`step` predictions count (see the module docstring)."""
    B, T = loss_mask.shape
    index = torch.arange(T, device=loss_mask.device).expand(B, T)
    exists = index + 2 + step < lengths.to(loss_mask.device)[:, None]
    trained = shift_left(loss_mask.bool(), 2 + step, False)
    return exists & trained & shift_left(in_draft, 1 + step, False)


def ttt_step_loss(
    logits: torch.Tensor, targets: Targets, kept: torch.Tensor, d2t: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, correct, kept count) of one step; logits [B, T, Vd] at index t score position t+1+step."""
    p = shift_left(targets.probs, 1 + step)  # [B, T, Vd]
    top1 = shift_left(targets.argmax, 1 + step)  # [B, T] target ids
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, T, Vd]
    ce = -(p * logq).sum(-1)  # [B, T]
    n = kept.sum()
    loss = (ce * kept).sum() / n.clamp(min=1)
    with torch.no_grad():
        draft_top1 = logits.argmax(-1)  # [B, T] draft ids
        correct = ((draft_top1 + d2t[draft_top1]) == top1) & kept
    return loss, correct.sum(), n


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
) -> TTTOutput:
    """Unroll `num_steps` and score them. input_ids/loss_mask [B, T], aux [B, T, 3H], lengths [B]."""
    # Called through a DistributedDataParallel wrapper when there is one (gradient sync);
    # d2t is read from the drafter inside it.
    inner: Eagle3Drafter = getattr(model, "module", model)
    losses, correct, kept = [], [], []
    total = torch.zeros((), device=aux.device)
    for k, logits in enumerate(model(input_ids, aux, num_steps)):
        mask = kept_positions(loss_mask, lengths, targets.in_draft, k)
        loss_k, c, n = ttt_step_loss(logits, targets, mask, inner.d2t, k)
        total = total + step_weight**k * loss_k
        losses.append(loss_k.detach())
        correct.append(c)
        kept.append(n)
    return TTTOutput(total, torch.stack(losses), torch.stack(correct), torch.stack(kept))
