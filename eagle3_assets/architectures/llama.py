"""Llama: the demo's own target (and SmolLM2's, Llama 3's), dense, untied head."""

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
        "num_key_value_heads": heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": s.bos_token_id,
        "eos_token_id": s.eos_token_id,
        "pad_token_id": s.pad_token_id,
        "dtype": "float32",
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
