"""Train the drafter on stored hidden states: guard, resume, TTT steps, checkpoints, TensorBoard.

Entry point `train_drafter(...)`. One process trains on CPU or one GPU. Data-parallel
over several GPUs (DistributedDataParallel; each rank a slice of the batches, metrics
summed over ranks, only rank 0 writing checkpoints, TensorBoard and the export):

    EAGLE3_CONFIG=run.yaml EAGLE3_ROOT=s3://bucket/eagle3 \
        torchrun --nproc-per-node 8 -m eagle3_assets.drafter.train --target /models/kimi

(`main` below; any script calling `train_drafter` under torchrun works the same, it
reads WORLD_SIZE / RANK / LOCAL_RANK). `training.batch_tokens` is per optimizer step
over all ranks: each rank's batches hold batch_tokens / WORLD_SIZE tokens.

A run killed at any point continues from the newest checkpoint when called again with
the same inputs: same step counter, same data order, the loss curve continues.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from eagle3_assets.drafter.checkpoint import (
    CHECKPOINTS_DIR,
    CheckpointError,
    checkpoint_rel,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from eagle3_assets.drafter.data import (
    Batch,
    BatchLoader,
    DataPosition,
    SampleFormat,
    SampleRef,
    heldout_batches,
    index_samples,
    require_complete_shards,
    split_heldout,
)
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.target_head import TargetHead, TargetWeights, load_target_weights
from eagle3_assets.drafter.ttt import TTTOutput, ttt_forward
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore

TENSORBOARD_DIR = "drafter/tensorboard"
ADAM_BETAS = (0.9, 0.95)

MetricsCallback = Callable[[int, dict[str, float]], None]
LogFn = Callable[[str], None]


# -- process setup --------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(setting: str, env: DistEnv) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise TrainingError("training.device is 'cuda' but no CUDA device is visible")
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _init_distributed(env: DistEnv, device: torch.device) -> bool:
    """Join the process group torchrun describes; True when this call created it (and so must destroy it)."""
    if env.world_size <= 1 or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


# -- model and schedule -----------------------------------------------------------


def build_drafter(
    cfg: DrafterConfig, target: TargetWeights, d2t: torch.Tensor, t2d: torch.Tensor, seed: int
) -> Eagle3Drafter:
    """A fresh drafter: seeded init, the target's embedding copied in (frozen), and lm_head
    started from the target's lm_head rows of the draft vocab, the layer the drafter's
    output feeds at serving time, so early steps already rank tokens sensibly."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, d2t, t2d, embed_tokens=target.embed_tokens.clone())
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head[model.d2t + torch.arange(cfg.draft_vocab_size)].float())
    return model


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR factor: linear warmup to 1 over `warmup_steps`, then cosine to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


# -- metrics ----------------------------------------------------------------------


