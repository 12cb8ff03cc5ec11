"""What a checkpoint must agree on to be resumed: the run's fingerprint, saved in every checkpoint
(`drafter/train.py`). A checkpoint whose fingerprint differs from this run's belongs to another run, and what differs
is named leaf by leaf."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from eagle3_assets.artifacts import TRAINING_VOLATILE
from eagle3_assets.settings import TrainingSettings


def run_fingerprint(
    settings: TrainingSettings,
    shard_keys: Sequence[str],
    num_train: int,
    num_heldout: int,
    world_size: int,
    total_steps: int,
    inputs: Mapping[str, str] | None = None,
    family: Mapping[str, Any] | None = None,
    continued_from: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: the data plan, the schedule, the versions of the data
    (`inputs`: the target, tokenized rows and vocab map it trains on, docs/DESIGN.md §9) and the family's own
    settings (`Family.fingerprint`; none for EAGLE-3, whose recipe is the training settings). A continuation
    (`continuation.py`) adds the release it started from and its replay: a killed one resumes, and neither a
    from-scratch checkpoint nor one continued from another release is taken for it."""
    s = settings.model_dump()
    for volatile in TRAINING_VOLATILE:
        s.pop(volatile)
    return {
        **({"family": dict(family)} if family else {}),
        **({"continued_from": dict(continued_from)} if continued_from else {}),
        "inputs": dict(inputs or {}),
        "settings": s,
        "shards": list(shard_keys),
        "train_samples": num_train,
        "heldout_samples": num_heldout,
        "world_size": world_size,
        "total_steps": total_steps,
    }


# Settings added after runs were first checkpointed, with the behaviour runs had before them:
# a checkpoint without one of these keys ran that way, and resumes when the setting asks for it.
SETTINGS_ADDED_LATER: dict[str, Any] = {
    "norm_before_fc": False,
    "norm_before_residual": False,
    "norm_output": False,
    "train_lm_head": True,
    "loss": "soft_ce",
    "loss_positions": "predicted",
    "adam_beta2": 0.95,
    "batch_order": "by_length",
    "mode": "offline",
}


def with_settings_added_later(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A saved run fingerprint with the behaviour of settings it predates filled in (a checkpoint from before
    inputs were recorded has none: its data is unknown, so it resumes no run that names its inputs). Settings that
    became volatile since it was saved (`sample_ledger`) are dropped from it as from a run's."""
    saved = {k: v for k, v in fingerprint.get("settings", {}).items() if k not in TRAINING_VOLATILE}
    return {"inputs": {}, **fingerprint, "settings": SETTINGS_ADDED_LATER | saved}


def differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Each leaf where a saved fingerprint and this run's differ, as "settings.lr: checkpoint 0.0001, now 0.0003"."""
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
    return out
