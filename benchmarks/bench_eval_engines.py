"""`drafter_eval`'s passes: vLLM's engine core in the eval interpreter vs a process of its own per pass.

Each pass of `drafter_eval` starts an engine (vLLM fixes the speculative config per engine), all in
one interpreter (`generate_runs_in_subprocess`). With `VLLM_ENABLE_V1_MULTIPROCESSING=1` (vLLM's
default) every engine also starts a core process, which starts Python and imports vLLM again; the
pipeline sets it to 0. Both modes run the same passes on the same target in the same run, in
alternation, best of `--repeat`; the outputs and acceptance counters must be identical.

Target: demo-shaped, untrained (4 layers, hidden 128, head_dim 32, vocab 1024); the drafter: an
untrained export of it, so the counters are real but low. Passes: plain, then the drafter at k=3, as
often as `--passes` asks.

Run: .venv/bin/python benchmarks/bench_eval_engines.py [--passes 3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

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


def timed(target_dir: Path, runs: list[dict], core_process: bool) -> tuple[float, list[dict]]:
    began = time.perf_counter()
    results = generate_runs_in_subprocess(
        target_dir, PROMPTS, runs, common={"max_tokens": 16, "max_model_len": 64},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if core_process else "0"},
    )  # fmt: skip
    return time.perf_counter() - began, [r.to_json() for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eval-engines-") as tmp:
        target_dir, export_dir = build(Path(tmp))
        runs = [{}] + [{"draft_dir": str(export_dir), "num_speculative_tokens": 3}] * (args.passes - 1)
        best = {True: float("inf"), False: float("inf")}
        outputs: dict[bool, list[dict]] = {}
        for _ in range(args.repeat):
            for core_process in (True, False):
                seconds, outputs[core_process] = timed(target_dir, runs, core_process)
                best[core_process] = min(best[core_process], seconds)
        same = outputs[True] == outputs[False]
    print(f"{args.passes} passes, best of {args.repeat}: engine-core process per pass {best[True]:.1f} s, "
          f"in the interpreter {best[False]:.1f} s: {best[True] / best[False]:.2f}x; "
          f"outputs and counters identical: {same}")  # fmt: skip
    if not same:
        raise SystemExit("the two modes disagree: the in-interpreter engine core must not be used")


if __name__ == "__main__":
    main()
