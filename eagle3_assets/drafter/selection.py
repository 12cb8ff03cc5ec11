"""Which weights the drafter exports, and when training stops early: by its held-out evaluations.

Each evaluation during training (`training.eval_every`) is a record {"step", "loss", "acc_k",
"accept_len_k3", ...}; the run's list of them travels in every checkpoint, so a resumed run
keeps its history. An evaluation "rises" when its estimated acceptance length at k=3
(`SELECT_BY`) beats every earlier one; the best is the last rise. Its weights are kept in
`drafter/checkpoints/best/` (beside the resumable step checkpoints, and removed with them), with
the step and the run's fingerprint, so weights of another run are never exported as this one's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from eagle3_assets.drafter.checkpoint import (
    CHECKPOINTS_DIR,
    CheckpointError,
    publish_weights,
    read_checkpoint_state,
    read_model_tensors,
)
from eagle3_assets.storage import ArtifactStore

BEST_DIR = f"{CHECKPOINTS_DIR}/best"
SELECT_BY = "accept_len_k3"

Evaluation = dict[str, Any]


def best_index(evals: Sequence[Evaluation]) -> int | None:
    """Index of the last rise (the first evaluation reaching the highest estimate), None without evaluations."""
    best: int | None = None
    for i, e in enumerate(evals):
        if best is None or e[SELECT_BY] > evals[best][SELECT_BY]:
            best = i
    return best


def evals_without_rise(evals: Sequence[Evaluation]) -> int:
    """Evaluations since the best one."""
    best = best_index(evals)
    return 0 if best is None else len(evals) - 1 - best


def stops_early(evals: Sequence[Evaluation], early_stop_evals: int | None) -> bool:
    return early_stop_evals is not None and evals_without_rise(evals) >= early_stop_evals


def save_best(
    store: ArtifactStore, tensors: dict[str, torch.Tensor], evaluation: Evaluation, fingerprint: dict[str, Any]
) -> None:
    """Publish `tensors` as the run's best weights, in the checkpoints' one format (complete or absent)."""
    publish_weights(store, BEST_DIR, tensors, {"step": evaluation["step"], "evaluation": evaluation, "run": fingerprint})


def load_best(store: ArtifactStore, step: int, fingerprint: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The weights evaluated at `step` by this run (same fingerprint), None when `best/` holds other ones."""
    if not store.exists(f"{BEST_DIR}/state.json"):
        return None
    try:
        best = read_checkpoint_state(store, BEST_DIR)
    except CheckpointError:
        return None  # written before the one format, or broken: not this run's, never exported as its
    # Compared as JSON, the form it was saved in (tuples become lists).
    if best.run != json.loads(json.dumps(fingerprint)) or best.step != step:
        return None
    return read_model_tensors(store, BEST_DIR)
