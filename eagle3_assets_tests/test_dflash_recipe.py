"""DFlash trained by its own recipe (issue 54, item 4): its settings section, its loss normalized per token, anchors
at every answer position of a short row, and EAGLE-3's recipe exactly as it was. Seconds: no training, no vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3_assets.drafter.dflash_loss import choose_anchors, dflash_forward, slot_weights
from eagle3_assets.drafter.dflash_model import DFlashConfig, DFlashDrafter
from eagle3_assets.drafter.family import DFlash, Eagle3
from eagle3_assets.drafter.target_head import Targets
from eagle3_assets.drafter.ttt import trained_positions
from eagle3_assets.families import DFLASH, EAGLE3
from eagle3_assets.settings import (
    DFlashSettings,
    Settings,
    SettingsError,
    TrainingSettings,
    demo_settings,
    parse_settings,
)


def answer_row(prompt: int, answer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask [1, T], lengths [1]) of one row: `prompt` tokens, then `answer` generated ones."""
    return torch.tensor([[0] * prompt + [1] * answer]), torch.tensor([prompt + answer])


def test_slot_1_takes_31_percent_of_the_loss_on_a_14_token_answer_where_the_old_form_gave_it_21():
    """The reference form: exp(-k / 4) per slot, a mean over every scored token. Past a short answer's end the later
    slots score fewer positions, so slot 1's share rises above its share at equal counts."""
    d = DFlashSettings()
    assert (d.loss_decay, d.loss_normalization, d.block_size) == (4.0, "token", 7)
    decay = [math.exp(-k / 4) for k in range(7)]
    # Equal counts in every slot: 1 / sum_k exp(-k / 4).
    assert float(slot_weights(torch.full((7,), 100), 4.0, "token")[0]) == pytest.approx(1 / sum(decay), rel=1e-12)
    assert 1 / sum(decay) == pytest.approx(0.267722, abs=1e-6)

    # One row whose answer is 14 tokens, a block at every trained anchor: slot k (0-based) is scored at 14 - k.
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=64,
        draft_vocab_size=64, num_aux_layers=3, num_layers=1, block_size=7, mask_token_id=0,
    )  # fmt: skip
    model = DFlashDrafter(cfg, torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool))
    loss_mask, lengths = answer_row(6, 14)
    ids = torch.randint(1, 64, (1, 20))
    probs = torch.softmax(torch.randn(1, 20, 64), -1)
    targets = Targets(probs, probs.argmax(-1), torch.ones(1, 20, dtype=torch.bool))
    out = dflash_forward(model, ids, torch.randn(1, 20, 192), loss_mask, lengths, targets, loss_decay=4.0,
                         anchors_per_row=None)  # fmt: skip
    assert out.averaged_over.tolist() == [14, 13, 12, 11, 10, 9, 8]
    weights = DFlash(TrainingSettings(), d, mask_token_id=0).loss_weights(out.averaged_over)
    share = 14 / sum(w * (14 - k) for k, w in enumerate(decay))
    assert float(weights[0]) == pytest.approx(share, rel=1e-12)
    assert share == pytest.approx(0.313612, abs=1e-6)
    assert float(weights.sum()) == pytest.approx(1.0, rel=1e-12)
    # The loss is that weighted mean over every scored token.
    terms = out.step_terms.detach().double()
    assert float(out.loss.detach()) == pytest.approx(float((terms * weights).sum()), rel=1e-6)
    # The form it replaces: decay 7, each slot's own mean: slot 1 took 21%, whatever the counts.
    old = slot_weights(out.averaged_over, 7.0, "slot")
    assert float(old[0] / old.sum()) == pytest.approx(1 / sum(math.exp(-k / 7) for k in range(7)), rel=1e-12)
    assert float(old[0] / old.sum()) == pytest.approx(0.210596, abs=1e-6)


def test_on_short_rows_every_answer_position_is_slot_1s_target_once_per_epoch():
    """A packed row of two short samples: with the default anchors per row, the blocks drawn for a step put slot 1
    on every answer token (anchor t predicts token t + 2), once each."""
    # Sample A: 4 prompt tokens, 6 answer; sample B: 5 prompt, 7 answer; one packed row of 22 tokens.
    loss_mask = torch.tensor([[0] * 4 + [1] * 6 + [0] * 5 + [1] * 7])
    segments = torch.tensor([[0] * 10 + [1] * 12])
    starts = trained_positions(loss_mask, torch.tensor([22]), 0, "predicted", segments)
    anchors = choose_anchors(starts, DFlashSettings().anchors_per_row, torch.Generator().manual_seed(3))
    answers = loss_mask[0].nonzero().flatten().tolist()
    assert sorted(a + 2 for a in anchors[0].tolist() if a >= 0) == answers  # each once: no padding column left over
    assert anchors.shape == (1, len(answers))
    # A long row: 512 of its 600 answer positions, drawn without replacement.
    long_mask, long_lengths = answer_row(8, 600)
    drawn = choose_anchors(trained_positions(long_mask, long_lengths, 0), 512, torch.Generator().manual_seed(3))
    assert drawn.shape == (1, 512) and len(set(drawn[0].tolist())) == 512 and int(drawn.min()) >= 6


