"""Qwen3, dense: per-head q/k norm, and the head tied to the embedding, as Qwen3's small models ship."""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape


def miniature(s: MiniatureShape) -> dict[str, Any]:
    heads = s.hidden_size // s.head_dim
    return s.common_fields(tie_word_embeddings=True) | {
        "intermediate_size": s.mlp_ratio * s.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": s.head_dim,
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
