"""Drafter families: what differs between EAGLE-3 and DFlash, over the one training loop, data path and checkpoints.

A family contributes its model, its objective and its export; everything else (the shards and their loader, the
target's head, checkpoints and resume, held-out evaluation, best-checkpoint selection, torchrun) is `train.py`'s and
shared. Both objectives return a `TTTOutput` with one entry per drafted position (EAGLE-3's TTT steps, DFlash's mask
slots), scored by the same code, so their loss, acc_k and acceptance estimates mean the same thing.

What the pipeline names a family by (its assets, store directory, pool, vLLM method) is its spec's
(`eagle3_assets/families.py`); each trainer here carries its spec. Each family keeps its outputs (checkpoints, best
weights, TensorBoard, export, metrics) in a store directory of its own, `spec.root`: EAGLE-3 at the store's top, where
drafters were written before there were families (its layout and history stay), DFlash under `families/dflash/`,
with the same layout inside.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from safetensors.torch import load as st_load
from torch import nn

from eagle3_assets.drafter.data import Batch
from eagle3_assets.drafter.dflash_export import (
    MASK_EMBEDDING_FILE,
    dflash_exported_config,
    export_dflash,
    load_dflash_export,
)
from eagle3_assets.drafter.dflash_loss import dflash_forward, slot_weights
from eagle3_assets.drafter.dflash_model import DFlashConfig, DFlashDrafter
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.export import export_drafter, exported_config, load_export
from eagle3_assets.drafter.imported_release import dflash_import_differences, import_differences
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.target_head import Targets, TargetWeights
from eagle3_assets.drafter.ttt import TTTOutput, ttt_forward
from eagle3_assets.families import DFLASH, EAGLE3, FamilySpec
from eagle3_assets.settings import DFlashSettings, Settings, TrainingSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer
from eagle3_assets.vocab_map import VocabMap


# Blocks drafted in one forward when a DFlash drafter's rounds are replayed (`DFlash.drafted`).
REPLAY_ANCHORS = 256


class Family(Protocol):
    spec: ClassVar[FamilySpec]
    name: str  # `spec.name`
    root: str  # `spec.root`: the store directory of its outputs ("" = the store's top)
    steps: int  # drafted positions scored per prediction point: acc_0 .. acc_{steps-1}
    training: TrainingSettings  # the training settings it trains by: the shared ones, its own recipe over them

    def loss_weights(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 [steps]: the coefficient of each drafted position's mean loss in the loss, `positions` [steps] the
        positions each mean is over (all ranks'): how a loss over several batches or ranks is put together."""
        ...

    def build(self, target: TargetModel, weights: TargetWeights, vmap: VocabMap, aux_layer_ids: Sequence[int],
              seed: int, intermediate_size: int | None) -> nn.Module: ...  # fmt: skip

    def objective(self, model: nn.Module, batch: Batch, targets: Targets, step: int | None) -> TTTOutput:
        """The loss and counts of `batch`; `step` (the optimizer step, None when evaluating) seeds any sampling."""
        ...

    def aux_layer_ids(self, stored: Sequence[int]) -> list[int]:
        """The aux layers the drafter reads, of those the shards hold."""
        ...

    def export(self, store: ArtifactStore, tensors: dict[str, torch.Tensor], cfg: Any, aux_layer_ids: list[int],
               rel: str, trained_on: dict[str, Any] | None = None) -> str: ...  # fmt: skip

    def warm_start(self, model: nn.Module, store: ArtifactStore, rel: str) -> None:
        """Load an export of this family (`rel` in `store`: the release) into `model`, as float32."""
        ...

    def import_differences(self, store: ArtifactStore, target: TargetModel, vmap: VocabMap) -> list[str]:
        """Each way the release imported into `store` (`imported_release.py`) differs from the drafter `build` makes
        on `vmap`, naming both values and the setting; empty when `warm_start` loads it into that drafter."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """The family's own settings, part of what a checkpoint must agree on to be resumed."""
        ...

    def served_as(self, cfg: Any, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        """What an engine must read from the export to serve the drafter as it trained (`cfg` the trained config,
        `aux_layer_ids` the stored layers): recorded with the export (`trained_on.json`, `SERVED_AS`)."""
        ...

    def export_says(self, export_dir: Path) -> dict[str, Any]:
        """`served_as` as the export's config.json tells it to an engine."""
        ...

    def load_as(
        self, export_dir: Path, embed_tokens: torch.Tensor, served_as: dict[str, Any]
    ) -> tuple[nn.Module, list[int]]:
        """(the export's weights in the drafter `served_as` describes, float32 in eval mode; the target layers it
        reads, in the order it reads them)."""
        ...

    def drafted(self, model: nn.Module, input_ids: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
        """int64 [k, T]: the target id `model` drafts at position a of a speculative round whose last verified index is
        t, on one row: input_ids [1, T], aux [1, T, A] the target's features of the layers `load_as` names
        (`served_replay.replay_rounds`)."""
        ...


def _start_lm_head(model: Eagle3Drafter | DFlashDrafter, weights: TargetWeights, train: bool) -> None:
    """lm_head from the target's rows of the draft vocab, the layer the drafter's output feeds at serving time, so
    early steps already rank tokens sensibly (and stay there when it is frozen)."""
    cfg = model.config
    with torch.no_grad():
        model.lm_head.weight.copy_(weights.lm_head[model.d2t + torch.arange(cfg.draft_vocab_size)].float())
    model.lm_head.weight.requires_grad_(train)


def build_drafter(
    cfg: DrafterConfig, target: TargetWeights, vmap: VocabMap, seed: int, *, train_lm_head: bool = True
) -> Eagle3Drafter:
    """A fresh EAGLE-3 drafter: seeded init, the target's embedding copied in (frozen), lm_head from the target's."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=target.embed_tokens.clone())
    _start_lm_head(model, target, train_lm_head)
    return model


class _Specified:
    spec: ClassVar[FamilySpec]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def root(self) -> str:
        return self.spec.root


@dataclass(frozen=True)
class Eagle3(_Specified):
    spec: ClassVar[FamilySpec] = EAGLE3
    settings: TrainingSettings

    @property
    def steps(self) -> int:
        return self.settings.ttt_steps

    @property
    def training(self) -> TrainingSettings:
        return self.settings

    def loss_weights(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.settings.step_weight**k for k in range(len(positions))], dtype=torch.float64)

    def build(
        self, target: TargetModel, weights: TargetWeights, vmap: VocabMap, aux_layer_ids: Sequence[int], seed: int,
        intermediate_size: int | None,
    ) -> Eagle3Drafter:
        cfg = self.drafter_config(target, vmap, intermediate_size)
        return build_drafter(cfg, weights, vmap, seed, train_lm_head=self.settings.train_lm_head)

    def drafter_config(
        self, target: TargetModel, vmap: VocabMap, intermediate_size: int | None = None
    ) -> DrafterConfig:
        """The shape and norms `build` gives the drafter: an imported release is continued only into this one."""
        s = self.settings
        return DrafterConfig.from_target(
            target, draft_vocab_size=len(vmap.d2t), intermediate_size=intermediate_size,
            norm_before_fc=s.norm_before_fc, norm_before_residual=s.norm_before_residual, norm_output=s.norm_output,
        )  # fmt: skip

    def objective(self, model: nn.Module, batch: Batch, targets: Targets, step: int | None) -> TTTOutput:
        s = self.settings
        return ttt_forward(
            model, batch.input_ids, batch.aux, batch.loss_mask, batch.lengths, targets, num_steps=s.ttt_steps,
            step_weight=s.step_weight, loss=s.loss, loss_positions=s.loss_positions, positions=batch.positions,
            segments=batch.segments,
        )  # fmt: skip

    def aux_layer_ids(self, stored: Sequence[int]) -> list[int]:
        return list(stored)

    def export(
        self, store: ArtifactStore, tensors: dict[str, torch.Tensor], cfg: DrafterConfig, aux_layer_ids: list[int],
        rel: str, trained_on: dict[str, Any] | None = None,
    ) -> str:
        return export_drafter(store, tensors, cfg, aux_layer_ids=aux_layer_ids, rel=rel, trained_on=trained_on)

    def warm_start(self, model: nn.Module, store: ArtifactStore, rel: str) -> None:
        # The export's names are `trainable_state_dict`'s, less `d2t` when the draft vocab is the full vocab.
        load_export_weights(model, st_load(store.read_bytes(f"{rel}/model.safetensors")), store.url_of(rel))

    def import_differences(self, store: ArtifactStore, target: TargetModel, vmap: VocabMap) -> list[str]:
        return import_differences(store, self.drafter_config(target, vmap), target.aux_layer_ids, vmap)

    def fingerprint(self) -> dict[str, Any]:
        return {}  # its settings are the training settings themselves (`fingerprint.run_fingerprint`)

    def served_as(self, cfg: DrafterConfig, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        return cfg.to_dict() | {"aux_layer_ids": list(aux_layer_ids)}

    def export_says(self, export_dir: Path) -> dict[str, Any]:
        config = json.loads((export_dir / "config.json").read_text())
        return self.served_as(exported_config(config, export_dir), config["eagle_aux_hidden_state_layer_ids"])

    def load_as(
        self, export_dir: Path, embed_tokens: torch.Tensor, served_as: dict[str, Any]
    ) -> tuple[Eagle3Drafter, list[int]]:
        cfg = DrafterConfig(**{k: v for k, v in served_as.items() if k != "aux_layer_ids"})
        model, _ = load_export(export_dir, embed_tokens, cfg)
        return model, list(served_as["aux_layer_ids"])

    @torch.no_grad()
    def drafted(self, model: nn.Module, input_ids: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
        # Step a of the unroll at index t is the round's a-th draft: step 0 reads the target's features at t.
        return torch.stack([_target_ids(model, logits[0]) for logits in model(input_ids, aux.float(), k)])


@dataclass
class DFlash(_Specified):
    spec: ClassVar[FamilySpec] = DFLASH
    training: TrainingSettings  # `Settings.training_of(DFLASH)`: its own schedule over the shared settings
    dflash: DFlashSettings
    mask_token_id: int
    # Which stored aux columns the context reads: set by `build`, once the shards' layers are known.
    _columns: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long), repr=False)

    @property
    def steps(self) -> int:
        return self.dflash.block_size

    def loss_weights(self, positions: torch.Tensor) -> torch.Tensor:
        return slot_weights(positions, self.dflash.loss_decay, self.dflash.loss_normalization)

    def build(
        self, target: TargetModel, weights: TargetWeights, vmap: VocabMap, aux_layer_ids: Sequence[int], seed: int,
        intermediate_size: int | None,
    ) -> DFlashDrafter:
        cfg = self.drafter_config(target, vmap, aux_layer_ids, intermediate_size)
        torch.manual_seed(seed)
        model = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=weights.embed_tokens.clone())
        _start_lm_head(model, weights, self.training.train_lm_head)
        self._columns = _aux_columns(aux_layer_ids, self.aux_layer_ids(aux_layer_ids), target.hidden_size)
        return model

    def drafter_config(
        self, target: TargetModel, vmap: VocabMap, stored: Sequence[int], intermediate_size: int | None = None
    ) -> DFlashConfig:
        """The shape `build` gives the drafter over the `stored` aux layers: an imported release is continued only
        into this one."""
        d = self.dflash
        return DFlashConfig.from_target(
            target, draft_vocab_size=len(vmap.d2t), num_aux_layers=len(self.aux_layer_ids(stored)),
            intermediate_size=intermediate_size, num_layers=d.num_layers, block_size=d.block_size,
            mask_token_id=self.mask_token_id,
        )  # fmt: skip

    def objective(self, model: nn.Module, batch: Batch, targets: Targets, step: int | None) -> TTTOutput:
        s, d = self.training, self.dflash
        # A fresh draw per optimizer step, fixed by (seed, step): a resumed run draws the anchors it would have.
        gen = None if step is None else torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        return dflash_forward(
            model, batch.input_ids, batch.aux.index_select(-1, self._columns.to(batch.aux.device)), batch.loss_mask,
            batch.lengths, targets, loss_decay=d.loss_decay, anchors_per_row=None if step is None else d.anchors_per_row,
            normalization=d.loss_normalization, generator=gen, loss=s.loss, loss_positions=s.loss_positions,
            positions=batch.positions, segments=batch.segments,
        )  # fmt: skip

    def aux_layer_ids(self, stored: Sequence[int]) -> list[int]:
        wanted = list(self.dflash.aux_layer_ids or stored)
        if missing := [i for i in wanted if i not in stored]:
            raise TrainingError(
                f"dflash.aux_layer_ids: layers {missing} are not in the stored hidden states (aux_layer_ids "
                f"{list(stored)}); store them (aux_layer_ids holds every layer any family reads) or read a subset"
            )
        return wanted

    def export(
        self, store: ArtifactStore, tensors: dict[str, torch.Tensor], cfg: DFlashConfig, aux_layer_ids: list[int],
        rel: str, trained_on: dict[str, Any] | None = None,
    ) -> str:
        return export_dflash(
            store, tensors, cfg, aux_layer_ids=self.aux_layer_ids(aux_layer_ids), rel=rel, trained_on=trained_on
        )

    def warm_start(self, model: nn.Module, store: ArtifactStore, rel: str) -> None:
        tensors = st_load(store.read_bytes(f"{rel}/model.safetensors"))
        # The mask embedding ships beside the weights, in the one file vLLM reads it from.
        mask = torch.load(io.BytesIO(store.read_bytes(f"{rel}/{MASK_EMBEDDING_FILE}")), weights_only=True)
        tensors["mask_embedding"] = mask["embedding"]
        load_export_weights(model, head_on_map(tensors, model.d2t.cpu(), model.t2d.cpu()), store.url_of(rel))

    def import_differences(self, store: ArtifactStore, target: TargetModel, vmap: VocabMap) -> list[str]:
        stored = target.aux_layer_ids
        built = self.drafter_config(target, vmap, stored)
        return dflash_import_differences(store, built, self.aux_layer_ids(stored), vmap)

    def fingerprint(self) -> dict[str, Any]:
        return {"dflash": self.dflash.model_dump(), "mask_token_id": self.mask_token_id}

    def served_as(self, cfg: DFlashConfig, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        # Rotate-half rotary is what trained (`model.apply_rotary`); vLLM takes the layout from the config.
        return cfg.to_dict() | {"aux_layer_ids": self.aux_layer_ids(aux_layer_ids), "is_neox_style": True}

    def export_says(self, export_dir: Path) -> dict[str, Any]:
        config = json.loads((export_dir / "config.json").read_text())
        cfg, aux_layer_ids = dflash_exported_config(config)
        return cfg.to_dict() | {"aux_layer_ids": aux_layer_ids, "is_neox_style": config.get("is_neox_style")}

    def load_as(
        self, export_dir: Path, embed_tokens: torch.Tensor, served_as: dict[str, Any]
    ) -> tuple[DFlashDrafter, list[int]]:
        cfg = DFlashConfig(**{k: v for k, v in served_as.items() if k not in ("aux_layer_ids", "is_neox_style")})
        model, _ = load_dflash_export(export_dir, embed_tokens, cfg)
        return model, list(served_as["aux_layer_ids"])

    @torch.no_grad()
    def drafted(self, model: nn.Module, input_ids: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
        # The block at anchor t is the round's draft: its slot a proposes index t + 2 + a. Anchors go in chunks: each
        # block's k + 1 queries attend to the whole context, so every anchor of a long row at once would not fit.
        drafted = []
        for chunk in torch.arange(input_ids.shape[1] - 1, device=input_ids.device).split(REPLAY_ANCHORS):
            blocks = model(input_ids, aux.float(), chunk[None], block_size=k)  # k x [1, anchors, Vd]
            drafted.append(torch.stack([_target_ids(model, logits[0]) for logits in blocks]))
        return torch.cat([*drafted, torch.full((k, 1), -1, device=input_ids.device)], dim=1)  # [k, T]: none at T - 1


def _target_ids(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """[..., Vd] draft logits -> the target ids of their argmax, through the drafter's d2t."""
    best = logits.argmax(-1)
    return best + model.d2t[best]


def load_export_weights(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy an export's tensors into `model` (float32, the training dtype), refusing one that does not fit: other
    names or shapes, or another vocab map (a head is never continued on a map it was not trained with)."""
    own = model.trainable_state_dict()
    tensors = dict(tensors)
    if "d2t" in own and "d2t" not in tensors:  # left out of an export whose draft vocab is the full vocab
        tensors["d2t"] = torch.zeros_like(own["d2t"])
    problems = [f"missing tensor {n}" for n in own if n not in tensors]
    problems += [f"unexpected tensor {n}" for n in sorted(tensors) if n not in own]
    problems += [
        f"tensor {n} is {list(t.shape)}, the model's {list(own[n].shape)}"
        for n, t in tensors.items() if n in own and t.shape != own[n].shape
    ]  # fmt: skip
    problems += [f"{n} differs: another vocab map" for n in ("d2t", "t2d") if n in own and not problems
                 and not torch.equal(tensors[n].to(own[n].dtype), own[n].cpu())]  # fmt: skip
    if problems:
        raise TrainingError(f"cannot continue from {where}: " + "; ".join(problems))
    with torch.no_grad():
        for n, t in own.items():
            t.copy_(tensors[n].to(device=t.device, dtype=t.dtype))


def head_on_map(tensors: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """An export's `tensors` with its head on the vocab map (`d2t`, `t2d`): its `lm_head` rows for that map's draft
    tokens, which its own map must hold. A DFlash import drafts over the whole vocabulary through the target's own
    head, so on the store's smaller map it starts from the rows a fresh head would (`_start_lm_head`), every other
    weight as published; on its own map it is as it was."""
    rows = tensors["lm_head.weight"].shape[0]
    own = torch.arange(rows) + tensors.get("d2t", torch.zeros(rows, dtype=torch.long)).long()  # draft id -> target id
    if torch.equal(own, torch.arange(len(d2t)) + d2t.long()):
        return tensors
    row_of = torch.full((len(t2d),), -1, dtype=torch.long)
    row_of[own] = torch.arange(rows)
    picked = row_of[torch.arange(len(d2t)) + d2t.long()]
    if (outside := torch.nonzero(picked < 0).flatten()).numel():
        first = int(outside[0] + d2t[outside[0]])
        raise TrainingError(
            f"the release cannot continue on the store's vocab map: {outside.numel()} of its draft tokens (the first, "
            f"target id {first}) are not among the release's {rows} draft ids"
        )
    return tensors | {"lm_head.weight": tensors["lm_head.weight"][picked], "d2t": d2t.clone(), "t2d": t2d.clone()}


def _aux_columns(stored: Sequence[int], wanted: Sequence[int], hidden: int) -> torch.Tensor:
    """Column indices of the `wanted` layers' features in the stored [.., len(stored) x H] aux, in `wanted` order."""
    return torch.cat([torch.arange(hidden) + stored.index(i) * hidden for i in wanted])


def mask_token_id(settings: DFlashSettings, target: TargetModel) -> int:
    """`dflash.mask_token_id`, or the target tokenizer's pad token (a token the text never holds): the mask slots'
    id, whose embedding the drafter trains and ships (`mask_embedding.pt`)."""
    if settings.mask_token_id is not None:
        return settings.mask_token_id
    tokenizer = load_tokenizer(target)
    for name in ("pad_token_id", "unk_token_id"):
        if (token := getattr(tokenizer, name, None)) is not None:
            return int(token)
    raise TrainingError(
        f"dflash.mask_token_id: the tokenizer of {target.path} has no pad or unk token to stand for the mask slots; "
        "set it to the id of a token the text never holds"
    )


# Each family's trainer under the settings, by its spec's name: one line per family.
TRAINERS: dict[str, Callable[[Settings, TargetModel], Family]] = {
    EAGLE3.name: lambda s, _: Eagle3(s.training),
    DFLASH.name: lambda s, target: DFlash(s.training_of(DFLASH), s.dflash, mask_token_id(s.dflash, target)),
}


def family_of(spec: FamilySpec, settings: Settings, target: TargetModel) -> Family:
    """The family of `spec`, as it trains under these settings."""
    if spec.name not in TRAINERS:
        raise TrainingError(f"drafter family {spec.name!r} has no trainer: add its line to drafter/family.py's TRAINERS")
    return TRAINERS[spec.name](settings, target)
