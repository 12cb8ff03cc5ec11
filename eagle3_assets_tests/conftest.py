"""Shared fixtures: a tiny untrained demo target (seconds to build) and tiny pipeline settings."""

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

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
