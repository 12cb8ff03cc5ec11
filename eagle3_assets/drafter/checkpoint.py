"""Resumable training state under `drafter/checkpoints/step_<n>/`, no pickles.

A checkpoint directory holds
  model.safetensors      the drafter's trainable tensors and d2t/t2d (no frozen embedding)
  optimizer.safetensors  AdamW moments and step counts, keyed `<param name>.<state key>`
  rng.safetensors        torch RNG states (uint8 tensors)
  state.json             step, next data position, scheduler state, optimizer hyper-
                         parameters, drafter config, aux layers, the run's fingerprint
It is assembled in a local temporary directory and published with one rename
(`ArtifactStore.put_dir`), so a directory under `checkpoints/` is complete or absent.
The last `KEEP_LAST` are kept.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.storage import ArtifactStore

CHECKPOINTS_DIR = "drafter/checkpoints"
CHECKPOINT_FORMAT = "eagle3-drafter-checkpoint/1"
KEEP_LAST = 2
_NAME = re.compile(r"^step_(\d+)$")


class CheckpointError(TrainingError):
    """A checkpoint that cannot be resumed from; the message names it and why."""


def checkpoint_rel(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/step_{step}"


def list_checkpoints(store: ArtifactStore) -> list[int]:
    """Steps with a published checkpoint, ascending."""
    return sorted(int(m.group(1)) for n in store.listdir(CHECKPOINTS_DIR) if (m := _NAME.match(n)))


def latest_checkpoint(store: ArtifactStore) -> str | None:
    steps = list_checkpoints(store)
    return checkpoint_rel(steps[-1]) if steps else None


@dataclass
class CheckpointState:
    """state.json, parsed: the one format of every weights directory under `checkpoints/` (a step's, `best/`)."""

    step: int
    state: dict[str, Any]

    @property
    def next_position(self) -> tuple[int, int]:
        p = self.state["next_position"]
        return int(p["epoch"]), int(p["batch"])

    @property
    def run(self) -> dict[str, Any]:
        """The fingerprint of the run that wrote it (`drafter/train.py`)."""
        return dict(self.state.get("run") or {})

    @property
    def world_size(self) -> int:
        return int(self.run.get("world_size", 1))


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], list]:
    """AdamW state as named tensors, and the param groups (hyperparameters) as JSON-able lists."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            tensors[f"{names[idx]}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return tensors, groups


def save_checkpoint(
    store: ArtifactStore,
    step: int,
    *,
    model_tensors: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
) -> str:
    """Publish `drafter/checkpoints/step_<step>` atomically, then drop all but the last KEEP_LAST.

    Refused (CheckpointError naming the tensors) when a weight is not finite: the last good
    checkpoint stays the newest, so a rerun resumes from it.
    """
    bad = non_finite(model_tensors)
    if bad:
        raise CheckpointError(
            f"step {step}: not checkpointed, {len(bad)} tensor(s) hold non-finite values ({', '.join(bad)}); "
            f"the newest checkpoint in {store.url_of(CHECKPOINTS_DIR)} is still the last good one"
        )
    names = dict(enumerate(param_names))
    opt_tensors, groups = _optimizer_tensors(optimizer, names)
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    body = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "optimizer_param_groups": groups,
        **state,
    }
    rel = checkpoint_rel(step)
    publish_weights(store, rel, model_tensors, body, optimizer=opt_tensors, rng=rng)
    for old in list_checkpoints(store)[:-KEEP_LAST]:
        store.remove(checkpoint_rel(old), recursive=True)
    return rel


class StagingFull(CheckpointError):
    """The local temporary directory a checkpoint is assembled in has no room for it; the message names the
    directory, its free bytes and the bytes needed. A retry meets the same full disk."""

    retryable = False


def _staging_full(store: ArtifactStore, rel: str, staging: str, needed: int, cause: str = "") -> StagingFull:
    try:
        free = f"{shutil.disk_usage(staging).free:,} bytes free"
    except OSError:
        free = "its free space unknown"
    newest = latest_checkpoint(store)
    return StagingFull(
        f"cannot assemble {store.url_of(rel)} in the local temporary directory {staging}: {free} there, "
        f"{needed:,} bytes needed{cause}. Free space there, or point TMPDIR at a larger disk; "
        + (f"the newest checkpoint, {store.url_of(newest)}, is intact" if newest else "no checkpoint was written")
    )


def _no_space(e: BaseException) -> bool:
    """Whether a write failed for want of space: an OSError, or safetensors' own error, which carries the OS error as
    text."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, SafetensorError) and ("os error 28" in str(e) or "StorageFull" in str(e))


