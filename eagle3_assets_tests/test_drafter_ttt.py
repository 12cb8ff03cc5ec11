"""The TTT objective on hand-made cases with known answers."""

from __future__ import annotations

import math

import torch

from eagle3_assets.drafter.data import SampleRef, collate, collate_packed
from eagle3_assets.drafter.target_head import Targets
from eagle3_assets.drafter.model import step_indices
from eagle3_assets.drafter.ttt import (
    kept_positions, needed_indices, predicted_targets, trained_positions, ttt_forward, ttt_step_loss,
)  # fmt: skip

from .test_drafter_model import make_model

# Target vocab of 4 ids, draft vocab {1, 3}: draft id 0 -> target 1, draft id 1 -> target 3.
T2D = torch.tensor([False, True, False, True])
D2T = torch.tensor([1, 2])
NAN = float("nan")


def hand_made_targets() -> Targets:
    # Position p holds the target's distribution for token p+1. Positions 1..3 matter for step 0.
    probs = torch.tensor([[[NAN, NAN], [0.5, 0.5], [0.9, 0.1], [0.0, 1.0], [NAN, NAN]]])
    argmax = torch.tensor([[0, 1, 0, 3, 0]])  # position 2's top-1 is target id 0: not in the draft vocab
    return Targets(probs=probs.nan_to_num(0.25), argmax=argmax, in_draft=T2D[argmax])


def step0(targets: Targets) -> Targets:
    """The targets step 0's predictions at every index are scored against."""
    return predicted_targets(targets, torch.arange(targets.argmax.shape[1])[None], step=0)


def test_step0_keeps_only_positions_with_a_trained_existing_in_vocab_target():
    loss_mask = torch.tensor([[0, 1, 1, 1, 1]])
    kept = kept_positions(loss_mask, torch.tensor([5]), hand_made_targets().in_draft, step=0)
    # index t predicts token t+2: t = 0, 2 exist and are trained; t = 1's target top-1 is
    # outside the draft vocab; t = 3, 4 predict past the end of the row.
    assert kept.tolist() == [[True, False, True, False, False]]
    # Step 1 shifts one further: index t predicts token t+3 from position t+2.
    kept1 = kept_positions(loss_mask, torch.tensor([5]), hand_made_targets().in_draft, step=1)
    assert kept1.tolist() == [[False, True, False, False, False]]
    # A prompt token (loss_mask 0) as the predicted token is dropped.
    kept_prompt = kept_positions(torch.tensor([[1, 1, 0, 1, 1]]), torch.tensor([5]), hand_made_targets().in_draft, 0)
    assert kept_prompt.tolist() == [[False, False, True, False, False]]


def test_step_loss_and_accuracy_exact_values():
    targets = hand_made_targets()
    kept = torch.tensor([[True, False, True, False, False]])
    big = 1e4  # logits at dropped indices are absurd; they must not count
    logits = torch.tensor([[[0.0, 0.0], [big, -big], [0.0, math.log(3.0)], [big, -big], [-big, big]]])
    loss, correct, n = ttt_step_loss(logits, step0(targets), kept, kept, D2T)
    # index 0 vs p=[.5,.5] with q=[.5,.5]: ln 2. index 2 vs p=[0,1] (position 3) with q=[.25,.75]: -ln .75
    assert n.item() == 2
    assert math.isclose(loss.item(), (math.log(2) - math.log(0.75)) / 2, rel_tol=1e-6)
    # index 0: draft argmax 0 -> target 1 == top-1 1 (ties take the first). index 2: draft 1 -> target 3 == 3.
    assert correct.item() == 2
    logits[0, 2] = torch.tensor([math.log(3.0), 0.0])  # now draft argmax 0 -> target 1 != 3
    loss, correct, _ = ttt_step_loss(logits, step0(targets), kept, kept, D2T)
    assert correct.item() == 1
    assert math.isclose(loss.item(), (math.log(2) - math.log(0.25)) / 2, rel_tol=1e-6)


def test_no_kept_position_gives_zero_loss_not_nan():
    targets = hand_made_targets()
    kept = torch.zeros(1, 5, dtype=torch.bool)
    loss, correct, n = ttt_step_loss(torch.zeros(1, 5, 2), step0(targets), kept, kept, D2T)
    assert (loss.item(), correct.item(), n.item()) == (0.0, 0, 0)


