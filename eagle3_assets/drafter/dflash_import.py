"""Import a published DFlash drafter in z-lab's layout as this project's DFlash export (issue 53, item 1).

The layout, as the `dflash` package (z-lab/dflash, PyPI 0.1.0) saves its `DFlashDraftModel` and vLLM serves it: a
Qwen3 config marked `architectures: ["DFlashDraftModel"]`, with `dflash_config` {`mask_token_id`, `target_layer_ids`},
`block_size` and `num_target_layers`; weights `fc.weight`, `hidden_norm.weight`, `layers.N.*` (Qwen3 layers, q/k
norms) and `norm.weight`. It ships no head and no embedding: its blocks are the target's embeddings of the anchor token
and of `mask_token_id`, and it drafts through the target's `lm_head` over the whole vocabulary. `target_layer_ids`
name the layers whose output it reads (z-lab and vLLM tap `hidden_states[id + 1]`): this project's "input of layer
id + 1" aux ids, the ones the shards store.

Converted, it computes the same: its weights bit for bit under the same names, `lm_head` the target's (a draft
vocabulary of the whole vocabulary, `d2t` the identity), `mask_embedding` the target's row of the mask token. Refused
before anything runs, each naming both values and the file: another architecture (DFlash2's selector and
convolutions), an option this project's DFlash drafter has not (attention biases, causal or sliding-window blocks, a
logit multiplier or soft cap, an embedding scale), the hidden size, the vocabulary, the target's layer count, a mask
token outside the vocabulary, target layers the shards do not store, and every weight missing, unused or misshaped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.drafter.dflash_export import expected_dflash_tensors, export_dflash
from eagle3_assets.drafter.dflash_model import DFlashConfig
from eagle3_assets.drafter.export import dtype_name, tensor_problems
from eagle3_assets.drafter.import_formats import ImportRefusal, Source
from eagle3_assets.drafter.target_head import TargetWeights
from eagle3_assets.families import DFLASH
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, rope_parameters

# What z-lab's model reads from its config that this project's DFlash drafter has not, with the value that means "off".
_OFF = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0, "causal": False}


@dataclass(frozen=True)
class ImportedDFlash:
    """A published DFlash drafter converted to our DFlash export: what the release is written from."""

    source: str
    digest: str  # sha256 over its files (`Source.digest`)
    files: dict[str, str]
    cfg: DFlashConfig
    aux_layer_ids: list[int]  # the stored ("input of layer i") ids its context reads
    tensors: dict[str, torch.Tensor]  # `DFlashDrafter.trainable_state_dict()`'s names, the source's dtype
    dtype: str
    notes: list[str] = field(default_factory=list)
    format: str = "dflash"
    family: str = DFLASH.name

    def provenance(self) -> dict[str, Any]:
        """Where it came from, for `release.json`."""
        return {"source": self.source, "format": self.format, "sha256": self.digest, "files": dict(self.files),
                "dropped": [], "notes": list(self.notes)}  # fmt: skip

    def publish(self, store: ArtifactStore, rel: str, write_extra: Callable[[Path], None]) -> str:
        return export_dflash(store, self.tensors, self.cfg, aux_layer_ids=self.aux_layer_ids, rel=rel,
                             dtype=self.dtype, write_extra=write_extra)  # fmt: skip


def import_dflash(source: Source, target: TargetModel, weights: TargetWeights) -> ImportedDFlash:
    """`source` (read by `import_formats.read_source`, in z-lab's layout) as our DFlash export for `target`, whose
    `weights` lend it the head and the mask token's embedding; ImportRefusal naming what does not fit."""
    cfg, ids = dflash_config_of(source.config, target, source.config_url)
    if "lm_head.weight" in source.tensors:
        raise ImportRefusal(
            f"imported drafter: it ships its own lm_head.weight {list(source.tensors['lm_head.weight'].shape)} (this "
            "project's DFlash export layout, not z-lab's, which drafts through the target's head): importing that "
            f"layout is not supported yet; serve it as evaluation.reference_drafter instead ({source.weights_url})"
        )
    dtype = source.tensors["fc.weight"].dtype if "fc.weight" in source.tensors else torch.bfloat16
    lent = {"lm_head.weight": weights.lm_head.to(dtype), "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool)}
    tensors = dict(source.tensors) | lent
    if problems := tensor_problems(tensors, expected_dflash_tensors(cfg)):
        raise ImportRefusal(
            f"imported drafter: its weights do not fit this project's DFlash drafter ({source.weights_url}): "
            + "; ".join(problems)
        )
    tensors["mask_embedding"] = weights.embed_tokens[cfg.mask_token_id].to(dtype)
    notes = [
        f"drafts through the target's lm_head over its whole vocabulary ({cfg.vocab_size} ids); its mask slots are the "
        f"target's embedding of token {cfg.mask_token_id}, as published"
    ]
    return ImportedDFlash(source=source.url, digest=source.digest, files=source.files, cfg=cfg, aux_layer_ids=ids,
                          tensors=tensors, dtype=dtype_name(dtype), notes=notes)  # fmt: skip


def dflash_config_of(config: dict[str, Any], target: TargetModel, where: str) -> tuple[DFlashConfig, list[int]]:
    """(our DFlash drafter's config, the stored aux ids its context reads) for a z-lab config, or ImportRefusal."""

    def refuse(what: str) -> ImportRefusal:
        return ImportRefusal(f"imported drafter: {what} ({where})")

    dflash = dict(config.get("dflash_config") or {})
    for name, off in _OFF.items():
        value = dflash.get(name, config.get(name, off))
        if value != off:
            raise refuse(f"{name} is {value!r}, which this project's DFlash drafter does not have")
    if config.get("attention_bias"):
        raise refuse("attention_bias is true, which this project's DFlash drafter does not have")
    if sliding := [t for t in config.get("layer_types") or [] if t != "full_attention"]:
        raise refuse(
            f"layer_types holds {sliding[0]!r}: causal, windowed attention in the block, which this project's DFlash "
            "drafter has not (its blocks attend to the whole context and to themselves)"
        )
    for name, theirs, ours in (
        ("hidden_size", config.get("hidden_size"), target.hidden_size),
        ("vocab_size", config.get("vocab_size"), target.vocab_size),
        ("num_target_layers", config.get("num_target_layers", target.num_layers), target.num_layers),
    ):
        if theirs != ours:
            raise refuse(f"{name} {theirs} does not match the target's {ours}")
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise refuse(f"dflash_config.mask_token_id {mask!r} is no id of the target's {target.vocab_size}")
    layer_ids = dflash.get("target_layer_ids")
    if not layer_ids:
        raise refuse("dflash_config.target_layer_ids is not stated")
    ids = [int(i) + 1 for i in layer_ids]  # the output of layer i is the input of layer i + 1: our stored ids
    if ids != sorted(set(ids)):
        raise refuse(f"dflash_config.target_layer_ids {layer_ids} is not ascending: vLLM feeds them in layer order")
    if missing := [i - 1 for i in ids if i not in target.aux_layer_ids]:
        raise refuse(
            f"dflash_config.target_layer_ids {layer_ids} reads the output of layers {missing}, which the shards do not "
            f"store (aux_layer_ids {list(target.aux_layer_ids)}, inputs of layers); set aux_layer_ids to hold "
            f"{ids} and dflash.aux_layer_ids: {ids}"
        )
    try:
        cfg = DFlashConfig(
            hidden_size=target.hidden_size, num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or target.hidden_size // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"], vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size, num_aux_layers=len(ids), num_layers=config["num_hidden_layers"],
            block_size=int(dflash.get("block_size", config.get("block_size", 16))), mask_token_id=mask,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope=rope_parameters(config),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )  # fmt: skip
    except (KeyError, ValueError) as e:
        raise refuse(f"{e}") from None
    return cfg, ids
