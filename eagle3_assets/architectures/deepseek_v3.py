"""DeepSeek-V3, the text model of Kimi-K2 and Kimi-K2.5: MLA attention and routed plus shared experts.

The miniature keeps what makes the architecture itself: keys and values through one cached low-rank latent
(`kv_lora_rank`) with a decoupled rotary part (`qk_rope_head_dim`), a dense first layer (`first_k_dense_replace`),
then MoE layers with one shared expert and `noaux_tc` sigmoid routing.

Queries come straight from the hidden state (`q_lora_rank` None, as DeepSeek-V2-Lite has it; Kimi-K2 compresses them
through a 1,536-wide latent): at this size a query latent only slows learning, and what vLLM caches and its CPU MLA
kernel computes on is the same either way. Measured on the demo world, 600 target steps (the matrix leg's), mean loss
of the last 60 steps / template tasks right: with 2 heads of 64 and a 128-wide query latent 1.23 / 0.00; 4 heads of 32
and the latent 1.11 / 0.11; 4 heads of 32, no query latent 0.86 / 0.20 (the Llama: 0.36 / 0.41). The drafter's MLA
(`drafter/model.py`) and its export take either form.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape

# vLLM's CPU MLA kernels are compiled for one latent size: kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek-V3's
# and Kimi-K2's own 512 + 64; docs/DESIGN.md §6).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64


def miniature(s: MiniatureShape) -> dict[str, Any]:
    return s.common_fields() | {
        "intermediate_size": s.mlp_ratio * s.hidden_size,  # the dense first layer
        "moe_intermediate_size": s.hidden_size,
        "num_attention_heads": s.hidden_size // s.head_dim,
        "num_key_value_heads": s.hidden_size // s.head_dim,
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": s.head_dim,
        "v_head_dim": s.head_dim,
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
