"""Qwen3, dense: per-head q/k norm, and the head tied to the embedding, as Qwen3's small models ship."""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape


def miniature(s: MiniatureShape) -> dict[str, Any]:
    heads = s.hidden_size // s.head_dim
    return {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.mlp_ratio * s.hidden_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": s.bos_token_id,
        "eos_token_id": s.eos_token_id,
        "pad_token_id": s.pad_token_id,
        "dtype": "float32",
    }


QWEN3 = Architecture(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    attention="gqa",
    moe=False,
    served_dtype="float32",
    miniature=miniature,
    description="dense, per-head q/k norm, tied embeddings",
)
