"""Where one training run's samples come from: every shard at once (`offline`), or each shard as the rolling window
lets it land (`rolling`, `drafter/rolling.py`). Either gives the samples' format, a batch loader and the held-out
rows."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from eagle3_assets.drafter.data import (
    BatchLoader,
    DataError,
    SampleFormat,
    SampleRef,
    index_samples,
    require_complete_shards,
    split_heldout,
)
from eagle3_assets.drafter.distributed import DistEnv
from eagle3_assets.drafter.rolling import REPLAY_DIR, RollingLoader, RollingPlan, ShardWindow
from eagle3_assets.families import EAGLE3, FamilySpec
from eagle3_assets.sample_file import SAMPLE_SUFFIX
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet

ShardEventCallback = Callable[[dict], None]
# Rolling mode: how often a rank looks in the store for the next shard's check record.
SHARD_POLL_S = 2.0


def offline_data(
    store: ArtifactStore, shard_keys: Sequence[str], settings: TrainingSettings, env: DistEnv, data_workers: int
) -> tuple[SampleFormat, BatchLoader, list[SampleRef]]:
    """Every shard on disk: all samples indexed from their headers, held-out rows drawn from all of them."""
    require_complete_shards(store, shard_keys)
    samples, fmt = index_samples(store, shard_keys)
    train_samples, held = (samples, [])
    if settings.heldout_rows:
        train_samples, held = split_heldout(samples, settings.heldout_rows, settings.seed)
    loader = BatchLoader(
        store, train_samples, batch_tokens=settings.batch_tokens, seed=settings.seed,
        rank=env.rank, world_size=env.world_size, order=settings.batch_order, workers=data_workers,
    )  # fmt: skip
    return fmt, loader, held


@dataclass(frozen=True)
class ContinuedData:
    """What a continuation trains on (`continued_data`)."""

    new_rows: int  # samples of the new shards, all trained
    replayed: int  # old training samples drawn to train beside them
    steps: int  # training.continue_fraction of `scratch_steps`; rolling: one pass over the new and replayed rows
    scratch_steps: int  # the steps a from-scratch run (rolling: pass) on all rows would take
    release_sha256: str = ""  # the released export it started from (`model.safetensors`)
    base: str = "the release"  # what it started from: the release, or the family's own export (`continuation.py`)


def continued_line(c: ContinuedData) -> str:
    """How a continuation is described in the log and the drafter's materialization."""
    return (
        f"continued from {c.base} ({c.release_sha256[:12]}) with {c.new_rows} new rows and {c.replayed} replayed, "
        f"{c.steps} steps"
    )


def replay_sample(old: Sequence[SampleRef], n: int, seed: int) -> list[SampleRef]:
    """`n` of the old training samples (all when fewer), drawn with `seed`, in index order."""
    if n >= len(old):
        return list(old)
    pick = np.sort(np.random.default_rng([seed, 0x5E9A7]).permutation(len(old))[:n])
    return [old[i] for i in pick.tolist()]


def continued_data(
    store: ArtifactStore, old_shards: Sequence[str], new_shards: Sequence[str], settings: TrainingSettings,
    env: DistEnv, data_workers: int,
) -> tuple[SampleFormat, BatchLoader, list[SampleRef], ContinuedData]:  # fmt: skip
    """Continuing the release: the new shards' samples plus a replay sample of the old ones.

    The held-out rows are the release's own: drawn as it drew them, from the old shards alone (unchanged, or there
    would be no continuation), so no row the release trained on is held out and none held out is replayed. A release
    trained on no shard of this store (an imported one) has none: every shard is new, and the held-out rows are drawn
    from them as a from-scratch run draws them. The step budget is `continue_fraction` of what a from-scratch run on
    all rows would take (`training.steps`, or `training.epochs` over every training sample)."""
    require_complete_shards(store, [*old_shards, *new_shards])
    new, fmt = index_samples(store, new_shards)
    old: list[SampleRef] = []
    if old_shards:
        old, released = index_samples(store, old_shards)
        if (fmt.hidden_size, fmt.aux_layer_ids) != (released.hidden_size, released.aux_layer_ids):
            raise DataError(
                f"the new shards hold hidden size {fmt.hidden_size}, aux layers {list(fmt.aux_layer_ids)}; the "
                f"released drafter's {released.hidden_size}, {list(released.aux_layer_ids)}: extracted with different "
                "settings"
            )
        fmt = released
    pool = old if old_shards else new  # where the held-out rows come from
    kept, held = split_heldout(pool, settings.heldout_rows, settings.seed) if settings.heldout_rows else (pool, [])
    old_train, new_train = (kept, new) if old_shards else ([], kept)
    # Every old training row by default: replaying only as many as the new rows, the continuation learnt them over
    # the others and served below the release it started from (BENCHMARKS.md, `continue`). The replay costs no
    # steps (those are `continue_fraction`'s); `replay_rows` bounds it.
    n_replay = len(old_train) if settings.replay_rows is None else settings.replay_rows
    replay = replay_sample(old_train, n_replay, settings.seed)

    def loader(samples: Sequence[SampleRef]) -> BatchLoader:
        return BatchLoader(
            store, samples, batch_tokens=settings.batch_tokens, seed=settings.seed,
            rank=env.rank, world_size=env.world_size, order=settings.batch_order, workers=data_workers,
        )  # fmt: skip

    # As a from-scratch run would train: every sample, less the rows it would hold out of all of them.
    every = [*old, *new]
    scratch_train = split_heldout(every, settings.heldout_rows, settings.seed)[0] if settings.heldout_rows else every
    scratch = settings.steps or loader(scratch_train).total_steps(settings.epochs)
    steps = continuation_steps(settings.continue_fraction, scratch)
    return fmt, loader([*replay, *new_train]), held, ContinuedData(len(new_train), len(replay), steps, scratch)