@dataclass
class StepCounts:
    """Sums over ranks and batches, from which loss/acc_k are reported."""

    loss_sum: torch.Tensor  # [K] sum over batches of step losses
    correct: torch.Tensor  # [K]
    kept: torch.Tensor  # [K]
    batches: int = 0

    @classmethod
    def zeros(cls, k: int) -> StepCounts:
        zeros = torch.zeros(k, dtype=torch.int64)
        return cls(torch.zeros(k, dtype=torch.float64), zeros, zeros.clone())

    def add(self, out: TTTOutput) -> None:
        self.loss_sum += out.step_losses.detach().double().cpu()
        self.correct += out.correct.cpu()
        self.kept += out.kept.cpu()
        self.batches += 1

    def all_reduce(self) -> StepCounts:
        if not (dist.is_available() and dist.is_initialized()):
            return self
        packed = torch.cat([self.loss_sum, self.correct.double(), self.kept.double(), torch.tensor([float(self.batches)])])
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        packed = packed.to(backend_device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        k = len(self.kept)
        return StepCounts(packed[:k], packed[k : 2 * k].long(), packed[2 * k : 3 * k].long(), int(packed[-1]))

    def metrics(self, step_weight: float, prefix: str = "") -> dict[str, float]:
        losses = self.loss_sum / max(self.batches, 1)
        m = {f"{prefix}loss": float(sum(step_weight**k * losses[k] for k in range(len(losses))))}
        for k in range(len(losses)):
            m[f"{prefix}loss_{k}"] = float(losses[k])
            m[f"{prefix}acc_{k}"] = float(self.correct[k]) / max(int(self.kept[k]), 1)
        return m


@torch.no_grad()
def evaluate(
    model: Eagle3Drafter,
    head: TargetHead,
    loader: BatchLoader,
    batches: Sequence[Sequence[int]],
    *,
    num_steps: int,
    step_weight: float,
    device: torch.device,
) -> dict[str, float]:
    """loss/acc_k over `batches` of `loader`'s samples (all ranks' shares summed)."""
    model.eval()
    counts = StepCounts.zeros(num_steps)
    for idx in batches:
        b = loader.load(idx).to(device)
        targets = head.targets(b.last, b.pre_norm, model.t2d)
        with _autocast(device):
            out = ttt_forward(
                model, b.input_ids, b.aux, b.loss_mask, b.lengths, targets, num_steps=num_steps, step_weight=step_weight
            )
        counts.add(out)
    model.train()
    return counts.all_reduce().metrics(step_weight)


def _autocast(device: torch.device):
    # bf16 matmuls on GPU (params and optimizer stay fp32); exact fp32 on CPU.
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


# -- TensorBoard --------------------------------------------------------------------


class _TensorBoard:
    """Event files under `drafter/tensorboard/`: written in place on a local store; on a remote
    one written locally and copied (as `run_from_step_<n>/`) at each checkpoint and at the end."""

    def __init__(self, store: ArtifactStore, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.store = store
        local = store.local_path(TENSORBOARD_DIR)
        self._tmp: Path | None = None
        if local is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="drafter-tb-"))
            self.remote_rel = f"{TENSORBOARD_DIR}/run_from_step_{start_step}"
            log_dir = self._tmp
        else:
            local.mkdir(parents=True, exist_ok=True)
            log_dir = local
        # purge_step drops events a killed run logged after its last checkpoint, so the
        # curve TensorBoard draws is the one the resumed run continues.
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"drafter/{k}", v, step)

    def sync(self) -> None:
        self.writer.flush()
        if self._tmp is not None:
            self.store.put_dir(self._tmp, self.remote_rel)

    def close(self) -> None:
        self.sync()
        self.writer.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


# -- the run --------------------------------------------------------------------------


@dataclass
class TrainResult:
    step: int  # optimizer steps done, over all calls
    total_steps: int  # steps the settings ask for
    finished: bool  # step == total_steps (False when stopped by max_steps)
    metrics: dict[str, float]  # the last step's metrics (from the checkpoint when this call ran no step)
    heldout: dict[str, float]  # loss / acc_k over the held-out rows, when finished and any are held out
    checkpoint: str  # the newest checkpoint directory (store-relative)
    resumed_from: int | None  # step of the checkpoint this call started from
    config: DrafterConfig
    aux_layer_ids: list[int]
    model: Eagle3Drafter = field(repr=False)  # trained, on CPU


