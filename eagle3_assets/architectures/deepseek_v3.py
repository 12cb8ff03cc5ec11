"""DeepSeek-V3, the text model of Kimi-K2 and Kimi-K2.5: MLA attention and routed plus shared experts.

The miniature keeps what makes the architecture itself: queries and keys/values through low-rank latents
(`q_lora_rank`, `kv_lora_rank`), a decoupled rotary part (`qk_rope_head_dim`), a dense first layer
(`first_k_dense_replace`), then MoE layers with one shared expert and `noaux_tc` sigmoid routing.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape

# vLLM's CPU MLA kernels are compiled for one latent size: kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek-V3's
# and Kimi-K2's own 512 + 64; docs/DESIGN.md §6).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
MLA_HEAD_DIM = 64  # qk_nope_head_dim and v_head_dim


def miniature(s: MiniatureShape) -> dict[str, Any]:
    return s.common_fields() | {
        "intermediate_size": s.mlp_ratio * s.hidden_size,  # the dense first layer
        "moe_intermediate_size": s.hidden_size,
        "num_attention_heads": max(1, s.hidden_size // MLA_HEAD_DIM),
        "num_key_value_heads": max(1, s.hidden_size // MLA_HEAD_DIM),
        "q_lora_rank": s.hidden_size,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": MLA_HEAD_DIM,
        "v_head_dim": MLA_HEAD_DIM,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
    }


DEEPSEEK_V3 = Architecture(
    name="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    attention="mla",
    moe=True,
    served_dtype="bfloat16",
    miniature=miniature,
    # As DeepSeek-V3's and Kimi-K2's configs say it; without `topk_method` vLLM builds no
    # `e_score_correction_bias` and loading fails on it (docs/DESIGN.md §6).
    config_extras={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
    description="Kimi-K2's shape: MLA (latent 512 + 64), dense first layer, 8 routed experts top 2 + 1 shared, "
    "noaux_tc sigmoid routing",
)
