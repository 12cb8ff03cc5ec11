"""What the UI shows of a rolling run (`training.mode: rolling`).

The trainer keeps the window in the store (`shard_window.py`), wherever it runs; the
`drafter` asset reads it back while training runs and reports each change: on the shard's
own `hidden_states` partition an observation with its state (checked, training, consumed
at step s, released), so a released shard reads as learnt, not missing; on `drafter` the
progress in shards, the hidden-state bytes on disk against the window, and an ETA that
accounts for both extraction and training. With several drafter families (`settings.drafters`)
each family's drafter asset reports the same window: a shard some family has consumed and another
has not reads `partly consumed`, and each family's count of consumed shards is shown beside the
total.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dagster import AssetExecutionContext, AssetObservation, Failure

from eagle3_assets.defs.failures import refusal
from eagle3_assets.defs.observe import to_metadata
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.families import EAGLE3, FamilySpec
from eagle3_assets.shard_window import check_verdict, read_consumed, window_status
from eagle3_assets.storage import ArtifactStore


class WindowReporter:
    """Polled while the drafter trains: reports what changed in the window since the last poll."""

    def __init__(
        self,
        context: AssetExecutionContext,
        store: ArtifactStore,
        keys: Sequence[str],
        size: int,
        every_s: float = 10.0,
        families: Sequence[str] = (EAGLE3.name,),
    ):
        self.context, self.store, self.keys, self.size, self.every_s = context, store, list(keys), size, every_s
        self.families = tuple(families)
        self.reported: dict[str, str] = {}
        self.last = -every_s

    def poll(self, force: bool = False) -> None:
        # Each look reads every shard's manifest and records: on object storage that is one request each.
        if not force and time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        status = window_status(self.store, self.keys, self.size, self.families)
        # The first shard neither consumed nor released is the one the trainer is on once it has passed its check.
        current = next((k for k, s in status.states.items() if s not in ("consumed", "released")), None)
        for key, state in status.states.items():
            shown = "training" if key == current and state in ("checked", "partly consumed") else state
            if self.reported.get(key) == shown:
                continue
            self.reported[key] = shown
            values: dict[str, object] = {"state": shown}
            if key in status.consumed_at and len(self.families) == 1:
                values["consumed_at_step"] = status.consumed_at[key][self.families[0]]
            elif key in status.consumed_at:
                values |= {f"consumed_at_step_{f}": step for f, step in status.consumed_at[key].items()}
            self._report(AssetObservation(asset_key=HIDDEN_STATES, partition=key, metadata=to_metadata(values)))
        self._report(AssetObservation(asset_key=self.context.asset_key, metadata=to_metadata(status.as_metadata())))

    def _report(self, observation: AssetObservation) -> None:
        # Straight to the event log, not through the step: a step's logged events reach it only when the
        # step ends, and not at all when it fails, and a rolling run is long and may end waiting for a shard.
        self.context.instance.report_runless_asset_event(observation)


def rolling_refusal(store: ArtifactStore, keys: Sequence[str], family: FamilySpec = EAGLE3) -> Failure | None:
    """Why `family`'s rolling run must not start, before any rank does: the next shard it trains failed its check.

    Shards not extracted yet are no reason to refuse: rolling training waits for them.
    """
    consumed = read_consumed(store, family.name)
    upcoming = next((k for k in keys if k not in consumed), None)
    if upcoming is None or check_verdict(store, upcoming) != "failed":
        return None
    name = family.drafter_asset
    return refusal(
        f"{name} refuses to train: shard {upcoming}, the next in training order, failed its integrity check, and "
        "rolling training never skips a shard. Repair it (`verify_shards` names the bad files; materialize the "
        f"shard again), then materialize `{name}`"
    )
