"""The vLLM plugin that lets every vLLM process use AMX (`eagle3_assets/vllm_plugin.py`): on a Xeon with AMX, vLLM's
CPU attention kernel killed the engine with SIGILL without it (the Qwen3-MoE leg of test_architectures.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path


def test_vllm_finds_it_among_the_plugins_it_runs_in_every_process():
    assert "eagle3_assets.vllm_plugin:request_amx" in [e.value for e in entry_points(group="vllm.general_plugins")]


def test_a_process_may_use_amx_once_it_ran_where_the_cpu_has_it_and_not_before():
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    has_amx = sys.platform == "linux" and "amx_tile" in flags
    probe = (
        "from eagle3_assets.vllm_plugin import amx_permitted, request_amx; "
        "print(amx_permitted(), request_amx(), amx_permitted())"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", str(has_amx), str(has_amx)]
