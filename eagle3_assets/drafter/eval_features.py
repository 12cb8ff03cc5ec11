"""The target's features of the answers `drafter_eval` served, and what it computes from them: acc_k by token class
(`token_accuracy`) and vLLM's speculative rounds replayed with the drafter as it trained (`served_replay`).

Both read the features of each served prompt + its greedy answer from the extraction backend the shards are made
with, extracted once per set of aux layers (the export's and the trained drafter's are the same but for a defect).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from eagle3_assets.drafter.export import load_export
from eagle3_assets.drafter.family import Family
from eagle3_assets.drafter.served_replay import ReplayCheck, replay_served, trained_served_as
from eagle3_assets.drafter.target_head import TargetHead, TargetWeights, load_target_weights
from eagle3_assets.drafter.token_accuracy import ClassAccuracy, class_accuracy, label_rows
from eagle3_assets.hidden_states import ExtractionRequest, extract_in_order, open_extractor
from eagle3_assets.hidden_states.base import ExtractedSample
from eagle3_assets.prompts import Prompt
from eagle3_assets.settings import Settings
from eagle3_assets.target import TargetModel, load_tokenizer, resolve_aux_layer_ids

if TYPE_CHECKING:
    from eagle3_assets.drafter.evaluate import ServedPrompts


class AnswerFeatures:
    """The target's features of each served prompt + its greedy answer, by the extraction backend the shards are made
    with, per set of aux layers asked (extracted once each)."""

    def __init__(self, target: TargetModel, settings: Settings, rows: Sequence[Sequence[int]]):
        self.target, self.settings, self.rows = target, settings, rows
        self._extracted: dict[tuple[int, ...], tuple[list[ExtractedSample], bool]] = {}

    def of(self, aux_layer_ids: Sequence[int]) -> tuple[list[ExtractedSample], bool]:
        """(a sample per row at `aux_layer_ids`, whether its last state is before the final norm)."""
        key = tuple(aux_layer_ids)
        if key not in self._extracted:
            declared = replace(self.target, aux_layer_ids=resolve_aux_layer_ids(list(key), self.target.num_layers))
            extractor = open_extractor(self.settings, declared)
            try:
                requests = [ExtractionRequest(i, np.asarray(r, dtype=np.int32)) for i, r in enumerate(self.rows)]
                samples = extract_in_order(extractor, requests)
                self._extracted[key] = samples, extractor.last_hidden_state_norm == "pre_norm"
            finally:
                extractor.close()
        return self._extracted[key]


def token_class_accuracy(
    target: TargetModel,
    settings: Settings,
    export_dir: Path,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    answers: list[list[int]],
    features: AnswerFeatures | None = None,
    weights: TargetWeights | None = None,
) -> tuple[dict[str, ClassAccuracy], list[str]]:
    """acc_k per token class of the exported drafter on the target's answers, and the prompts answered unlike their
    reference (see `token_accuracy`); `features` and `weights`: the answers' features (their first rows) and the
    target's weights when the caller has them already."""
    rows, off_reference = label_rows(prompts, prompt_ids, answers, load_tokenizer(target))
    features = features or AnswerFeatures(target, settings, [r.input_ids for r in rows])
    weights = weights or load_target_weights(target)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, aux_layer_ids = load_export(export_dir, weights.embed_tokens)
    # The export's aux layers, not the settings': the features an engine will feed it.
    samples, pre_norm = features.of(aux_layer_ids)
    accuracy = class_accuracy(
        model.to(device), TargetHead.from_weights(weights).to(device), rows, samples[: len(rows)],
        pre_norm=pre_norm, num_steps=settings.training.ttt_steps,
    )  # fmt: skip
    return accuracy, off_reference


def explain_served(
    family: Family, embed_tokens: torch.Tensor, export_dir: Path, served: ServedPrompts, features: AnswerFeatures,
    log: Callable[[str], None],
) -> list[ReplayCheck]:  # fmt: skip
    """vLLM's speculative rounds replayed with the drafter as it trained, on the answers it served (`served_replay`);
    `embed_tokens` is the target's embedding, which exports leave out."""
    trained, suspects = trained_served_as(family, export_dir)
    model, aux_layer_ids = family.load_as(export_dir, embed_tokens, trained)
    model.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # as the token-class accuracy runs
    samples, _ = features.of(aux_layer_ids)
    checks = replay_served(family, model, samples, list(map(len, served.prompt_ids)), served.speculative, suspects)
    for check in checks:
        log(f"drafter_eval: served against replayed, {check.describe()}")
    return checks
