"""The `dflash` settings section: the DFlash block drafter's shape and its own training recipe.

Kept out of `settings.py` (one field there names this section): a family's section is its own file, as its model, loss
and export are. The defaults are the reference DFlash recipe (z-lab's DFlash and the peers that train it: 5 draft
layers, 512 anchors a row, loss decay 4 normalized per token, lr 6e-4, 6 epochs, no weight decay); the demo trains 2
layers for 16 epochs, as measured by served acceptance (`settings.demo_settings`, BENCHMARKS.md `dflash recipe`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle3_assets.section import Section


# How slot k's mean loss enters the block loss (`dflash_loss.slot_weights`).
LossNormalization = Literal["token", "slot"]


class DFlashSettings(Section):
    """The DFlash block drafter (`drafters: [..., dflash]`), trained from the same shards as EAGLE-3. The training
    settings (`training`) hold for it too, except EAGLE-3's recipe (ttt_steps, step_weight and the norm options) and the
    schedule fields this section holds in their stead (`FamilySpec.recipe_fields`: lr, epochs, weight_decay)."""

    block_size: int = Field(
        7, ge=1, description="mask slots per block: the tokens it drafts per target forward, at most the speculative "
        "tokens it is served with (drafter_eval serves 3 and 7, so at least 7)",
    )  # fmt: skip
    num_layers: int = Field(
        5, ge=1, description="draft layers, each shaped like one of the target's (reference drafters use 5 to 8)"
    )
    anchors_per_row: int = Field(
        512, ge=1, description="blocks drawn per training row, at trained answer positions; a row with fewer takes "
        "every one, so each answer token of a short row is slot 1's target once per epoch",
    )  # fmt: skip
    loss_decay: float = Field(
        4.0, gt=0.0, description="block slot k (0-based) is weighted exp(-k / loss_decay) (the reference's gamma: 4 "
        "for blocks of 8 tokens, 7 for 16)",
    )  # fmt: skip
    loss_normalization: LossNormalization = Field(
        "token", description="token: the weighted loss is a mean over every scored slot of every block (the "
        "reference's form: a slot scored at fewer positions, past a short answer's end, weighs less); slot: a "
        "weighted sum of each slot's own mean (what EAGLE-3 does over its TTT steps)",
    )  # fmt: skip
    lr: float = Field(6e-4, gt=0.0, description="peak learning rate (in place of training.lr)")
    epochs: float = Field(
        6.0, gt=0.0, description="passes over the training rows (in place of training.epochs; training.steps, when "
        "set, is every family's schedule; rolling mode trains each shard once)",
    )  # fmt: skip
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (in place of training.weight_decay)")
    mask_token_id: int | None = Field(
        None, ge=0, description="the id the mask slots carry (its embedding is trained and shipped); None = the "
        "target tokenizer's pad token",
    )  # fmt: skip
    aux_layer_ids: list[int] | None = Field(
        None, description="the stored aux layers its context reads (a subset of aux_layer_ids, ascending); None = all "
        "of them",
    )  # fmt: skip

    @field_validator("aux_layer_ids")
    @classmethod
    def _ascending(cls, ids: list[int] | None) -> list[int] | None:
        # vLLM hands the drafter the target's layers concatenated in layer order, whatever order the export names
        # them in: a drafter trained on another order would read every layer in another's place, with no error.
        if ids is None:
            return None
        if not ids:
            raise ValueError("no layer named; name at least one stored aux layer, or leave it unset for all of them")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{ids} names a layer twice")
        if ids != sorted(ids):
            raise ValueError(
                f"{ids} is not ascending: vLLM feeds the drafter the target's layers in ascending order, so a drafter "
                f"trained on this order would read them scrambled; write {sorted(ids)}"
            )
        return ids
