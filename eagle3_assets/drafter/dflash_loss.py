"""The DFlash objective: blocks at anchors sampled in the trained spans, scored like EAGLE-3's TTT steps.

A block at anchor index t (`dflash_model.py`) drafts tokens t+2 .. t+1+K with mask slots 1..K; slot i is scored
exactly as EAGLE-3's step k = i - 1 at index t (`ttt.py`): against the target's distribution at t+1+k, counted
when token t+2+k exists, is trained (`loss_positions`) and the target's top-1 is in the draft vocab. So the loss
(`ttt_step_loss`: soft_ce, kl or lk), acc_k and the chain-run histogram behind the acceptance estimate are the same
functions, and a block's run is its count of leading correct slots, as vLLM accepts them.

Anchors are the indices where slot 1 is trained (`trained_positions` of step 0), `anchors_per_row` of them drawn
without replacement per row from `generator` (a row with fewer takes every one), or all of them when it is None
(evaluation). Slot k's loss weight is exp(-k / loss_decay): the later slots, accepted only after every earlier one,
count less. Normalized per token (`slot_weights`, the reference's form), the loss is that weighted mean over every
scored slot of every block, so a slot scored at fewer positions (past the end of short answers) weighs less too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3_assets.drafter.acceptance import chain_runs
from eagle3_assets.drafter.dflash_model import DFlashDrafter
from eagle3_assets.drafter.target_head import Targets
from eagle3_assets.drafter.ttt import Loss, LossPositions, StepScores, TTTOutput, trained_positions
from eagle3_assets.dflash_settings import LossNormalization


def decay_weight(loss_decay: float) -> float:
    """The per-slot factor w with slot k weighted w**k = exp(-k / loss_decay) (what `StepCounts.metrics` takes)."""
    return math.exp(-1.0 / loss_decay)


def slot_weights(positions: torch.Tensor, loss_decay: float, normalization: LossNormalization) -> torch.Tensor:
    """float64 [K]: the coefficient of each slot's mean loss in the block loss, `positions` [K] the positions each
    mean is over. "slot": exp(-k / loss_decay). "token": the same times the slot's positions, over the weighted
    total, so the block loss is the weighted mean over every scored token (slot 1's share of it: coefficient 0)."""
    decay = torch.tensor([decay_weight(loss_decay) ** k for k in range(len(positions))], dtype=torch.float64)
    if normalization == "slot":
        return decay
    weighted = decay * positions.detach().double().cpu()
    return weighted / weighted.sum().clamp(min=1e-12)


def choose_anchors(starts: torch.Tensor, per_row: int | None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Anchor indices [B, N], ascending, -1 where a row has fewer than N: `per_row` of the True indices of
    `starts` [B, T] drawn uniformly without replacement (all of a row's when it has no more), or every one of them
    when `per_row` is None."""
    B, T = starts.shape
    most = max(int(starts.sum(1).max()), 1)  # no row needs more columns: the rest would be padding blocks
    if per_row is None:
        n = most
        scores = starts.float()
    else:
        n = min(per_row, most)
        scores = torch.rand(B, T, generator=generator).to(starts.device)
        scores = torch.where(starts, scores, -1.0)
    n = min(n, T)
    top = scores.topk(n, dim=1)
    index = torch.where(top.values > (0.5 if per_row is None else -0.5), top.indices, T)  # -1 / 0 score: none
    index = index.sort(dim=1).values
    return index.masked_fill(index == T, -1)


def dflash_forward(
    model: DFlashDrafter | nn.Module,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    targets: Targets,
    *,
    loss_decay: float,
    anchors_per_row: int | None,
    normalization: LossNormalization = "token",
    generator: torch.Generator | None = None,
    loss: Loss = "soft_ce",
    loss_positions: LossPositions = "predicted",
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> TTTOutput:
    """Draft blocks at anchors and score their slots. input_ids/loss_mask [B, T], aux [B, T, A], lengths [B]; packed
    rows also pass positions/segments [B, T]."""
    inner: DFlashDrafter = getattr(model, "module", model)  # DistributedDataParallel wraps it when there is one
    K = inner.config.block_size
    trained = torch.stack([trained_positions(loss_mask, lengths, k, loss_positions, segments) for k in range(K)])
    anchors = choose_anchors(trained[0], anchors_per_row, generator)  # [B, N]
    real = anchors >= 0
    index = anchors.clamp(min=0)
    scores = StepScores(targets, inner.d2t, loss, decay_weight(loss_decay), aux.device)
    hits = [
        scores.add(k, logits, index, trained[k].gather(1, index) & real)  # logits [B, N, Vd] per slot
        for k, logits in enumerate(model(input_ids, aux, anchors, positions, segments))
    ]
    out = scores.output(chain_runs(torch.stack(hits), trained[0].gather(1, index) & real))
    if normalization != "slot":  # StepScores sums exp(-k / loss_decay) x each slot's mean: "slot" as it is
        weights = slot_weights(out.averaged_over, loss_decay, normalization)
        out.loss = (out.step_terms * weights.to(out.step_terms)).sum()
    return out
