"""Write the servable DFlash drafter: `config.json`, `model.safetensors` and `mask_embedding.pt`, as vLLM loads them.

vLLM's DFlash loader (`qwen3_dflash.py`) is not strict about absence: a weight left out of the file loads without a
word and runs uninitialised (docs/DESIGN.md §6). `expected_dflash_tensors` is the one list of what an export holds
and its shapes; the export is refused, naming each tensor, when the drafter's state dict differs from it.

The mask embedding goes in `mask_embedding.pt` ({"mask_token_id", "embedding"}), the one file vLLM reads it from
(with `torch.load(weights_only=True)`: tensors and plain values only, no code).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle3_assets.drafter.dflash_model import DFlashConfig, DFlashDrafter
from eagle3_assets.drafter.export import (
    ExportError,
    checked_aux_ids,
    checked_tensors,
    publish_export,
    rotary_config,
    tensor_problems,
    trained_on_writer,
)
from eagle3_assets.storage import ArtifactStore

MASK_EMBEDDING_FILE = "mask_embedding.pt"


def expected_dflash_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in `model.safetensors` (no `model.` prefix: vLLM adds it). The embedding is left
    out (vLLM shares the target's), and so is `d2t` when the draft vocab is the whole vocab; `t2d` is kept beside
    `d2t` as our vocab map writes it (vLLM skips it)."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_aux_layers * h),
        "hidden_norm.weight": (h,),
    }
    for n in range(cfg.num_layers):
        layer = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        shapes |= {f"layers.{n}.{name}": shape for name, shape in layer.items()}
    shapes |= {
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.draft_vocab_size != cfg.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


def dflash_export_config(
    cfg: DFlashConfig,
    *,
    aux_layer_ids: list[int],
    dtype: str,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json: Qwen3 layers marked as a DFlash drafter, with the target layers its context reads."""
    ids = checked_aux_ids(aux_layer_ids, cfg.num_aux_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rotary_config(cfg.rope),
        # Rotate-half rotary, as trained (`model.apply_rotary`): a wrong layout lowers acceptance without an error.
        "is_neox_style": True,
        "max_position_embeddings": int(max_position_embeddings or cfg.max_position_embeddings),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        # The mask slots it trained with (vLLM serves num_speculative_tokens of them, which the engine sets).
        "block_size": cfg.block_size,
        # vLLM adds 1 to each id (it taps the residual stream after layer i): the "input of layer i + 1" we stored.
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in ids],
            "causal": False,
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def export_dflash(
    store: ArtifactStore,
    tensors: dict[str, torch.Tensor],
    cfg: DFlashConfig,
    *,
    aux_layer_ids: list[int],
    rel: str,
    dtype: str = "bfloat16",
    max_position_embeddings: int | None = None,
    trained_on: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> str:
    """Check `tensors` (`DFlashDrafter.trainable_state_dict()`), then publish `rel`/ in one step (with
    `trained_on.json` when given, and what `write_extra` adds); returns its URL."""
    tensors = dict(tensors)
    mask_embedding = tensors.pop("mask_embedding", None)
    if mask_embedding is None or tuple(mask_embedding.shape) != (cfg.hidden_size,):
        got = "missing" if mask_embedding is None else f"{list(mask_embedding.shape)}"
        raise ExportError(
            f"drafter export to {store.url_of(rel)} refused: mask_embedding is {got}, expected [{cfg.hidden_size}]"
        )
    tensors = checked_tensors(
        store,
        rel,
        tensors,
        expected_dflash_tensors(cfg),
        full_vocab=cfg.draft_vocab_size == cfg.vocab_size,
    )
    config = dflash_export_config(
        cfg,
        aux_layer_ids=aux_layer_ids,
        dtype=dtype,
        max_position_embeddings=max_position_embeddings,
    )

    write_trained_on = trained_on_writer(trained_on)

    def write_mask_embedding(directory: Path) -> None:
        embedding = mask_embedding.detach().float().cpu().contiguous()
        torch.save(
            {"mask_token_id": cfg.mask_token_id, "embedding": embedding},
            directory / MASK_EMBEDDING_FILE,
        )
        for write in (write_trained_on, write_extra):
            if write is not None:
                write(directory)

    return publish_export(store, rel, tensors, config, dtype, write_extra=write_mask_embedding)


def dflash_exported_config(config: dict[str, Any]) -> tuple[DFlashConfig, list[int]]:
    """(the drafter an export's config.json describes, the aux layer ids its context reads): `dflash_export_config`'s
    inverse."""
    dflash = config["dflash_config"]
    cfg = DFlashConfig(
        hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], num_aux_layers=len(dflash["target_layer_ids"]),
        num_layers=config["num_hidden_layers"], block_size=config["block_size"], mask_token_id=dflash["mask_token_id"],
        rms_norm_eps=config["rms_norm_eps"], rope=config["rope_parameters"],
        max_position_embeddings=config["max_position_embeddings"],
    )  # fmt: skip
    return cfg, [i + 1 for i in dflash["target_layer_ids"]]


def load_dflash_export(
    export_dir: str | Path, embed_tokens: torch.Tensor, cfg: DFlashConfig | None = None
) -> tuple[DFlashDrafter, list[int]]:
    """(drafter with float32 weights, the aux layer ids its context reads) from an export, as vLLM sees it, or in the
    drafter `cfg` describes (the one that trained: `served_replay`); `embed_tokens` is the target's embedding, which
    exports leave out."""
    export_dir = Path(export_dir)
    exported, aux_layer_ids = dflash_exported_config(json.loads((export_dir / "config.json").read_text()))
    cfg = cfg or exported
    tensors = load_file(str(export_dir / "model.safetensors"))
    if problems := tensor_problems(tensors, expected_dflash_tensors(cfg)):
        raise ExportError(f"{export_dir} is not a loadable DFlash export:\n  " + "\n  ".join(problems))
    mask = torch.load(export_dir / MASK_EMBEDDING_FILE, weights_only=True)
    tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    model = DFlashDrafter(cfg, tensors["d2t"], tensors["t2d"], embed_tokens=embed_tokens)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    weights["mask_embedding"] = mask["embedding"].float()
    model.load_state_dict(weights, strict=False)  # everything but the embedding, checked above
    return model.eval(), aux_layer_ids
