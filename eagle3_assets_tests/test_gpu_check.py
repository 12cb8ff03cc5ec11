"""The prepared GPU check cannot rot: its --dry-run runs every path (extraction through the HF
backend and extract_shard, drafter training steps, the loader, 2 data-parallel gloo ranks) at toy
sizes on the CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_path_at_toy_sizes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    (ex,) = report["extraction"]
    assert ex["rows"] == 8 and ex["tokens"] > 0 and ex["bytes_written"] > 0
    # Every written byte is accounted for: bf16 hidden states, ids and mask, and the headers.
    assert 4 * 64 * 2 + 5 < ex["bytes_per_token"] < 4 * 64 * 2 * 2
    assert [(t["shape"], t["seq_len"], t["ttt_steps"]) for t in report["training"]] == [("toy", 32, 7), ("toy", 64, 7)]
    assert all(t["tokens_per_s"] > 0 and math.isfinite(t["mfu"]) for t in report["training"])
    (ld,) = report["loader"]
    assert ld["samples"] == 8 and ld["loader_over_training"] > 0
    (dp,) = report["data_parallel"]
    assert (dp["shape"], dp["ranks"], dp["seq_len_per_rank"]) == ("toy", 2, 64)
    assert dp["tokens_per_s_all_ranks"] > 0 and dp["scaling"] > 0
    assert "extract toy tokens/s" in proc.stdout and "loader toy samples/s" in proc.stdout
    assert "train toy x2 ranks tokens/s, scaling" in proc.stdout
