"""The acceptance estimate from TTT predictions, and the checkpoint choice it drives: exact values on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from eagle3_assets.drafter.acceptance import acceptance_estimates, acceptance_rates, chain_runs, expected_accept_length
from eagle3_assets.drafter.data import SampleRef, collate
from eagle3_assets.drafter.metrics import StepCounts
from eagle3_assets.drafter.selection import best_index, evals_without_rise, stops_early
from eagle3_assets.drafter.target_head import Targets
from eagle3_assets.drafter.ttt import trained_positions, ttt_forward
from eagle3_assets.settings import TrainingSettings

from .test_drafter_ttt import _random_sample, _targets_of, make_model

# Step k's prediction at index t correct (1) or not; chains start at indices 0..4 (index 5 predicts past the row).
HITS = torch.tensor(
    [
        [[1, 1, 0, 1, 1, 1]],
        [[1, 0, 1, 1, 1, 1]],
        [[1, 1, 1, 0, 1, 1]],
    ],
    dtype=torch.bool,
)
STARTS = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)


def test_runs_count_the_leading_correct_steps_at_each_start():
    # Runs: index 0: 3, index 1: 1 (step 1 wrong ends it; step 2 right does not count), index 2: 0, index 3: 2,
    # index 4: 3; index 5 starts no chain.
    runs = chain_runs(HITS, STARTS)
    assert runs.tolist() == [1, 1, 1, 2]


def test_expected_tokens_per_forward_is_one_plus_the_mean_capped_run():
    runs = chain_runs(HITS, STARTS)
    # vLLM's per-position acceptance: P(run >= i) over the 5 chains.
    assert acceptance_rates(runs, 3) == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    # k=3: 1 + mean(min(run, 3)) = 1 + (3 + 1 + 0 + 2 + 3) / 5.
    assert math.isclose(expected_accept_length(runs, 3), 2.8)
    assert math.isclose(expected_accept_length(runs, 2), 1 + (2 + 1 + 0 + 2 + 2) / 5)
    # k=7 past a 3-step unroll: positions 4..7 keep step 3's conditional rate (2/5) / (3/5) = 2/3.
    tail = [2 / 5 * (2 / 3) ** i for i in range(1, 5)]
    assert acceptance_rates(runs, 7) == pytest.approx([4 / 5, 3 / 5, 2 / 5, *tail])
    assert acceptance_estimates(runs, "heldout_") == pytest.approx(
        {"heldout_accept_len_k3": 2.8, "heldout_accept_len_k7": 2.8 + 52 / 81}
    )


def test_nothing_scored_estimates_one_token_per_forward():
    runs = torch.zeros(4, dtype=torch.int64)
    assert acceptance_rates(runs, 3) == [0.0, 0.0, 0.0]
    assert acceptance_estimates(runs) == {"accept_len_k3": 1.0, "accept_len_k7": 1.0}


def test_ttt_forward_counts_one_chain_per_trained_start_and_the_same_runs_whether_or_not_it_skips():
    g = torch.Generator().manual_seed(7)
    lengths = (12, 9, 10)
    loaded = [(_random_sample(n, g), False) for n in lengths]
    b = collate(loaded, [SampleRef("rows_0-3", i, n) for i, n in enumerate(lengths)])
    model = make_model()
    # The target's top-1 is the drafter's step-0 draft: every chain passes step 0 (and here stops at step 1).
    targets = _targets_of(b.last, model)
    step0 = model(b.input_ids, b.aux, 1)[0].argmax(-1)  # [B, T] draft ids at index t, for position t + 1
    agree = shift_right(step0 + model.d2t[step0])
    targets = Targets(targets.probs, agree, model.t2d[agree])
    outs = [
        ttt_forward(
            model, b.input_ids, b.aux, b.loss_mask, b.lengths, targets, num_steps=3, step_weight=1.0, skip_unscored=skip
        )
        for skip in (True, False)
    ]
    runs = outs[0].runs
    assert runs.tolist() == [0, 16, 0, 0]
    assert torch.equal(runs, outs[1].runs)
    assert int(runs.sum()) == int(trained_positions(b.loss_mask, b.lengths, 0).sum())  # a chain per start
    assert int(runs[1:].sum()) == int(outs[0].correct[0]) > 0  # past step 0: exactly step 0's hits
    assert int(runs[2:].sum()) <= int(outs[0].correct[1])
    counts = StepCounts.zeros(3)
    counts.add(outs[0])
    assert counts.metrics(1.0)["accept_len_k3"] == pytest.approx(expected_accept_length(runs, 3))


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """x[:, p] <- x[:, p - 1]: the target at position p is what index p - 1 predicts."""
    return torch.cat([x[:, :1], x[:, :-1]], dim=1)


EVALS = [{"step": s, "accept_len_k3": a} for s, a in [(2, 1.2), (4, 1.5), (6, 1.5), (8, 1.4), (10, 1.6)]]


def test_the_best_evaluation_is_the_last_rise_and_early_stop_counts_evaluations_since():
    assert best_index([]) is None and evals_without_rise([]) == 0
    assert best_index(EVALS[:4]) == 1  # a tie (step 6) is no rise
    assert evals_without_rise(EVALS[:4]) == 2
    assert stops_early(EVALS[:4], 2) and not stops_early(EVALS[:4], 3) and not stops_early(EVALS[:4], None)
    assert best_index(EVALS) == 4 and evals_without_rise(EVALS) == 0


def test_early_stop_without_held_out_rows_or_in_rolling_mode_is_refused():
    with pytest.raises(ValidationError, match="heldout_rows: 0 leaves nothing to evaluate"):
        TrainingSettings(heldout_rows=0, early_stop_evals=2)
    assert TrainingSettings(heldout_rows=0).export_checkpoint == "last"  # the default: measured to serve more
    with pytest.raises(ValidationError, match="early_stop_evals: rolling mode trains and releases each shard"):
        TrainingSettings(mode="rolling", early_stop_evals=2)
