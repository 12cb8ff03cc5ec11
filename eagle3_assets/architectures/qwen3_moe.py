"""Qwen3-MoE: per-head q/k norm, every layer routed through experts (softmax top-k), no shared expert."""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape


def miniature(s: MiniatureShape) -> dict[str, Any]:
    heads = s.hidden_size // s.head_dim
    return s.common_fields() | {
        "intermediate_size": s.mlp_ratio * s.hidden_size,
        "moe_intermediate_size": s.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": s.head_dim,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    }


QWEN3_MOE = Architecture(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    attention="gqa",
    moe=True,
    served_dtype="bfloat16",
    miniature=miniature,
    description="per-head q/k norm, grouped-query attention, 8 experts top 2 on every layer",
)