def test_eagle3s_recipe_is_exactly_what_it_was():
    """EAGLE-3 reads `training` itself, by the values it had before DFlash had a recipe of its own, here and in the
    demo; its loss weights are step_weight**k."""
    for settings, recipe, dflash_epochs in [
        (Settings(), {"lr": 1e-4, "epochs": 2.0, "weight_decay": 0.0, "warmup_steps": 100, "batch_tokens": 8192}, 6.0),
        (demo_settings(), {"lr": 3e-3, "epochs": 16.0, "weight_decay": 0.3, "warmup_steps": 20, "batch_tokens": 2048},
         16.0),
    ]:  # fmt: skip
        eagle3 = settings.training_of(EAGLE3)
        assert eagle3 is settings.training
        assert {k: getattr(eagle3, k) for k in recipe} == recipe
        assert (eagle3.ttt_steps, eagle3.step_weight, eagle3.steps, eagle3.loss) == (7, 0.8, None, "soft_ce")
        # DFlash: the same, but for its own schedule.
        dflash = settings.training_of(DFLASH)
        assert dflash.model_dump() == eagle3.model_dump() | {"lr": 6e-4, "epochs": dflash_epochs, "weight_decay": 0.0}
    assert EAGLE3.recipe_fields == () and DFLASH.recipe_fields == ("lr", "epochs", "weight_decay")
    weights = Eagle3(TrainingSettings()).loss_weights(torch.tensor([5.0, 3.0, 1.0]))
    assert weights.tolist() == [1.0, 0.8, 0.8**2] and weights.dtype == torch.float64
    # The demo's DFlash: the references' recipe but 2 layers and 16 epochs (BENCHMARKS.md `dflash recipe`).
    d = demo_settings().dflash
    assert (d.num_layers, d.epochs, d.anchors_per_row, d.loss_decay, d.loss_normalization) == (2, 16.0, 512, 4.0, "token")


def test_rolling_mode_trains_dflash_once_over_each_shard_and_refuses_other_epochs():
    rolling = Settings(drafters=["eagle3", "dflash"], training=TrainingSettings(mode="rolling"))
    assert rolling.training_of(DFLASH).epochs == 1.0 and rolling.training_of(DFLASH).lr == 6e-4
    with pytest.raises(SettingsError) as e:
        parse_settings({"drafters": ["eagle3", "dflash"], "training": {"mode": "rolling"}, "dflash": {"epochs": 6}})
    assert str(e.value) == (
        "invalid settings in settings:\n  (top level): Value error, dflash.epochs: 6.0 in rolling mode, where each "
        "shard is deleted once trained; a second epoch would extract every shard again. Set dflash.epochs: 1 (or "
        "leave it out), or training.mode: offline"
    )


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3, 1, 2], "[3, 1, 2] is not ascending: vLLM feeds the drafter the target's layers in ascending order, so a "
         "drafter trained on this order would read them scrambled; write [1, 2, 3]"),
        ([1, 3, 3], "[1, 3, 3] names a layer twice"),
        ([], "no layer named; name at least one stored aux layer, or leave it unset for all of them"),
    ],
)  # fmt: skip
def test_dflash_layer_ids_out_of_order_are_refused_naming_the_setting_and_the_order_to_write(ids, message):
    with pytest.raises(SettingsError) as e:
        parse_settings({"drafters": ["eagle3", "dflash"], "aux_layer_ids": [1, 2, 3], "dflash": {"aux_layer_ids": ids}})
    assert str(e.value) == f"invalid settings in settings:\n  dflash.aux_layer_ids: Value error, {message}"
    assert parse_settings({"dflash": {"aux_layer_ids": [1, 3]}}).dflash.aux_layer_ids == [1, 3]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr", 0, "Input should be greater than 0"),
        ("epochs", -1, "Input should be greater than 0"),
        ("weight_decay", -0.1, "Input should be greater than or equal to 0"),
        ("loss_normalization", "sample", "Input should be 'token' or 'slot'"),
    ],
)
def test_dflash_recipe_settings_are_refused_naming_the_setting(field, value, message):
    with pytest.raises(SettingsError) as e:
        parse_settings({"dflash": {field: value}})
    assert str(e.value) == f"invalid settings in settings:\n  dflash.{field}: {message}"