def publish_weights(
    store: ArtifactStore, rel: str, model_tensors: dict[str, torch.Tensor], state: dict[str, Any], **more: dict[str, torch.Tensor]
) -> None:
    """`rel` made of `model.safetensors`, a `<name>.safetensors` for each of `more`, and `state.json` (format and step
    added), assembled in a local temporary directory and published as one (`ArtifactStore.put_dir`). A temporary
    directory without room for it refuses (`StagingFull`) before a byte is published, checked before writing and at
    each write: the checkpoints already published stay as they were."""
    body = {"format": CHECKPOINT_FORMAT, **state}
    files = {"model": {k: v.detach().cpu().contiguous() for k, v in model_tensors.items()}, **more}
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"
    # Each tensor's bytes, its header entry (~100 bytes) and the state: a floor, the write itself has the last word.
    needed = sum(t.numel() * t.element_size() + 128 for ts in files.values() for t in ts.values()) + len(text.encode())
    staging = tempfile.gettempdir()
    try:
        if shutil.disk_usage(staging).free < needed:
            raise _staging_full(store, rel, staging, needed)
    except OSError:
        pass  # its free space unknown: the write says
    with tempfile.TemporaryDirectory(prefix="drafter-weights-") as tmp:
        d = Path(tmp)
        try:
            for name, tensors in files.items():
                save_file(tensors, str(d / f"{name}.safetensors"))
            (d / "state.json").write_text(text)
        except (OSError, SafetensorError) as e:
            if _no_space(e):
                raise _staging_full(store, rel, staging, needed, f" (writing it failed: {e})") from None
            raise
        store.put_dir(d, rel)


def read_checkpoint_state(store: ArtifactStore, rel: str) -> CheckpointState:
    try:
        body = store.read_json(f"{rel}/state.json")
    except Exception as e:  # noqa: BLE001 - any failure means the same thing here
        raise CheckpointError(f"{store.url_of(rel)}: unreadable state.json: {e}") from e
    if body.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{store.url_of(rel)}: format {body.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return CheckpointState(int(body["step"]), body)


def read_model_tensors(store: ArtifactStore, rel: str) -> dict[str, torch.Tensor]:
    return st_load(store.read_bytes(f"{rel}/model.safetensors"))


def load_checkpoint(
    store: ArtifactStore,
    rel: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> CheckpointState:
    """Restore model, optimizer, scheduler and RNG from `rel`; returns its state.json."""
    ck = read_checkpoint_state(store, rel)
    tensors = read_model_tensors(store, rel)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise CheckpointError(f"{store.url_of(rel)}: model tensors missing {missing}, unexpected {unexpected}")
    opt_tensors = st_load(store.read_bytes(f"{rel}/optimizer.safetensors"))
    index = {n: i for i, n in enumerate(param_names)}
    groups = ck.state["optimizer_param_groups"]
    saved_names = [n for g in groups for n in g["params"]]
    if saved_names != param_names:
        raise CheckpointError(f"{store.url_of(rel)}: optimizer holds parameters {saved_names}, model has {param_names}")
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in opt_tensors.items():
        name, _, field = key.rpartition(".")
        opt_state.setdefault(index[name], {})[field] = value
    optimizer.load_state_dict(
        {
            "state": opt_state,
            "param_groups": [
                {**g, "params": [index[n] for n in g["params"]], "betas": tuple(g["betas"])} for g in groups
            ],
        }
    )
    scheduler.load_state_dict(ck.state["scheduler"])
    rng = st_load(store.read_bytes(f"{rel}/rng.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    return ck
