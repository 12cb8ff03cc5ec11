"""The demo target built under other float-kernel settings (issue 54, item 5): are its bytes the same?

MKL, ATen and oneDNN each pick their kernels by the CPU's instruction sets, and read the settings that restrict them
as they load, so each build runs in an interpreter of its own started with them. Prints one JSON line per setting:
the sha256 of `model.safetensors` (first 16 hex digits), the build's scores, and its seconds.

    .venv/bin/python benchmarks/bench_demo_isa.py [--steps 1500] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What a machine's instruction sets choose, set by hand: ATen's dispatch, oneDNN's, MKL's (its dispatch, and its
# conditional numerical reproducibility, CNR, which is meant to fix its results across CPUs).
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CNR_AVX2 = {"MKL_CBWR": "AVX2", **AVX2}
SETTINGS: dict[str, dict[str, str]] = {
    "native": {},
    "aten-onednn-avx2": AVX2,
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "mkl-cnr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl-cnr-avx2": {"MKL_CBWR": "AVX2"},
    "cnr-avx2-all": CNR_AVX2,
    "cnr-avx2-all-mkl-avx2-only": {**CNR_AVX2, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "cnr-avx2-all-mkl-avx512-only": {**CNR_AVX2, "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}

CHILD = """
import hashlib, json, sys, time
from pathlib import Path
import torch
from eagle3_assets.demo.target import build_demo_target
from eagle3_assets.settings import DemoSettings
out, steps = Path(sys.argv[1]), int(sys.argv[2])
started = time.monotonic()
info = build_demo_target(out, DemoSettings(train_steps=steps), log=lambda _: None)
print(json.dumps({
    "aten": torch.backends.cpu.get_cpu_capability(),
    "sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16],
    "template_accuracy": info.template_accuracy, "fact_accuracy_train": info.fact_accuracy_train,
    "fact_accuracy_heldout": info.fact_accuracy_heldout, "train_loss": info.train_loss,
    "seconds": round(time.monotonic() - started, 1),
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="the target's training steps (the demo's: 1500)")
    parser.add_argument("--only", nargs="*", choices=sorted(SETTINGS), help="these settings alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-demo-isa-") as tmp:
        for name in args.only or SETTINGS:
            env = os.environ | SETTINGS[name]
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(Path(tmp) / name), str(args.steps)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"setting": name, "env": SETTINGS[name], "steps": args.steps, **result}), flush=True)


if __name__ == "__main__":
    main()