def run_fingerprint(
    settings: TrainingSettings,
    shard_keys: Sequence[str],
    num_train: int,
    num_heldout: int,
    world_size: int,
    total_steps: int,
) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: the data plan and the schedule."""
    s = settings.model_dump()
    for volatile in ("checkpoint_every", "device"):
        s.pop(volatile)
    return {
        "settings": s,
        "shards": list(shard_keys),
        "train_samples": num_train,
        "heldout_samples": num_heldout,
        "world_size": world_size,
        "total_steps": total_steps,
    }


def _diff(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
    return out


def _check_inputs(fmt: SampleFormat, target: TargetWeights, d2t: torch.Tensor, t2d: torch.Tensor, target_dir: str) -> None:
    hidden, vocab = int(target.config["hidden_size"]), int(target.config["vocab_size"])
    if fmt.hidden_size != hidden:
        raise TrainingError(
            f"hidden states are {fmt.hidden_size} wide but the target at {target_dir} has hidden_size {hidden}"
        )
    if t2d.shape != (vocab,):
        raise TrainingError(f"vocab map t2d has {t2d.shape[0]} entries, the target vocabulary {vocab}")
    if not torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(len(d2t))):
        raise TrainingError("vocab map: nonzero(t2d) != d2t + arange(draft_vocab); d2t and t2d disagree")


@dataclass
class _Run:
    """What one call of train_drafter holds while it trains."""

    store: ArtifactStore
    settings: TrainingSettings
    env: DistEnv
    device: torch.device
    fmt: SampleFormat
    cfg: DrafterConfig
    model: Eagle3Drafter
    step_model: nn.Module  # the model, wrapped in DistributedDataParallel when WORLD_SIZE > 1
    head: TargetHead
    loader: BatchLoader
    heldout: list[SampleRef]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    param_names: list[str]
    total_steps: int
    fingerprint: dict[str, Any]

    def train_step(self, batch: Batch) -> tuple[dict[str, float], float]:
        """One optimizer step; (metrics summed over ranks, learning rate used)."""
        b = batch.to(self.device)
        s = self.settings
        targets = self.head.targets(b.last, b.pre_norm, self.model.t2d)
        with _autocast(self.device):
            out = ttt_forward(
                self.step_model, b.input_ids, b.aux, b.loss_mask, b.lengths, targets,
                num_steps=s.ttt_steps, step_weight=s.step_weight,
            )
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        counts = StepCounts.zeros(s.ttt_steps)
        counts.add(out)
        metrics = counts.all_reduce().metrics(s.step_weight)
        metrics.update(lr=lr, grad_norm=float(grad_norm), tokens=float(batch.num_tokens * self.env.world_size))
        return metrics, lr

    def checkpoint(self, step: int, next_pos: DataPosition, metrics: dict[str, float], tb: _TensorBoard | None) -> str:
        """Rank 0 publishes the checkpoint; every rank waits for it."""
        rel = checkpoint_rel(step)
        if self.env.is_main:
            save_checkpoint(
                self.store, step, model_tensors=self.model.trainable_state_dict(), optimizer=self.optimizer,
                param_names=self.param_names, scheduler=self.scheduler,
                state={
                    "next_position": {"epoch": next_pos.epoch, "batch": next_pos.batch},
                    "run": self.fingerprint,
                    "drafter_config": self.cfg.to_dict(),
                    "aux_layer_ids": list(self.fmt.aux_layer_ids),
                    "metrics": metrics,
                },
            )
            if tb is not None:
                tb.sync()
        if dist.is_initialized():
            dist.barrier()
        return rel

    def train_until(
        self,
        stop_at: int,
        step: int,
        pos: DataPosition,
        *,
        tb: _TensorBoard | None,
        on_metrics: MetricsCallback | None,
        log: LogFn,
        log_every: int,
    ) -> tuple[int, dict[str, float], str]:
        """Steps from `step` (data from `pos`) to `stop_at`; (step, last metrics, last checkpoint)."""
        self.model.train()
        metrics: dict[str, float] = {}
        ckpt = ""
        t_last = time.perf_counter()
        with contextlib.closing(self.loader.iterate(pos)) as batches:
            for pos, batch in batches:
                metrics, lr = self.train_step(batch)
                step += 1
                now = time.perf_counter()
                epoch = pos.epoch + (pos.batch + 1) / self.loader.steps_in_epoch(pos.epoch)
                metrics.update(epoch=epoch, seconds=now - t_last)
                t_last = now
                if tb is not None:  # rank 0
                    tb.scalars(step, metrics)
                    if on_metrics is not None:
                        on_metrics(step, metrics)
                    if step % log_every == 0 or step == stop_at:
                        accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.settings.ttt_steps))
                        log(f"drafter: step {step}/{self.total_steps} loss {metrics['loss']:.4f} acc_k {accs} lr {lr:.2e}")
                if step % self.settings.checkpoint_every == 0 or step == stop_at:
                    ckpt = self.checkpoint(step, self.loader.position_after(pos), metrics, tb)
                if step >= stop_at:
                    break
        return step, metrics, ckpt

    def evaluate_heldout(self) -> dict[str, float]:
        s, env = self.settings, self.env
        budget = max(1, s.batch_tokens // env.world_size)
        loader = BatchLoader(self.store, self.heldout, batch_tokens=s.batch_tokens, seed=s.seed, world_size=env.world_size)
        return evaluate(
            self.model, self.head, loader, heldout_batches(self.heldout, budget, env.rank, env.world_size),
            num_steps=s.ttt_steps, step_weight=s.step_weight, device=self.device,
        )


def _prepare(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    *,
    env: DistEnv,
    device: torch.device,
    d2t: np.ndarray | torch.Tensor,
    t2d: np.ndarray | torch.Tensor,
    target_dir: str | Path,
    settings: TrainingSettings,
    intermediate_size: int | None,
    data_workers: int,
) -> _Run:
    samples, fmt = index_samples(store, shard_keys)
    train_samples, held = (samples, [])
    if settings.heldout_rows:
        train_samples, held = split_heldout(samples, settings.heldout_rows, settings.seed)
    d2t = torch.as_tensor(np.asarray(d2t), dtype=torch.int64)
    t2d = torch.as_tensor(np.asarray(t2d), dtype=torch.bool)
    target = load_target_weights(target_dir)
    _check_inputs(fmt, target, d2t, t2d, str(target_dir))
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=len(d2t), intermediate_size=intermediate_size)
    model = build_drafter(cfg, target, d2t, t2d, settings.seed).to(device)
    head = TargetHead.from_weights(target).to(device)
    loader = BatchLoader(
        store, train_samples, batch_tokens=settings.batch_tokens, seed=settings.seed,
        rank=env.rank, world_size=env.world_size, workers=data_workers,
    )
    total = loader.total_steps(settings.epochs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [p for _, p in named], lr=settings.lr, betas=ADAM_BETAS, weight_decay=settings.weight_decay
    )
    step_model: nn.Module = model
    if env.world_size > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return _Run(
        store=store, settings=settings, env=env, device=device, fmt=fmt, cfg=cfg, model=model, step_model=step_model,
        head=head, loader=loader, heldout=held, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup_steps, total)),
        param_names=[n for n, _ in named], total_steps=total,
        fingerprint=run_fingerprint(settings, shard_keys, len(train_samples), len(held), env.world_size, total),
    )


def _resume(run: _Run, log: LogFn) -> tuple[int, DataPosition, str, dict[str, float]]:
    """(step, next data position, checkpoint, its last metrics) restored from the newest checkpoint."""
    rel = latest_checkpoint(run.store)
    if rel is None:
        return 0, DataPosition(), "", {}
    ck = load_checkpoint(
        run.store, rel, model=run.model, optimizer=run.optimizer, param_names=run.param_names, scheduler=run.scheduler
    )
    if diffs := _diff(ck.state["run"], run.fingerprint):
        raise CheckpointError(
            f"{run.store.url_of(rel)} belongs to a different run ({'; '.join(diffs)}); "
            f"remove {run.store.url_of(CHECKPOINTS_DIR)} (or pass resume=False) to start over"
        )
    pos = DataPosition(*ck.next_position)
    if run.env.is_main:
        log(f"drafter: resuming from {rel} (step {ck.step} of {run.total_steps}, epoch {pos.epoch} batch {pos.batch})")
    return ck.step, pos, rel, dict(ck.state.get("metrics") or {})


def train_drafter(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    *,
    d2t: np.ndarray | torch.Tensor,
    t2d: np.ndarray | torch.Tensor,
    target_dir: str | Path,
    settings: TrainingSettings,
    on_metrics: MetricsCallback | None = None,
    log: LogFn = print,
    max_steps: int | None = None,
    intermediate_size: int | None = None,
    resume: bool = True,
    log_every: int = 10,
    data_workers: int = 2,
) -> TrainResult:
    """Train (or continue training) the drafter on `shard_keys`; see the module docstring.

    `on_metrics(step, metrics)` is called on rank 0 after every optimizer step (loss,
    loss_k, acc_k, lr, grad_norm, tokens, epoch, seconds). `max_steps` stops this call
    once the global step reaches it (a checkpoint is written there), e.g. to train in
    time slices. `resume=False` ignores existing checkpoints.
    """
    env = DistEnv.from_environ()
    require_complete_shards(store, shard_keys)
    device = pick_device(settings.device, env)
    owns_group = _init_distributed(env, device)
    try:
        run = _prepare(
            store, shard_keys, env=env, device=device, d2t=d2t, t2d=t2d, target_dir=target_dir, settings=settings,
            intermediate_size=intermediate_size, data_workers=data_workers,
        )
        step, pos, ckpt_rel, metrics = _resume(run, log) if resume else (0, DataPosition(), "", {})
        resumed_from = step if ckpt_rel else None
        if env.is_main and not ckpt_rel:
            n_tokens = sum(s.length for s in run.loader.samples)
            log(
                f"drafter: {len(run.loader.samples)} training samples ({n_tokens} tokens), {len(run.heldout)} held out; "
                f"{run.total_steps} steps on {device} x{env.world_size}; aux layers {list(run.fmt.aux_layer_ids)}"
            )
        stop_at = run.total_steps if max_steps is None else min(run.total_steps, max_steps)
        tb = _TensorBoard(store, step) if env.is_main else None
        heldout: dict[str, float] = {}
        try:
            if step < stop_at:
                # Always ends with a checkpoint at stop_at.
                step, metrics, ckpt_rel = run.train_until(
                    stop_at, step, pos, tb=tb, on_metrics=on_metrics, log=log, log_every=log_every
                )
            if step >= run.total_steps and run.heldout:
                heldout = run.evaluate_heldout()
                if tb is not None:
                    tb.scalars(step, {f"heldout_{k}": v for k, v in heldout.items()})
                    accs = " ".join(f"{heldout[f'acc_{k}']:.3f}" for k in range(settings.ttt_steps))
                    log(f"drafter: held-out ({len(run.heldout)} rows) loss {heldout['loss']:.4f} acc_k {accs}")
        finally:
            if tb is not None:
                tb.close()
    finally:
        # A gloo/nccl group left open makes every rank hang at interpreter exit.
        if owns_group:
            dist.destroy_process_group()
    return TrainResult(
        step=step,
        total_steps=run.total_steps,
        finished=step >= run.total_steps,
        metrics=metrics,
        heldout=heldout,
        checkpoint=ckpt_rel,
        resumed_from=resumed_from,
        config=run.cfg,
        aux_layer_ids=list(run.fmt.aux_layer_ids),
        model=run.model.cpu(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Train and export from the command line (and under torchrun): settings from $EAGLE3_CONFIG,
    the store at $EAGLE3_ROOT, every shard of the tokenized set, the stored vocab map."""
    import argparse

    from safetensors.torch import load as st_load

    from eagle3_assets.drafter.export import export_drafter
    from eagle3_assets.settings import artifact_root, load_settings
    from eagle3_assets.shards import plan_shards
    from eagle3_assets.tokenized import TokenizedSet
    from eagle3_assets.vocab_map import VOCAB_MAP_FILE

    ap = argparse.ArgumentParser(description="Train the EAGLE-3 drafter on the stored hidden states.")
    ap.add_argument("--target", required=True, help="local HF directory of the target model")
    ap.add_argument("--max-steps", type=int, default=None, help="stop (with a checkpoint) at this global step")
    ap.add_argument("--no-export", action="store_true")
    args = ap.parse_args(argv)

    settings = load_settings()
    store = ArtifactStore(artifact_root())
    keys = [s.key for s in plan_shards(TokenizedSet.load(store).num_rows, settings.shard_size)]
    vmap = st_load(store.read_bytes(VOCAB_MAP_FILE))
    result = train_drafter(
        store, keys, d2t=vmap["d2t"], t2d=vmap["t2d"], target_dir=args.target, settings=settings.training,
        max_steps=args.max_steps,
    )
    if result.finished and not args.no_export and DistEnv.from_environ().is_main:
        url = export_drafter(
            store, result.model.trainable_state_dict(), result.config, aux_layer_ids=result.aux_layer_ids
        )
        print(f"drafter: exported to {url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
