"""Shared fixtures: a tiny untrained demo target (seconds to build) and tiny pipeline settings."""

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
# 1 GiB of KV cache for every vLLM engine a test starts: the machine is shared, and the CPU build's default (a share of
# host memory, ~4 GiB here) costs ~25 s at each engine's start to set up (a Kimi-K2.5 miniature's server: 48 s to
# /health with the default, 22 s with 1 GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The target's file digests (`file_digests.py`) are cached in a directory of the test session, never the user's,
# removed when the process that made it exits (xdist's workers inherit the controller's).
if "EAGLE3_DIGEST_CACHE" not in os.environ:
    os.environ["EAGLE3_DIGEST_CACHE"] = tempfile.mkdtemp(prefix="eagle3-digests-")
    atexit.register(shutil.rmtree, os.environ["EAGLE3_DIGEST_CACHE"], ignore_errors=True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n 2` each worker owns one core's worth of compute: its torch, and every
    # process it starts (torchrun ranks, the start command), runs one thread, so two workers
    # do not oversubscribe the two cores. vLLM engines claim cores of their own (vllm_server/cores.py).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from eagle3_assets.settings import (  # noqa: E402
    DemoSettings,
    ExtractionSettings,
    GenerationSettings,
    Settings,
    TrainingSettings,
)

TINY_DEMO = DemoSettings(num_prompts=45, hidden_size=64, num_layers=4, head_dim=32, vocab_size=320, train_steps=0)


def tiny_settings(**overrides) -> Settings:
    """A demo pipeline small enough for an in-process test: 45 prompts in 20-row shards."""
    base = dict(
        demo=TINY_DEMO,
        shard_size=20,
        aux_layer_ids=[1, 2, 3],
        draft_vocab_size=64,
        max_seq_len=256,
        generation=GenerationSettings(max_new_tokens=8, batch_size=16, rows_per_part=16),
        extraction=ExtractionSettings(batch_tokens=2048, progress_interval_s=0.01),
        training=TrainingSettings(batch_tokens=512, warmup_steps=2, epochs=1.0, checkpoint_every=5, heldout_rows=4),
    )
    base.update(overrides)
    return Settings(**base)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    from eagle3_assets.demo.target import build_demo_target

    out = tmp_path_factory.mktemp("tiny-target") / "model"
    build_demo_target(out, TINY_DEMO, log=lambda _: None)
    return out


@pytest.fixture()
def small_tmpfs(tmp_path: Path):
    """A 64 KiB tmpfs of its own: a disk that really fills up, and can really be remounted read-only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# -- the suite's budget ---------------------------------------------------------------------------
# `make test` must finish within 25 minutes on 2 cores, install included (README). The closing lines
# say how much of it this run used, so the test that pushes past it is seen the day it lands. A report,
# not an assertion: a loaded machine must not fail the suite for being slow.
SUITE_BUDGET_S = 25 * 60
_suite_started = time.monotonic()
_test_seconds: dict[str, float] = {}


# The modules that take longest, longest first (their wall time in the 2026-12-05 fresh-clone `make test`: the
# small demo ~7 min, the provenance table ~6 min, ...). `make test` hands whole modules to its two workers in
# collection order (`--dist loadfile --no-loadscope-reorder`); starting the longest first keeps one worker from
# being handed the small demo when the other is nearly done, which left it running alone for minutes.
LONGEST_FIRST = (
    "test_demo_quality.py", "test_provenance.py", "test_start.py", "test_rolling.py", "test_stop.py",
    "test_real_target.py", "test_vllm_cores.py", "test_ui.py", "test_vllm_servers.py", "test_drafter_vllm.py",
    "test_import_end_to_end.py", "test_demo_target.py", "test_automation.py", "test_vllm_extraction.py", "test_pipeline.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller under xdist this sees every worker's reports: setup, call and teardown.
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _test_seconds or hasattr(config, "workerinput"):
        return
    wall = time.monotonic() - _suite_started
    workers = getattr(config.option, "numprocesses", None) or 1
    terminalreporter.write_sep("=", "suite budget")
    terminalreporter.write_line(
        f"{len(_test_seconds)} tests: {wall / 60:.1f} min wall of the {SUITE_BUDGET_S // 60}-minute budget for "
        f"`make test` ({wall / SUITE_BUDGET_S:.0%}; the install comes on top), on {workers} worker(s); "
        f"the tests' own time adds up to {sum(_test_seconds.values()) / 60:.1f} min"
    )
    if wall > SUITE_BUDGET_S:
        terminalreporter.write_line(
            "OVER BUDGET: make the slowest tests above cheaper (one build, many assertions; one engine, many questions)"
        )
