"""Does vLLM's CPU build compute a DeepSeek-V3 (MLA) model as transformers does? (BENCHMARKS.md `mla agreement`)

Builds a random two-layer, all-dense DeepSeek-V3 (MLA: latent 512 + rope 64, the only size the CPU MLA kernels take;
weights drawn at std 0.08 so the log-probs are far from uniform), saves it in bf16, and prints the largest difference
in per-token prompt log-probs between transformers (float32 and bf16) and vLLM (bf16) over 36 positions, for the
engine as the pipeline starts it (`vllm_server.command.compilation_config`: the native rotary, since vLLM 0.32's CPU
rotary kernel mis-rotates MLA's 3-D multi-head query) or, with `--vllm-own`, as vLLM starts it by itself (one engine
per run: a process keeps the custom-op choice of its first engine). bf16 alone moves them by ~0.02; the first position
(which attends only to itself) agrees either way.

    .venv/bin/python benchmarks/mla_hf_vs_vllm.py [--vllm-own] [--theta 10000] [--out /tmp/mla-probe]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompt_logprobs_hf(model_dir: str, ids: list[int], dtype: str) -> list[float]:
    import torch
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def prompt_logprobs_vllm(model_dir: str, ids: list[int], compilation_config: dict | None) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="auto", enforce_eager=True, max_model_len=128, seed=0, skip_tokenizer_init=True,
              compilation_config=compilation_config)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return [d[ids[i]].logprob for i, d in enumerate(out.prompt_logprobs) if d is not None]


def main() -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle3_assets.target import TargetModel, read_config
    from eagle3_assets.vllm_server.command import compilation_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--theta", type=float, default=10000.0, help="rope_theta (1e12: rotation almost none)")
    parser.add_argument("--out", default="/tmp/mla-probe")
    parser.add_argument("--vllm-own", action="store_true", help="vLLM's own engine, not the pipeline's")
    args = parser.parse_args()
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, intermediate_size=256, first_k_dense_replace=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": args.theta},
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model.to(torch.bfloat16).save_pretrained(args.out)
    ids = list(range(3, 40))
    hf32, hf16 = prompt_logprobs_hf(args.out, ids, "float32"), prompt_logprobs_hf(args.out, ids, "bfloat16")
    engine = "vllm_own" if args.vllm_own else "vllm_as_the_pipeline_starts_it"
    target = TargetModel.from_config(read_config(args.out), path=args.out)
    vllm = prompt_logprobs_vllm(args.out, ids, None if args.vllm_own else compilation_config(target))
    worst = lambda a, b: max(abs(x - y) for x, y in zip(a, b, strict=True))  # noqa: E731
    print(json.dumps({
        "rope_theta": args.theta,
        "max_abs_dlogprob_hf_bf16_vs_hf_fp32": round(worst(hf16, hf32), 3),
        f"max_abs_dlogprob_{engine}_vs_hf_bf16": round(worst(vllm, hf16), 3),
        "first_position": [round(hf32[0], 3), round(vllm[0], 3)],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