def test_total_loss_weights_step_k_by_step_weight_power_k():
    model = make_model()
    B, T, Vd = 2, 9, 64
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (B, T), generator=g)
    aux = torch.randn(B, T, 192, generator=g)
    draft_ids = torch.randint(0, Vd, (B, T), generator=g)
    argmax = draft_ids + model.d2t[draft_ids]  # target ids in the draft vocab
    targets = Targets(torch.softmax(torch.randn(B, T, Vd, generator=g), -1), argmax, model.t2d[argmax])
    out = ttt_forward(
        model, ids, aux, torch.ones(B, T, dtype=torch.uint8), torch.tensor([9, 6]), targets, num_steps=4, step_weight=0.8
    )
    want = sum(0.8**k * out.step_losses[k] for k in range(4))
    assert math.isclose(out.loss.item(), float(want), rel_tol=1e-6)
    # Row lengths 9 and 6: step k keeps indices t with t + 2 + k < length.
    assert out.kept.tolist() == [(7 - k) + (4 - k) for k in range(4)]
    m = out.metrics()
    assert sorted(m) == sorted(["loss"] + [f"loss_{k}" for k in range(4)] + [f"acc_{k}" for k in range(4)])


def _random_sample(length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 256, (length,), generator=g),
        "loss_mask": (torch.rand(length, generator=g) < 0.7).to(torch.uint8),
        "aux_hidden_states": torch.randn(length, 192, generator=g),
        "last_hidden_state": torch.randn(length, 64, generator=g),
    }


def _targets_of(last: torch.Tensor, model) -> Targets:
    """A stand-in target distribution over the 64 draft ids, a function of each token's own state."""
    probs = torch.softmax(3 * last, -1)  # [B, T, Vd]
    argmax = probs.argmax(-1) + model.d2t[probs.argmax(-1)]
    in_draft = model.t2d[argmax] & (last[..., 0] > -1.0)  # some tokens' top-1 outside the draft vocab
    return Targets(probs, argmax, in_draft)


def test_a_packed_row_scores_exactly_what_one_row_per_sample_scores():
    """Packing changes the layout only: the same predictions count, with the same logits."""
    model = make_model()
    g = torch.Generator().manual_seed(5)
    lengths = (9, 6, 4, 7, 3)
    loaded = [(_random_sample(n, g), False) for n in lengths]
    refs = [SampleRef("rows_0-5", i, n) for i, n in enumerate(lengths)]
    padded = collate(loaded, refs)
    packed = collate_packed(loaded, refs, width=14)  # rows [9, 4] [6, 7] [3]: mid-row sample boundaries
    assert packed.segments.tolist() == [[0] * 9 + [1] * 4, [0] * 6 + [1] * 7, [0] * 3 + [-1] * 10]
    for loss in ("soft_ce", "kl", "lk"):
        a = ttt_forward(
            model, padded.input_ids, padded.aux, padded.loss_mask, padded.lengths, _targets_of(padded.last, model),
            num_steps=4, step_weight=0.8, loss=loss,
        )  # fmt: skip
        b = ttt_forward(
            model, packed.input_ids, packed.aux, packed.loss_mask, packed.lengths, _targets_of(packed.last, model),
            num_steps=4, step_weight=0.8, loss=loss, positions=packed.positions, segments=packed.segments,
        )  # fmt: skip
        assert b.kept.tolist() == a.kept.tolist() and b.correct.tolist() == a.correct.tolist()
        torch.testing.assert_close(b.step_losses, a.step_losses, rtol=1e-5, atol=1e-6)
    # Without its segments the packed row leaks: samples see each other and predict across their ends.
    leaky = ttt_forward(
        model, packed.input_ids, packed.aux, packed.loss_mask, packed.lengths, _targets_of(packed.last, model),
        num_steps=4, step_weight=0.8,
    )  # fmt: skip
    assert leaky.kept.tolist() != a.kept.tolist()


def test_skipping_unscored_indices_changes_no_loss_count_or_gradient():
    """ttt_forward computes step k >= 1 only where a prediction is trained; every index at every step agrees."""
    g = torch.Generator().manual_seed(7)
    lengths = (12, 9, 10)
    loaded = [(_random_sample(n, g), False) for n in lengths]
    for sample, _ in loaded:
        sample["loss_mask"][: len(sample["loss_mask"]) // 2] = 0  # a prompt: no trained prediction reads it
    b = collate(loaded, [SampleRef("rows_0-3", i, n) for i, n in enumerate(lengths)])
    trained = torch.stack([trained_positions(b.loss_mask, b.lengths, k) for k in range(4)])
    assert [x.index.shape[1] for x in step_indices(needed_indices(trained))] == [7, 6, 3]  # of 12
    for loss in ("soft_ce", "kl", "lk"):
        runs = []
        for skip in (True, False):
            model = make_model().train()
            out = ttt_forward(
                model, b.input_ids, b.aux, b.loss_mask, b.lengths, _targets_of(b.last, model), num_steps=4,
                step_weight=0.8, loss=loss, skip_unscored=skip,
            )  # fmt: skip
            out.loss.backward()
            runs.append((out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        (skipped, grads), (full, want) = runs
        assert skipped.kept.tolist() == full.kept.tolist() and skipped.correct.tolist() == full.correct.tolist()
        assert full.kept[3] > 0
        torch.testing.assert_close(skipped.step_losses, full.step_losses, rtol=1e-5, atol=1e-6)
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{loss}: {name}")
