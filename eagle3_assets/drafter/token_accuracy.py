"""Drafter accuracy by kind of token on held-out conversations, scored by the training objective.

Acceptance length says how much a drafter buys; this says where it comes from. Each
held-out conversation is a prompt plus the target's own greedy answer. Its target
features come from the same extraction backend as the shards, for the aux layers the
export declares (what an engine will feed it), and the training-time-test unroll
scores acc_k over the answer tokens of one class at a time:

    all          every answer token
    template     answer tokens of prompts marked `"kind": "template"`: predictable from the prompt
    fact_prompt  answer tokens of prompts marked `"kind": "fact"`
    fact         answer tokens inside a prompt's `fact_spans`, character spans into its
                 `reference` answer, when the target reproduced that answer exactly:
                 knowledge that only the target's weights hold

A drafter that really reads the target scores nearly as well on `fact` as on
`template`; one fed the wrong features (an off-by-one aux layer, a doubled final
norm) still does well on `template` and collapses on `fact`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from eagle3_assets.chat import span_token_flags
from eagle3_assets.drafter.data import collate
from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.model import Eagle3Drafter
from eagle3_assets.drafter.target_head import TargetHead
from eagle3_assets.drafter.ttt import ttt_forward
from eagle3_assets.hidden_states.base import ExtractedSample
from eagle3_assets.prompts import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

TOKEN_CLASSES = ("all", "template", "fact_prompt", "fact")


@dataclass(frozen=True)
class LabeledRow:
    input_ids: list[int]  # prompt + answer
    classes: dict[str, list[bool]]  # class -> [T] flags, True only on answer tokens of that class


@dataclass(frozen=True)
class ClassAccuracy:
    acc: list[float]  # acc_k, k = 0..K-1
    predictions: list[int]  # predictions scored at step k


def label_rows(
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[list[LabeledRow], list[str]]:
    """Rows with their token classes, and the ids of prompts whose answer differs from
    their `reference` (their tokens count in `all` and nowhere else)."""
    rows, off_reference = [], []
    for prompt, p_ids, a_ids in zip(prompts, prompt_ids, answers, strict=True):
        n_prompt, n = len(p_ids), len(p_ids) + len(a_ids)
        answer = [False] * n_prompt + [True] * len(a_ids)
        fact = [False] * n
        reference = prompt.extra.get("reference")
        if isinstance(reference, str):
            ref_ids, flags = span_token_flags(tokenizer, reference, _fact_spans(prompt))
            if list(a_ids[: len(ref_ids)]) == ref_ids:
                fact[n_prompt : n_prompt + len(flags)] = flags
            else:
                off_reference.append(prompt.id)
        kind = prompt.extra.get("kind")
        rows.append(
            LabeledRow(
                [*p_ids, *a_ids],
                {
                    "all": answer,
                    "template": answer if kind == "template" else [False] * n,
                    "fact_prompt": answer if kind == "fact" else [False] * n,
                    "fact": fact,
                },
            )
        )
    return rows, off_reference


def _fact_spans(prompt: Prompt) -> list[tuple[int, int]]:
    """The prompt's fact spans, checked when its line was parsed (`prompts.py`)."""
    return [(a, b) for a, b in prompt.extra.get("fact_spans", [])]


@torch.no_grad()
def class_accuracy(
    model: Eagle3Drafter,
    head: TargetHead,
    rows: Sequence[LabeledRow],
    samples: Sequence[ExtractedSample],
    *,
    pre_norm: bool,
    num_steps: int,
    batch_rows: int = 16,
) -> dict[str, ClassAccuracy]:
    """acc_k per token class; `samples[i]` holds the target features of `rows[i]`."""
    device = next(model.parameters()).device
    correct = {c: torch.zeros(num_steps, dtype=torch.int64) for c in TOKEN_CLASSES}
    kept = {c: torch.zeros(num_steps, dtype=torch.int64) for c in TOKEN_CLASSES}
    for start in range(0, len(rows), batch_rows):
        chunk = list(zip(rows[start : start + batch_rows], samples[start : start + batch_rows], strict=True))
        for row, sample in chunk:
            if not np.array_equal(np.asarray(sample.input_ids), np.asarray(row.input_ids)):
                raise EvaluationError(f"features of row {sample.row} were extracted for other tokens than the row's")
        batch = collate(
            [
                (
                    {
                        "input_ids": torch.as_tensor(row.input_ids),
                        "loss_mask": torch.zeros(len(row.input_ids), dtype=torch.uint8),  # set per class below
                        "aux_hidden_states": sample.aux_hidden_states,
                        "last_hidden_state": sample.last_hidden_state,
                    },
                    pre_norm,
                )
                for row, sample in chunk
            ],
            refs=[],
        ).to(device)
        targets = head.targets(batch.last, batch.pre_norm, model.t2d)
        for c in TOKEN_CLASSES:
            mask = torch.zeros_like(batch.loss_mask)  # [B, T]
            for i, (row, _) in enumerate(chunk):
                mask[i, : len(row.input_ids)] = torch.as_tensor(row.classes[c], dtype=torch.uint8)
            out = ttt_forward(
                model, batch.input_ids, batch.aux, mask, batch.lengths, targets, num_steps=num_steps, step_weight=1.0
            )
            correct[c] += out.correct.cpu()
            kept[c] += out.kept.cpu()
    return {
        c: ClassAccuracy(
            acc=[int(a) / max(int(b), 1) for a, b in zip(correct[c], kept[c])], predictions=[int(b) for b in kept[c]]
        )
        for c in TOKEN_CLASSES
    }
