"""Where one training run's samples come from: every shard at once (`offline`), or each shard as the rolling window
lets it land (`rolling`, `drafter/rolling.py`). Either gives the samples' format, a batch loader and the held-out
rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
from eagle3_assets.drafter.rolling import RollingLoader, RollingPlan, ShardWindow
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


def rolling_data(
    store: ArtifactStore,
    shard_keys: Sequence[str],
    settings: TrainingSettings,
    env: DistEnv,
    data_workers: int,
    *,
    log: Callable[[str], None],
    on_shard: ShardEventCallback | None,
    family: str = "eagle3",
    families: Sequence[str] = (),
) -> tuple[SampleFormat, RollingLoader, list[SampleRef], ShardWindow]:
    """One pass planned from the tokenized set; the first shard (once checked) decides the format. `family` records
    what it consumed; a shard is released once every one of `families` (`settings.drafters`; `family` alone when
    empty) has."""
    plan = RollingPlan.from_tokenized(
        TokenizedSet.load(store), shard_keys, heldout_rows=settings.heldout_rows, seed=settings.seed
    )
    window = ShardWindow(
        store, plan, env.is_main, poll_s=SHARD_POLL_S, wait_s=settings.shard_wait_s, log=log, on_event=on_shard,
        family=family, families=tuple(dict.fromkeys([*families, family])),
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
    return fmt, loader, list(plan.heldout), window
