"""A phase's vLLM server on the CPU build: its worker in a process of its own vs in the engine core's.

vLLM 0.32's CPU platform forces the multiprocessing executor while `VLLM_ENABLE_V1_MULTIPROCESSING` is 1 (its
default), so even one device gets a worker process beside the engine core, a third interpreter that imports torch and
vLLM again. `VllmServer.start` sets it to 0 on the CPU build (`vllm_server.server.cpu_env`): the worker runs in the
engine core's process, as on one GPU. Both ways start the same server (`generate` role, the test settings: eager, 1 GiB
of KV cache) on the same target, in alternation, best of `--repeat`, from `start()` to `/health`; each then completes
the same prompts greedily, and the completions must be identical.

Target: demo-shaped, untrained (4 layers, hidden 128, head_dim 32, vocab 1024).

Run: .venv/bin/python benchmarks/bench_server_start.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path

from alternating import best_of_alternating

from eagle3_assets.demo.target import build_demo_target
from eagle3_assets.settings import DemoSettings, VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.client import http_json
from eagle3_assets.vllm_server.server import VllmServer

PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 4, 6, 8, 10, 12, 14]]
MODES = {
    "worker process of its own": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "worker in the engine core": {},  # the pipeline's own environment
}


def started(target: TargetModel, env: dict[str, str]) -> tuple[float, list[str]]:
    vllm = VllmSettings(dtype="float32", max_model_len=64, cpu_kv_cache_gib=1, extra_args=["--enforce-eager"])
    began = time.perf_counter()
    with VllmServer.start(target, vllm, "generate", env=env) as server:
        seconds = time.perf_counter() - began
        body = {"model": str(target.path), "prompt": PROMPTS, "max_tokens": 16, "temperature": 0.0}
        texts = [c["text"] for c in sorted(http_json(f"{server.url}/v1/completions", body, timeout=120)["choices"], key=lambda c: c["index"])]
    return seconds, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-server-start-") as tmp:
        build_demo_target(Path(tmp), DemoSettings(num_prompts=40, train_steps=0), log=lambda _: None)
        target = TargetModel.read(Path(tmp), aux_layer_ids=(1, 2, 3))
        best, same = best_of_alternating({name: partial(started, target, env) for name, env in MODES.items()}, args.repeat)
    (slow, a), (fast, b) = best.items()
    print(f"server start to /health, best of {args.repeat}: {slow} {a:.1f} s, {fast} {b:.1f} s: {a / b:.2f}x; "
          f"completions identical: {same}")  # fmt: skip
    if not same:
        raise SystemExit("the two ways disagree")


if __name__ == "__main__":
    main()
