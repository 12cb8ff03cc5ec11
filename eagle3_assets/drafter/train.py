"""Train the drafter on stored hidden states: one run, resumable at any step.

`train_drafter(...)` trains on CPU, one GPU, or one rank of a torchrun data-parallel job
(`distributed.py`: each rank a slice of the batches, metrics summed over ranks, only
rank 0 writing checkpoints, TensorBoard and the export). `training.batch_tokens` is per
optimizer step over all ranks. `drafter/run.py` wraps it with the export and the
metrics file for the `drafter` asset and the command line.

A run killed at any point continues from the newest checkpoint when called again with
the same inputs: same step counter, same data order, the loss curve continues. A step
whose loss is not finite stops the run naming the batch's files; no checkpoint is ever
written with non-finite weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from eagle3_assets.crash_points import crash_point
from eagle3_assets.drafter.checkpoint import checkpoint_rel, save_checkpoint
from eagle3_assets.drafter.continuation import ContinuationPlan
from eagle3_assets.drafter.data import (
    Batch,
    BatchLoader,
    DataPosition,
    SampleFormat,
    SampleRef,
    heldout_batches,
)
from eagle3_assets.drafter.dflash_model import DFlashConfig
from eagle3_assets.drafter.distributed import (
    DistEnv,
    all_gather_ints,
    all_reduce_sum,
    barrier,
    init_distributed,
    pick_device,
)
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.family import Eagle3, Family
from eagle3_assets.drafter.fingerprint import run_fingerprint
from eagle3_assets.drafter.metrics import StepCounts, heldout_line
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.release import RELEASE_DIR, export_digest
from eagle3_assets.drafter.resume import resume_from_checkpoint
from eagle3_assets.drafter.rolling import RollingLoader, ShardWindow
from eagle3_assets.drafter.schedule import short_run_warning, warmup_cosine
from eagle3_assets.drafter.selection import (
    Evaluation,
    best_index,
    save_best,
    stops_early,
)
from eagle3_assets.drafter.sources import (
    ContinuedData,
    ShardEventCallback,
    continued_data,
    continued_line,
    offline_data,
    rolling_data,
)
from eagle3_assets.drafter.target_head import (
    TargetHead,
    load_target_weights,
)
from eagle3_assets.drafter.tensorboard import TensorBoard
from eagle3_assets.drafter.ttt import TTTOutput, ttt_forward
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.vocab_map import VocabMap, vocab_map_problems

ADAM_BETA1 = 0.9

MetricsCallback = Callable[[int, dict[str, float]], None]
LogFn = Callable[[str], None]
OtherRun = Literal["fresh", "refuse"]  # what to do with a checkpoint another run made


class NonFiniteLossError(TrainingError):
    """A training step's loss or gradient is NaN or infinite; the message names the step and the batch's files."""


# -- model ------------------------------------------------------------------------


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    # bf16 matmuls on GPU (params and optimizer stay fp32); exact fp32 on CPU.
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    head: TargetHead,
    loader: BatchLoader,
    batches: Sequence[Sequence[int]],
    *,
    family: Family,
    device: torch.device,
) -> dict[str, float]:
    """loss/acc_k over `batches` of `loader`'s samples (all ranks' shares summed)."""
    model.eval()
    counts = StepCounts.zeros(family.steps)
    for idx in batches:
        b = loader.load(idx).to(device)
        targets = head.targets(b.last, b.pre_norm, model.t2d)
        with autocast(device):
            out = family.objective(model, b, targets, None)
        counts.add(out)
    model.train()
    return counts.all_reduce().metrics(family.loss_weights)


def objective(s: TrainingSettings) -> Callable[..., TTTOutput]:
    """`ttt_forward` with the run's unroll length, step weights, loss and loss positions (the EAGLE-3 step alone, as
    `benchmarks/gpu_check.py` times it)."""
    return partial(
        ttt_forward, num_steps=s.ttt_steps, step_weight=s.step_weight, loss=s.loss, loss_positions=s.loss_positions
    )


# -- the run --------------------------------------------------------------------------


@dataclass
class TrainResult:
    step: int  # optimizer steps done, over all calls
    total_steps: int  # steps the settings ask for
    finished: bool  # step == total_steps (False when stopped by max_steps)
    metrics: dict[str, float]  # the last step's metrics (from the checkpoint when this call ran no step)
    heldout: dict[str, float]  # loss / acc_k / accept_len_k over the held-out rows, when finished and any are held out
    checkpoint: str  # the newest checkpoint directory (store-relative)
    resumed_from: int | None  # step of the checkpoint this call started from
    config: DrafterConfig | DFlashConfig
    aux_layer_ids: list[int]  # the aux layers the shards hold (the family reads its own of them: `Family.aux_layer_ids`)
    model: nn.Module = field(repr=False)  # trained, on CPU: an Eagle3Drafter or a DFlashDrafter
    family: Family = field(repr=False)
    fingerprint: dict[str, Any] = field(repr=False)  # the run's (`run_fingerprint`)
    evaluations: list[Evaluation] = field(default_factory=list)  # held-out evaluations, in step order
    stopped_early: bool = False  # finished before total_steps by training.early_stop_evals
    continued: ContinuedData | None = None  # what it continued from and on, when it continued the release

    @property
    def best(self) -> Evaluation | None:
        """The evaluation with the highest estimate (`selection.py`)."""
        i = best_index(self.evaluations)
        return None if i is None else self.evaluations[i]


def _check_inputs(fmt: SampleFormat, target: TargetModel, vmap: VocabMap) -> None:
    if fmt.hidden_size != target.hidden_size:
        raise TrainingError(
            f"hidden states are {fmt.hidden_size} wide but the target at {target.path} has hidden_size "
            f"{target.hidden_size}"
        )
    problems = vocab_map_problems(vmap, draft_vocab_size=len(vmap.d2t), target_vocab_size=target.vocab_size)
    if problems:
        raise TrainingError(f"the vocab map does not fit the target at {target.path}: " + "; ".join(problems))


@dataclass
class _Run:
    """What one call of train_drafter holds while it trains."""

    store: ArtifactStore  # the shards
    out: ArtifactStore  # the family's checkpoints, best weights and TensorBoard (`Family.root`)
    settings: TrainingSettings
    family: Family
    env: DistEnv
    device: torch.device
    fmt: SampleFormat
    cfg: DrafterConfig | DFlashConfig
    model: nn.Module
    step_model: nn.Module  # the model, wrapped in DistributedDataParallel when WORLD_SIZE > 1
    head: TargetHead
    loader: BatchLoader | RollingLoader
    heldout: list[SampleRef]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    param_names: list[str]
    total_steps: int
    fingerprint: dict[str, Any]
    window: ShardWindow | None  # rolling mode
    # With training.sample_ledger: [step, rows of the step's batch over all ranks], every step this run's
    # checkpoints hold, saved in each of them.
    ledger: list[list] | None
    ledger_from: int = 1  # the first step the ledger holds (later than 1 when it was turned on mid-run)
    continued: ContinuedData | None = None  # continuing the release (`continuation.py`)
    evals: list[Evaluation] = field(default_factory=list)  # held-out evaluations so far, saved in each checkpoint

    def train_step(self, step: int, batch: Batch) -> dict[str, float]:
        """One optimizer step, top to bottom; its metrics summed over ranks."""
        s = self.settings
        b = batch.to(self.device)
        targets = self.head.targets(b.last, b.pre_norm, self.model.t2d)  # the target's distribution, from stored states
        with autocast(self.device):
            out = self.family.objective(self.step_model, b, targets, step)
        # Every rank stops together: one rank's NaN would reach all of them through the gradient all-reduce.
        non_finite, tokens = all_reduce_sum(
            torch.tensor([0.0 if torch.isfinite(out.loss) else 1.0, float(batch.num_tokens)], dtype=torch.float64)
        ).tolist()
        if non_finite:
            self._stop_non_finite(step, batch, f"the loss is {float(out.loss.detach())}")
        self.optimizer.zero_grad(set_to_none=True)
        self.rank_loss(out).backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)  # all-reduced already: equal on every rank
        if not torch.isfinite(grad_norm):
            self._stop_non_finite(step, batch, f"the gradient norm is {float(grad_norm)} (the loss {float(out.loss)})")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        counts = StepCounts.zeros(self.family.steps)
        counts.add(out)
        metrics = counts.all_reduce().metrics(self.family.loss_weights)
        metrics.update(lr=lr, grad_norm=float(grad_norm), tokens=tokens)
        return metrics

    def rank_loss(self, out: TTTOutput) -> torch.Tensor:
        """The loss this rank backpropagates. DistributedDataParallel averages the ranks' gradients, and each
        rank's step losses are means over its own positions: weighted by the rank's share of the step's
        positions, the average is the gradient of the global batch's loss, as one process computes it."""
        if self.env.world_size == 1:
            return out.loss
        n = out.averaged_over.double().cpu()
        total = all_reduce_sum(n)
        share = n * self.env.world_size / total.clamp(min=1)
        return (out.step_terms * (share * self.family.loss_weights(total)).to(out.step_terms)).sum()

    def _stop_non_finite(self, step: int, batch: Batch, what: str) -> None:
        files = ", ".join(self.store.url_of(ref.rel) for ref in batch.samples)
        raise NonFiniteLossError(
            f"step {step}: {what}; this rank's batch: {files}. Nothing of this step was applied; the last "
            "checkpoint is intact. Check those files (the `verify_shards` job) and re-extract the bad ones."
        )

    def checkpoint(self, step: int, next_pos: DataPosition, metrics: dict[str, float], tb: TensorBoard | None) -> str:
        """Rank 0 publishes the checkpoint; every rank waits for it."""
        rel = checkpoint_rel(step)
        if self.env.is_main:
            save_checkpoint(
                self.out, step, model_tensors=self.model.trainable_state_dict(), optimizer=self.optimizer,
                param_names=self.param_names, scheduler=self.scheduler,
                state={
                    "next_position": {"epoch": next_pos.epoch, "batch": next_pos.batch},
                    "run": self.fingerprint,
                    "drafter_config": self.cfg.to_dict(),
                    "aux_layer_ids": list(self.fmt.aux_layer_ids),
                    "metrics": metrics,
                    "evals": self.evals,
                    **({"ledger": self.ledger, "ledger_from": self.ledger_from} if self.ledger is not None else {}),
                },
            )  # fmt: skip
            if tb is not None:
                tb.sync()
        barrier()
        return rel

    def train_until(
        self, stop_at: int, step: int, pos: DataPosition, *, tb: TensorBoard | None, on_metrics: MetricsCallback | None,
        on_eval: MetricsCallback | None, log: LogFn, log_every: int,
    ) -> tuple[int, dict[str, float], str]:  # fmt: skip
        """Steps from `step` (data from `pos`) to `stop_at`, or to an early stop; (step, last metrics, last
        checkpoint)."""
        self.model.train()
        metrics: dict[str, float] = {}
        ckpt = ""
        t_last = time.perf_counter()
        with contextlib.closing(self.loader.iterate(pos)) as batches:
            for pos, batch in batches:
                metrics = self.train_step(step + 1, batch)
                step += 1
                if self.ledger is not None:
                    self.ledger.append([step, all_gather_ints([ref.row for ref in batch.samples])])
                crash_point(f"step:{step}")
                now = time.perf_counter()
                epoch = pos.epoch + (pos.batch + 1) / self.loader.steps_in_epoch(pos.epoch)
                metrics.update(epoch=epoch, seconds=now - t_last)
                t_last = now
                if tb is not None:  # rank 0
                    tb.scalars(step, metrics)
                    if on_metrics is not None:
                        on_metrics(step, metrics)
                    if step % log_every == 0 or step == stop_at:
                        accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.family.steps))
                        log(
                            f"drafter: step {step}/{self.total_steps} loss {metrics['loss']:.4f} acc_k {accs} "
                            f"lr {metrics['lr']:.2e}"
                        )
                stop = False
                # Rolling: the held-out rows are read from their copies, made once the first shard is consumed; a
                # last step inside the first shard is evaluated after the loop, once it is.
                heldout_ready = self.window is None or pos.epoch > 0
                if self.heldout and heldout_ready and (step % self.settings.eval_every == 0 or step == self.total_steps):
                    self.evaluation(step, tb=tb, on_eval=on_eval, log=log)
                    stop = stops_early(self.evals, self.settings.early_stop_evals)
                    if stop and self.env.is_main:
                        log(
                            f"drafter: stopping early at step {step}: {self.settings.early_stop_evals} held-out "
                            "evaluation(s) without a rise (training.early_stop_evals)"
                        )
                shard_done = self.window is not None and self.loader.ends_shard(pos)
                if step % self.settings.checkpoint_every == 0 or step == stop_at or shard_done or stop:
                    ckpt = self.checkpoint(step, self.loader.position_after(pos), metrics, tb)
                if shard_done:
                    crash_point(f"checkpointed:{self.window.plan.keys[pos.epoch]}")
                    self.window.consumed(pos.epoch, step)
                if step >= stop_at or stop:
                    break
        return step, metrics, ckpt

    def evaluation(
        self, step: int, *, tb: TensorBoard | None, on_eval: MetricsCallback | None, log: LogFn
    ) -> Evaluation:
        """Evaluate the held-out rows now (every rank), record it, and keep the weights when it is the best so far."""
        heldout = self.evaluate_heldout()
        record: Evaluation = {"step": step, **heldout}
        self.evals.append(record)
        best = self.evals[best_index(self.evals) or 0]
        if self.env.is_main:
            if best is record:
                save_best(self.out, self.model.trainable_state_dict(), record, self.fingerprint)
            if tb is not None:
                tb.scalars(step, {f"heldout_{k}": v for k, v in heldout.items()})
            if on_eval is not None:
                on_eval(step, {f"heldout_{k}": v for k, v in heldout.items()})
            log(
                f"drafter: step {step}/{self.total_steps} held-out {heldout_line(heldout, self.family.steps)} "
                f"(best accept_len_k3 {best['accept_len_k3']:.3f} at step {best['step']})"
            )
        return record

    def evaluate_heldout(self) -> dict[str, float]:
        s, env = self.settings, self.env
        budget = max(1, s.batch_tokens // env.world_size)
        loader = BatchLoader(self.store, self.heldout, batch_tokens=s.batch_tokens, seed=s.seed, world_size=env.world_size)
        return evaluate(
            self.model, self.head, loader, heldout_batches(self.heldout, budget, env.rank, env.world_size),
            family=self.family, device=self.device,
        )  # fmt: skip


def _base(plan: ContinuationPlan) -> str:
    if plan.imported:
        return f"the imported release ({plan.imported['source']}, {plan.imported['format']} format)"
    return "the release" if plan.base == RELEASE_DIR else f"its own export ({plan.base}; the release is another family's)"


def _training_data(
    store: ArtifactStore, shard_keys: Sequence[str], *, env: DistEnv, settings: TrainingSettings, family: Family,
    data_workers: int, log: LogFn, on_shard: ShardEventCallback | None, continuation: ContinuationPlan | None,
    window_families: Sequence[str],
) -> tuple[
    SampleFormat, BatchLoader | RollingLoader, list[SampleRef], ShardWindow | None, ContinuedData | None, Sequence[str],
    TrainingSettings,
]:
    """The run's rows (offline, rolling, or a continuation's new and replayed rows): their format, loader, held-out
    rows, rolling window, what a continuation trains on, every shard the run is of, and the settings it trains by (a
    continuation's schedule is its own)."""
    window = None
    continued = None
    if settings.rolling:
        # A continuation's pass is over the new shards alone, with replayed rows from the reservoir: one pass, every
        # new row once, its steps what that pass takes.
        fmt, loader, held, window, continued = rolling_data(
            store, continuation.new_shards if continuation else shard_keys, settings, env, data_workers, log=log,
            on_shard=on_shard, family=family.spec, families=window_families,
            after=continuation.old_shards if continuation else None,
        )  # fmt: skip
        if continuation is not None:
            continued = replace(continued, release_sha256=continuation.release_sha256, base=_base(continuation))
            shard_keys = [*continuation.old_shards, *continuation.new_shards]
            settings = settings.model_copy(
                update={"warmup_steps": min(settings.warmup_steps, max(1, continued.steps // 20))}
            )
    elif continuation is not None:
        fmt, loader, held, continued = continued_data(
            store, continuation.old_shards, continuation.new_shards, settings, env, data_workers
        )
        continued = replace(continued, release_sha256=continuation.release_sha256, base=_base(continuation))
        shard_keys = [*continuation.old_shards, *continuation.new_shards]
        # Its own schedule, the rest of the recipe as set: a share of a from-scratch run's steps, a short warmup
        # (the weights are trained already; a full one would spend the budget warming up).
        short_warmup = min(settings.warmup_steps, max(1, continued.steps // 20))
        settings = settings.model_copy(update={"steps": continued.steps, "warmup_steps": short_warmup})
    else:
        fmt, loader, held = offline_data(store, shard_keys, settings, env, data_workers)
    return fmt, loader, held, window, continued, shard_keys, settings


def _prepare(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    *,
    env: DistEnv,
    device: torch.device,
    vmap: VocabMap,
    target: TargetModel,
    settings: TrainingSettings,
    family: Family,
    intermediate_size: int | None,
    data_workers: int,
    log: LogFn,
    on_shard: ShardEventCallback | None,
    inputs: Mapping[str, str] | None = None,
    continuation: ContinuationPlan | None = None,
    window_families: Sequence[str] = (),
) -> _Run:
    fmt, loader, held, window, continued, shard_keys, settings = _training_data(
        store, shard_keys, env=env, settings=settings, family=family, data_workers=data_workers, log=log,
        on_shard=on_shard, continuation=continuation, window_families=window_families,
    )  # fmt: skip
    _check_inputs(fmt, target, vmap)
    weights = load_target_weights(target)
    model = family.build(target, weights, vmap, fmt.aux_layer_ids, settings.seed, intermediate_size).to(device)
    if continuation is not None:
        # The plan (which shards are old, which new) is of the weights it read; others published since (a release
        # promoted, its own export replaced) are another start.
        if (now := export_digest(store, continuation.base)) != continuation.release_sha256:
            raise TrainingError(
                f"{_base(continuation)} at {store.url_of(continuation.base)} changed since this run planned to "
                f"continue it (sha256 {continuation.release_sha256 or 'not recorded'} then, {now} now): not "
                "warm-started; a retry plans again"
            )
        family.warm_start(model, store, continuation.base)  # the optimizer stays fresh
    head = TargetHead.from_weights(weights).to(device)
    total = settings.steps or loader.total_steps(settings.epochs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [p for _, p in named], lr=settings.lr, betas=(ADAM_BETA1, settings.adam_beta2), weight_decay=settings.weight_decay
    )
    step_model: nn.Module = model
    if env.world_size > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    n_train = len(loader.samples)
    return _Run(
        store=store, out=store.child(family.root), settings=settings, family=family, env=env, device=device, fmt=fmt,
        cfg=model.config, model=model, step_model=step_model,
        head=head, loader=loader, heldout=held, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup_steps, total)),
        param_names=[n for n, _ in named], total_steps=total,
        fingerprint=run_fingerprint(
            settings, shard_keys, n_train, len(held), env.world_size, total, inputs, family.fingerprint(),
            continued_from=None if continued is None else {
                "release": continued.release_sha256, "new_shards": list(continuation.new_shards),
                "new_rows": continued.new_rows, "replayed": continued.replayed,
            },
        ),
        window=window, ledger=[] if settings.sample_ledger else None, continued=continued,
    )  # fmt: skip


def _announce(run: _Run, log: LogFn) -> None:
    """What a fresh run is about to do, and whether it is too short to learn."""
    n_tokens = sum(s.length for s in run.loader.samples)
    if (c := run.continued) is not None and run.window is not None:
        log(
            f"drafter: {continued_line(c)} (one rolling pass over the new shards and the replayed rows; a "
            f"from-scratch pass over every row takes {c.scratch_steps})"
        )
    elif c is not None:
        log(
            f"drafter: {continued_line(c)} (training.continue_fraction {run.settings.continue_fraction:g} of the "
            f"{c.scratch_steps} steps a from-scratch run would take)"
        )
        if c.steps < (one_pass := run.loader.steps_in_epoch(0)):
            log(
                f"drafter: {c.steps} steps are less than one pass over the new and replayed rows ({one_pass} steps): "
                "some new rows go untrained; raise training.continue_fraction, or lower training.replay_rows"
            )
    log(
        f"drafter: {len(run.loader.samples)} training samples ({n_tokens} tokens), {len(run.heldout)} held out; "
        f"{run.total_steps} steps on {run.device} x{run.env.world_size}; aux layers {list(run.fmt.aux_layer_ids)}"
    )
    if warning := short_run_warning(run.settings, run.total_steps):
        log(warning)


def _final_heldout(
    run: _Run, step: int, *, tb: TensorBoard | None, on_eval: MetricsCallback | None, log: LogFn
) -> dict[str, float]:
    """The held-out figures at the run's last step: evaluated as it trained, unless the checkpoint predates
    evaluations."""
    last = run.evals[-1] if run.evals else {}
    heldout = {k: v for k, v in last.items() if k != "step"} if last.get("step") == step else {}
    if not heldout:
        heldout = {k: v for k, v in run.evaluation(step, tb=tb, on_eval=on_eval, log=log).items() if k != "step"}
    if run.env.is_main:
        log(f"drafter: held-out ({len(run.heldout)} rows) {heldout_line(heldout, run.family.steps)}")
    return heldout


def train_drafter(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    *,
    vmap: VocabMap,
    target: TargetModel,
    settings: TrainingSettings,
    on_metrics: MetricsCallback | None = None,
    on_eval: MetricsCallback | None = None,
    log: LogFn = print,
    max_steps: int | None = None,
    intermediate_size: int | None = None,
    resume: bool = True,
    log_every: int = 10,
    data_workers: int = 2,
    on_shard: ShardEventCallback | None = None,
    inputs: Mapping[str, str] | None = None,
    other_run: OtherRun = "refuse",
    family: Family | None = None,
    continuation: ContinuationPlan | None = None,
    window_families: Sequence[str] = (),
) -> TrainResult:
    """Train (or continue training) the drafter on `shard_keys`; see the module docstring.

    `on_metrics(step, metrics)` is called on rank 0 after every optimizer step (loss,
    loss_k, acc_k, accept_len_k, lr, grad_norm, tokens, epoch, seconds), `on_eval(step, heldout_*)`
    after every held-out evaluation (`training.eval_every`; the best one's weights are kept for
    the export, `selection.py`). `max_steps` stops this call
    once the global step reaches it (a checkpoint is written there), e.g. to train in
    time slices. `resume=False` ignores existing checkpoints; `inputs` (the data's versions) and the settings
    decide whether the newest checkpoint belongs to this run, and `other_run` what happens when it does not. In rolling mode (`settings.mode`)
    training waits for each shard as it comes, and `on_shard({"shard", "state", …})` hears on rank
    0 when one starts training and when it is released. `continuation` (`continuation.py`) starts
    the model from the release's weights and trains on the new shards plus a replay of old rows, for its own steps
    (rolling: one pass over the new shards, the replayed rows from the reservoir).
    `window_families` (`settings.drafters`) are the families training from the one window: a shard is released once
    each has consumed it (`family` alone when empty).
    """
    family = family or Eagle3(settings)
    env = DistEnv.from_environ()
    device = pick_device(settings.device, env)
    owns_group = init_distributed(env, device, timeout_s=settings.launch.collective_timeout_s)
    try:
        run = _prepare(
            store, shard_keys, env=env, device=device, vmap=vmap, target=target, settings=settings, family=family,
            intermediate_size=intermediate_size, data_workers=data_workers, log=log, on_shard=on_shard, inputs=inputs,
            continuation=continuation, window_families=window_families,
        )  # fmt: skip
        settings = run.settings  # a continuation's schedule is its own
        step, pos, ckpt_rel, metrics = resume_from_checkpoint(run, log, other_run) if resume else (0, DataPosition(), "", {})
        resumed_from = step if ckpt_rel else None
        stopped_early = step < run.total_steps and stops_early(run.evals, settings.early_stop_evals)
        if env.is_main and not ckpt_rel:
            _announce(run, log)
        stop_at = run.total_steps if max_steps is None else min(run.total_steps, max_steps)
        tb = TensorBoard(run.out, step) if env.is_main else None
        heldout: dict[str, float] = {}
        try:
            if step < stop_at and not stopped_early:
                # Always ends with a checkpoint at stop_at, or at the step it stopped early.
                step, metrics, ckpt_rel = run.train_until(
                    stop_at, step, pos, tb=tb, on_metrics=on_metrics, on_eval=on_eval, log=log, log_every=log_every
                )
                stopped_early = step < run.total_steps and stops_early(run.evals, settings.early_stop_evals)
            if (step >= run.total_steps or stopped_early) and run.heldout:
                heldout = _final_heldout(run, step, tb=tb, on_eval=on_eval, log=log)
        finally:
            if tb is not None:
                tb.close()
    finally:
        # A gloo/nccl group left open makes every rank hang at interpreter exit.
        if owns_group:
            dist.destroy_process_group()
    return TrainResult(
        step=step, total_steps=run.total_steps, finished=step >= run.total_steps or stopped_early, metrics=metrics,
        heldout=heldout, checkpoint=ckpt_rel, resumed_from=resumed_from, config=run.cfg,
        aux_layer_ids=list(run.fmt.aux_layer_ids), model=run.model.cpu(), family=family, fingerprint=run.fingerprint,
        evaluations=run.evals, stopped_early=stopped_early, continued=run.continued,
    )  # fmt: skip
