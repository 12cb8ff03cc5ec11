"""`drafter_eval`'s passes: vLLM's engine core in the eval interpreter vs a process of its own per pass.

Each pass of `drafter_eval` starts an engine (vLLM fixes the speculative config per engine), all in
one interpreter (`generate_runs_in_subprocess`). With `VLLM_ENABLE_V1_MULTIPROCESSING=1` (vLLM's
default) every engine also starts a core process, which starts Python and imports vLLM again; the
pipeline sets it to 0. Both modes run the same passes on the same target in the same run, in
alternation, best of `--repeat`; the outputs and acceptance counters must be identical.

Target: demo-shaped, untrained (4 layers, hidden 128, head_dim 32, vocab 1024); the drafter: an
untrained export of it, so the counters are real but low. Passes: plain, then the drafter at k=3, as
often as `--passes` asks.

`--pinning` compares instead the interpreter pinning itself to a one-core claim (`vllm.cpu_cores: 1`, as each engine
gets on a 2-core machine) before torch loads, as it does, against torch loaded first (a `sitecustomize` importing it,
as the module's top-level import did): torch threads set up before the pin ran the passes several times slower.

Run: .venv/bin/python benchmarks/bench_eval_engines.py [--passes 3] [--repeat 2] [--pinning]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
from alternating import best_of_alternating

from eagle3_assets.demo.target import build_demo_target
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.family import build_drafter
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess
from eagle3_assets.settings import DemoSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.vocab_map import VocabMap

AUX = (1, 2, 3)
PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 4, 6, 8, 10, 12, 14]]


def build(tmp: Path) -> tuple[Path, Path]:
    """An untrained demo-shaped target and an untrained drafter export of it (identity vocab map)."""
    target_dir = tmp / "target"
    build_demo_target(target_dir, DemoSettings(num_prompts=40, train_steps=0), log=lambda _: None)
    target = TargetModel.read(target_dir, aux_layer_ids=AUX)
    draft_vocab = 256
    t2d = np.zeros(target.vocab_size, dtype=bool)
    t2d[:draft_vocab] = True
    vmap = VocabMap(np.zeros(draft_vocab, dtype=np.int64), t2d)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=draft_vocab)
    drafter = build_drafter(cfg, load_target_weights(target), vmap, seed=0)
    store = ArtifactStore(tmp / "store")
    export_drafter(store, drafter.trainable_state_dict(), cfg, aux_layer_ids=AUX, dtype="float32")
    return target_dir, store.local_path(EXPORT_DIR)


def timed(target_dir: Path, runs: list[dict], env: dict[str, str], cpu_cores: int | None = None) -> tuple[float, list[dict]]:
    began = time.perf_counter()
    results = generate_runs_in_subprocess(
        target_dir, PROMPTS, runs, common={"max_tokens": 16, "max_model_len": 64}, env=env, cpu_cores=cpu_cores
    )
    # What must not depend on the mode: every field but the timings.
    untimed = [{k: v for k, v in r.to_json().items() if k not in ("seconds", "decode_tokens_per_s")} for r in results]
    return time.perf_counter() - began, untimed


def modes(tmp: Path, pinning: bool) -> dict[str, tuple[dict[str, str], int | None]]:
    """The two ways compared, by name: the environment and core claim of each."""
    if not pinning:
        return {
            "engine-core process per pass": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, None),
            "in the interpreter": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, None),
        }
    preload = tmp / "preload"
    preload.mkdir()
    (preload / "sitecustomize.py").write_text("import torch  # noqa: F401\n")
    path = os.pathsep.join([str(preload), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"torch loaded before the pin": ({"PYTHONPATH": path}, 1), "pinned before torch loads": ({}, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pinning", action="store_true", help="torch loaded before the core pin vs after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eval-engines-") as tmp:
        target_dir, export_dir = build(Path(tmp))
        runs = [{}] + [{"draft_dir": str(export_dir), "num_speculative_tokens": 3}] * (args.passes - 1)
        ways = {
            name: partial(timed, target_dir, runs, env, cores)
            for name, (env, cores) in modes(Path(tmp), args.pinning).items()
        }
        best, same = best_of_alternating(ways, args.repeat)
    (slow, a), (fast, b) = best.items()
    print(f"{args.passes} passes, best of {args.repeat}: {slow} {a:.1f} s, {fast} {b:.1f} s: {a / b:.2f}x; "
          f"outputs and counters identical: {same}")  # fmt: skip
    if not same:
        raise SystemExit("the two modes disagree")


if __name__ == "__main__":
    main()
