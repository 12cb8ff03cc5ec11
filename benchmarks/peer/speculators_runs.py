"""Run speculators' trainer (PyPI 0.9.0) from the project venv: its venv, one training run, the plan it matches.

Shared by the peer benchmarks (`bench_peer_speculators.py`: EAGLE-3; `bench_families.py`: DFlash). The trainer runs
in the peer venv (`setup_speculators_venv.sh`, `.peer/speculators/`) through `speculators_cpu.py`, on data
`convert_shards.py` wrote.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from speculators_cpu import STEP_LINE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafter_runs import log, steady  # noqa: E402

from eagle3_assets.drafter.data import index_samples, plan_epoch, split_heldout  # noqa: E402
from eagle3_assets.settings import TrainingSettings  # noqa: E402
from eagle3_assets.storage import ArtifactStore  # noqa: E402

PEER_DIR = Path(__file__).resolve().parent
PEER_VENV = PEER_DIR.parent.parent / ".peer" / "speculators"
SETUP_SCRIPT = PEER_DIR / "setup_speculators_venv.sh"
WRAPPER = PEER_DIR / "speculators_cpu.py"


def ensure_peer_venv() -> Path:
    """The peer venv's python, the venv built first if missing."""
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True)
    return PEER_VENV / "bin" / "python"


def train_speculators(
    py: Path, data_dir: Path, target_dir: Path, out: Path, flags: Sequence[str], *, threads: int
) -> dict:
    """Train in the peer venv (`speculators_cpu.py` with `flags` beside its data, target and output); the wrapper's
    result, `cpu_s_per_step_mean` as ours is taken (first step excluded), with where its log is."""
    cmd = [str(py), str(WRAPPER), "--data", str(data_dir), "--target", str(target_dir), "--out", str(out)]
    cmd += [*flags, "--threads", str(threads)]
    log_path = out.parent / f"{out.name}.log"
    log(f"speculators: training in the peer venv (log {log_path})")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # nothing of ours in the peer's interpreter
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=tempfile.gettempdir())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"speculators wrapper failed (exit {proc.returncode}):\n{tail}")
    r = json.loads(lines[-1])
    r["cpu_s_per_step_mean"] = steady(r["cpu_s_per_step"])
    r["log"] = str(log_path)
    return r


def cpu_per_step_so_far(log_path: Path) -> float:
    """Speculators' mean CPU seconds per step so far (first step excluded), from a running wrapper's log."""
    steps = [float(line.split()[-1]) for line in log_path.read_text().splitlines() if line.startswith(STEP_LINE)]
    if len(steps) < 2:
        raise RuntimeError(f"{log_path}: fewer than 2 speculators steps logged; cannot plan an equal-CPU run yet")
    return steady(steps)


def planned_tokens_per_step(store: ArtifactStore, keys: Sequence[str], settings: TrainingSettings) -> float:
    """The real (unpadded) tokens per optimizer step our run of `settings.steps` steps on shards `keys` will
    average, read off its batch plan (`plan_epoch` over the training rows `split_heldout` leaves)."""
    samples, _ = index_samples(store, list(keys))
    train_rows, _ = split_heldout(samples, settings.heldout_rows, settings.seed) if settings.heldout_rows else (samples, [])
    lengths = [s.length for s in train_rows]
    per_step: list[int] = []
    epoch = 0
    while len(per_step) < settings.steps:
        plan = plan_epoch(lengths, epoch, settings.seed, settings.batch_tokens, settings.batch_order)
        per_step += [sum(lengths[i] for i in batch) for batch in plan]
        epoch += 1
    return statistics.fmean(per_step[: settings.steps])
