"""drafter_eval's vLLM passes under torch's GNU OpenMP ÷ under Intel's (`libiomp5` preloaded), the same run.

Serves a target plainly and with an EAGLE-3 export at k=3 on token-id prompts through `generate_runs_in_subprocess`
(drafter_eval's own path), once with `LD_PRELOAD` emptied and once with Intel's OpenMP preloaded
(`vllm_server/openmp.py`), and prints each pass's decode seconds and acceptance (BENCHMARKS.md `openmp`).

    .venv/bin/python benchmarks/bench_openmp.py TARGET_DIR EXPORT_DIR [--prompts 8] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os

from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess
from eagle3_assets.vllm_server.openmp import PRELOAD_ENV, openmp_env

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("export")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    prompts = [[1, 3, 50 + i, 60, 70, 2, 4] for i in range(args.prompts)]
    runs = [{}, {"draft_dir": args.export, "method": "eagle3", "num_speculative_tokens": 3}]
    common = {"max_tokens": args.max_tokens, "max_model_len": 512, "ignore_eos": False, "dtype": "auto"}
    gnu = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}
    for name, env in (("gnu", gnu), ("intel", {**gnu, **openmp_env(gnu)})):
        os.environ.clear()
        os.environ.update(env)
        results = generate_runs_in_subprocess(args.target, prompts, runs, common=common, timeout_s=1800)
        print(json.dumps({
            "openmp": name,
            "plain_s": round(results[0].seconds, 2),
            "k3_s": round(results[1].seconds, 2),
            "k3_acceptance": round(results[1].mean_acceptance_length, 4),
            "same_outputs": results[0].outputs == results[1].outputs,
        }), flush=True)  # fmt: skip
