"""gpt-oss: attention sinks, sliding-window and full attention layers alternating, MoE with a router bias and
biased experts under a clamped SwiGLU (`swiglu_limit`).

The miniature is gpt-oss unquantized (bf16, as the community BF16 checkpoints ship it; no MXFP4), at gpt-oss's
own head_dim and YaRN rope, with a window the demo's rows outgrow so the windowed layers are exercised.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.architectures.base import Architecture, MiniatureShape

HEAD_DIM = 64  # gpt-oss's own, whatever the demo's
# Shorter than most demo rows (a prompt of ~12 tokens and its answer, median 25 in all), so the HF-vs-vLLM check
# and the served drafter run through windowed layers.
SLIDING_WINDOW = 16
# gpt-oss's YaRN: 4,096 positions stretched 32 times; transformers warns unless max_position_embeddings says so.
ROPE_ORIGINAL_CONTEXT = 4096
ROPE_FACTOR = 32.0
EXPERTS = 8
EXPERTS_PER_TOKEN = 2


def miniature(s: MiniatureShape) -> dict[str, Any]:
    heads = max(1, s.hidden_size // HEAD_DIM)
    return s.common_fields(rms_norm_eps=1e-5) | {
        "intermediate_size": s.hidden_size,  # each expert's, as gpt-oss's (2880 and 2880)
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": HEAD_DIM,
        "sliding_window": SLIDING_WINDOW,
        # vLLM windows the even layers whatever `layer_types` says: declared so, as gpt-oss's config does.
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.num_layers)],
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "swiglu_limit": 7.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": ROPE_FACTOR,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT,
        },
        "max_position_embeddings": int(ROPE_ORIGINAL_CONTEXT * ROPE_FACTOR),
    }


GPT_OSS = Architecture(
    name="gpt_oss",
    hf_architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    attention="gqa",
    moe=True,
    served_dtype="bfloat16",
    miniature=miniature,
    # As gpt-oss's own config.json writes them beside the fields transformers keeps.
    config_extras={"experts_per_token": EXPERTS_PER_TOKEN, "initial_context_length": ROPE_ORIGINAL_CONTEXT},
    description="attention sinks, sliding window (16) on even layers and full attention on odd ones, 8 experts top 2 "
    "with router and expert biases, clamped SwiGLU (swiglu_limit 7); bf16, unquantized",
)
