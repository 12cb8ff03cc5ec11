"""Llama: the demo's own target (and SmolLM2's, Llama 3's), dense, untied head."""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape


def miniature(s: MiniatureShape) -> dict[str, Any]:
    heads = s.hidden_size // s.head_dim
    return s.common_fields(rms_norm_eps=1e-5) | {
        "intermediate_size": s.mlp_ratio * s.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": s.head_dim,
    }


LLAMA = Architecture(
    name="llama",
    hf_architecture="LlamaForCausalLM",
    model_type="llama",
    attention="gqa",
    moe=False,
    served_dtype="float32",
    miniature=miniature,
    description="dense, grouped-query attention, untied head",
)