def continuation_steps(fraction: float, scratch_steps: int) -> int:
    """A continuation's step budget: `fraction` of a from-scratch run's steps, rounded down (the share is a bound:
    rounded up, 0.25 of 1,057 steps would be 265, 25.07%), and at least one step."""
    return max(1, math.floor(fraction * scratch_steps))


def rolling_data(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    settings: TrainingSettings,
    env: DistEnv,
    data_workers: int,
    *,
    log: Callable[[str], None],
    on_shard: ShardEventCallback | None,
    family: FamilySpec = EAGLE3,
    families: Sequence[str] = (),
    after: Sequence[str] | None = None,
) -> tuple[SampleFormat, RollingLoader, list[SampleRef], ShardWindow, ContinuedData | None]:
    """One pass planned from the tokenized set; the first shard (once checked) decides the format. `family` records
    what it consumed; a shard is released once every one of `families` (`settings.drafters`; `family` alone when
    empty) has. `after`: the shards the release was trained on, when this pass continues it (`continuation.py`): the
    pass is over `shard_keys`, the new shards, each with its share of `training.replay_rows` rows replayed from the
    reservoir (`REPLAY_DIR`, kept as the release's run released its shards), and the held-out rows are the release's
    own copies. `[]`: a release trained on no shard of this store (an imported one): the pass a from-scratch run
    makes, started from its weights."""
    tset = TokenizedSet.load(store)
    plan = RollingPlan.from_tokenized(
        tset, shard_keys, heldout_rows=settings.heldout_rows, seed=settings.seed,
        reservoir_rows=settings.replay_reservoir_rows, after=after or (),
    )  # fmt: skip
    continued = None
    if after is not None and not after:  # nothing to replay, no held-out copies: every row is new
        steps = _pass_steps(store, plan, settings, env)
        continued = ContinuedData(sum(len(t) for t in plan.train), 0, steps, steps)
    elif after:
        if missing := [r for r in plan.heldout if not store.exists(r.rel)]:
            raise DataError(
                f"{len(missing)} of the release's {len(plan.heldout)} held-out rows have no copy, the first "
                f"{store.url_of(missing[0].rel)}: their shard {missing[0].shard} is released, so this continuation "
                "could not be judged on the rows the release was"
            )
        kept = set(store.listdir(REPLAY_DIR))
        in_reservoir = [r for r in plan.kept_before if f"{r.row}{SAMPLE_SUFFIX}" in kept]
        new_rows = sum(len(t) for t in plan.train)
        n_replay = len(in_reservoir) if settings.replay_rows is None else settings.replay_rows  # as offline: all
        replay = replay_sample(in_reservoir, n_replay, settings.seed)
        plan = plan.with_replay(replay)
        scratch = RollingPlan.from_tokenized(
            tset, [*after, *shard_keys], heldout_rows=settings.heldout_rows, seed=settings.seed
        )  # fmt: skip
        steps = [_pass_steps(store, p, settings, env) for p in (plan, scratch)]
        continued = ContinuedData(new_rows, len(replay), steps[0], steps[1])
    window = ShardWindow(
        store, plan, env.is_main, poll_s=SHARD_POLL_S, wait_s=settings.shard_wait_s, log=log, on_event=on_shard,
        family=family, families=tuple(dict.fromkeys([*families, family.name])),
    )  # fmt: skip
    fmt = window.wait_for(0)

    def ready(k: int) -> None:
        f = window.wait_for(k)
        if (f.hidden_size, f.aux_layer_ids) != (fmt.hidden_size, fmt.aux_layer_ids):
            raise DataError(
                f"shard {plan.keys[k]}: hidden size {f.hidden_size}, aux layers {list(f.aux_layer_ids)} differ from "
                f"{plan.keys[0]} ({fmt.hidden_size}, {list(fmt.aux_layer_ids)}): the shards were extracted with "
                "different settings"
            )
        window.started(k)

    loader = RollingLoader(
        store, plan, batch_tokens=settings.batch_tokens, seed=settings.seed, rank=env.rank,
        world_size=env.world_size, order=settings.batch_order, workers=data_workers, wait_for=ready,
    )  # fmt: skip
    return fmt, loader, list(plan.heldout), window, continued


def _pass_steps(store: ArtifactStore, plan: RollingPlan, settings: TrainingSettings, env: DistEnv) -> int:
    """The optimizer steps of one rolling pass under `plan` (planned from row lengths: nothing is read)."""
    return RollingLoader(
        store, plan, batch_tokens=settings.batch_tokens, seed=settings.seed, rank=env.rank,
        world_size=env.world_size, order=settings.batch_order, workers=1, wait_for=lambda _: None,
    ).total_steps()  # fmt: skip
