"""Rolling-window training data (`training.mode: rolling`): one pass over the shards, in key
order, each trained as it lands and released once a checkpoint has learnt it.

The whole pass is planned from the tokenized set before any shard exists: shard k's samples
are its rows with their lengths from the tokenized offsets, and its batches are "epoch" k of
a `BatchLoader` over that shard alone. So a `DataPosition(epoch=k, batch=b)` names one batch
of the pass, the step count (and with it the learning-rate schedule) covers the whole run,
and a checkpoint resumes at the exact batch. Held-out rows are drawn from the first shard
(a uniform slice of the shuffled rows) and copied to `drafter/heldout/` before it is
released, where every family's trainer reads them (each copies what is not there yet before it
records the first shard, and the shard is released only after every family recorded it).
With several drafter families (`settings.drafters`) each trains in a trainer of its own, from
the one window: a shard is released once every family consumed it. The records that make
release safe are in `shard_window.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from eagle3_assets.crash_points import crash_point
from eagle3_assets.drafter.checkpoint import checkpoint_rel, list_checkpoints
from eagle3_assets.drafter.data import Batch, BatchLoader, BatchOrder, DataError, DataPosition, SampleFormat, SampleRef
from eagle3_assets.drafter.distributed import barrier
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.hidden_states.manifest import ManifestError, ShardManifest
from eagle3_assets.families import EAGLE3, FamilySpec, family_spec
from eagle3_assets.sample_file import SAMPLE_SUFFIX, SampleSpec, manifest_path, sample_row, shard_dir
from eagle3_assets.shard_window import (
    Window,
    check_verdict,
    lost_sample_files,
    read_consumed_one,
    record_consumed,
    release_when_consumed,
    start_over,
    window_dir,
    write_check_record,
)
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet

HELDOUT_DIR = "drafter/heldout"
# The replay reservoir: a seeded sample of the released shards' rows (`training.replay_reservoir_rows`), copied before
# their release, from which a continuation replays old rows (`continuation.py`); the window's release never touches it.
REPLAY_DIR = "drafter/replay"

LogFn = Callable[[str], None]


class ShardFailedError(TrainingError):
    """The next shard in the order failed its integrity check: training stops there until it is repaired."""

    retryable = False  # a retry meets the same shard (`rolling_refusal` refuses it before any rank starts)


class ShardWaitTimeout(TrainingError):
    """The next shard did not pass its check within `training.shard_wait_s`."""

    retryable = True


def reservoir_quotas(train: Sequence[Sequence[SampleRef]], bound: int, seed: int) -> list[list[SampleRef]]:
    """The rows the replay reservoir keeps of each shard's training rows: a uniform share of `bound` over all of them
    (shard k keeps floor(bound·C_k/N) − floor(bound·C_{k-1}/N), C_k the rows up to and including shard k, N all: at
    most `bound` in all), each shard's the first of a seeded order of its own rows, in row order. Shards added later
    (a larger N) shrink the older shards' shares to a prefix of what they kept; a share that grows by a rounding row
    finds that row gone, and the reservoir holds one fewer."""
    total = sum(len(t) for t in train)
    out, before = [], 0
    for rows in train:
        share = (bound * (before + len(rows)) // total - bound * before // total) if total else 0
        before += len(rows)
        start = Shard.parse(rows[0].shard).start if rows else 0
        pick = np.sort(np.random.default_rng([seed, 0x7E5E, start]).permutation(len(rows))[:share])
        out.append([rows[i] for i in pick.tolist()])
    return out


@dataclass(frozen=True)
class RollingPlan:
    keys: tuple[str, ...]  # training order
    train: tuple[tuple[SampleRef, ...], ...]  # per shard, in row order (a continuation's replayed rows after them)
    heldout: tuple[SampleRef, ...]  # rows of the first shard, read from HELDOUT_DIR
    # Per shard, its rows the replay reservoir keeps when the shard is released (`reservoir_quotas`).
    keep: tuple[tuple[SampleRef, ...], ...] = ()
    # The reservoir's rows of the shards a continued release trained on (`after`), in their order.
    kept_before: tuple[SampleRef, ...] = ()

    @classmethod
    def from_tokenized(
        cls, tset: TokenizedSet, keys: Sequence[str], *, heldout_rows: int, seed: int, reservoir_rows: int = 0,
        after: Sequence[str] = (),
    ) -> RollingPlan:  # fmt: skip
        """One pass over `keys`. `after`: the shards a released drafter was trained on, in its order, when this pass
        continues it: the held-out rows are the ones that run drew from the first of them, and the reservoir's shares
        are of every shard's rows."""
        if not keys:
            raise DataError("no hidden-state shards given: nothing to train on")
        shards = [Shard.parse(k) for k in [*after, *keys]]
        train = [[SampleRef(s.key, r, tset.row_length(r)) for r in s.rows] for s in shards]
        first = train[0]
        if heldout_rows >= len(first):
            raise DataError(
                f"heldout_rows={heldout_rows}: in rolling mode held-out rows come from the first shard "
                f"({shards[0].key}, {len(first)} rows); lower training.heldout_rows or raise shard_size"
            )
        pick = set(np.random.default_rng([seed, 0x4E1D]).permutation(len(first))[:heldout_rows].tolist())
        held = tuple(SampleRef(r.shard, r.row, r.length, copied_to=HELDOUT_DIR) for i, r in enumerate(first) if i in pick)
        train[0] = [r for i, r in enumerate(first) if i not in pick]
        keep = reservoir_quotas(train, reservoir_rows, seed)
        n = len(after)
        before = tuple(r for rows in keep[:n] for r in rows)
        return cls(tuple(keys), tuple(tuple(t) for t in train[n:]), held, tuple(tuple(k) for k in keep[n:]), before)

    def with_replay(self, replay: Sequence[SampleRef]) -> RollingPlan:
        """The pass with `replay` (reservoir rows) dealt out over its shards in turn, each trained beside the shard's
        own rows."""
        train = [list(t) for t in self.train]
        for i, ref in enumerate(replay):
            train[i % len(train)].append(replace(ref, copied_to=REPLAY_DIR))
        return replace(self, train=tuple(tuple(t) for t in train))

    def reservoir_rows(self) -> set[int]:
        """Every row the reservoir may hold under this plan."""
        return {r.row for r in self.kept_before} | {r.row for rows in self.keep for r in rows}


def rolling_disk_needs(
    store: ArtifactStore, tset: TokenizedSet, window: Window, key: str, spec: SampleSpec, reservoir_rows: int
) -> list[tuple[str, int]]:
    """What a rolling run still puts on the disk beside shard `key`'s own rows, each named with its bytes: the rows
    the other admitted shards lack, the rows the replay reservoir has yet to keep (kept rows stay on the disk when
    their shard is released), and one checkpoint of each family (a new one is written before the one before goes)."""
    needs = []
    missing: dict[str, list[int]] = {}
    for other in (k for k in window.admitted() if k != key):
        held = store.sizes(shard_dir(other))
        if rows := [r for r in Shard.parse(other).rows if f"{r}{SAMPLE_SUFFIX}" not in held]:
            missing[other] = rows
    if rows := [r for rs in missing.values() for r in rs]:
        needs.append((
            f"{len(rows):,} rows of the other admitted shards ({', '.join(missing)})",
            spec.projected_bytes(sum(tset.row_length(r) for r in rows), len(rows)),
        ))  # fmt: skip
    kept = sum(sample_row(n) is not None for n in store.listdir(REPLAY_DIR))
    if (todo := max(0, reservoir_rows - kept)) and tset.num_rows:
        needs.append((
            f"{todo:,} rows {REPLAY_DIR}/ has yet to keep (training.replay_reservoir_rows={reservoir_rows}, {kept:,} kept)",
            spec.projected_bytes(tset.num_tokens * todo // tset.num_rows, todo),
        ))  # fmt: skip
    for family in window.families:
        root = family_spec(family).root
        if steps := list_checkpoints(store.child(root)):
            newest = f"{root}/{checkpoint_rel(steps[-1])}".lstrip("/")
            needs.append((f"a checkpoint of {family} (as large as {newest})", store.tree_bytes(newest)))
    return needs


class RollingLoader:
    """The pass's batches for one rank, shard after shard; waits at each shard until it may be read.

    Offers what the training loop uses of `BatchLoader` (iterate, steps_in_epoch,
    position_after, total_steps, samples), an epoch being a shard.
    """

    def __init__(
        self,
        store: ArtifactStore,
        plan: RollingPlan,
        *,
        batch_tokens: int,
        seed: int,
        rank: int,
        world_size: int,
        order: BatchOrder,
        workers: int,
        wait_for: Callable[[int], None],
    ):
        self.plan = plan
        self.loaders = [
            BatchLoader(
                store, refs, batch_tokens=batch_tokens, seed=seed, rank=rank, world_size=world_size, order=order,
                workers=workers,
            )  # fmt: skip
            for refs in plan.train
        ]
        self.wait_for = wait_for

    @property
    def samples(self) -> list[SampleRef]:
        return [r for refs in self.plan.train for r in refs]

    def steps_in_epoch(self, epoch: int) -> int:
        return self.loaders[epoch].steps_in_epoch(epoch) if epoch < len(self.loaders) else 0

    def steps_before(self, shard: int) -> int:
        return sum(self.steps_in_epoch(k) for k in range(shard))

    def total_steps(self, epochs: float = 1.0) -> int:
        return max(1, self.steps_before(len(self.loaders)))

    def position_after(self, pos: DataPosition) -> DataPosition:
        nxt = DataPosition(pos.epoch, pos.batch + 1)
        return nxt if nxt.batch < self.steps_in_epoch(pos.epoch) else DataPosition(pos.epoch + 1, 0)

    def ends_shard(self, pos: DataPosition) -> bool:
        return self.position_after(pos).epoch != pos.epoch

    def iterate(self, start: DataPosition = DataPosition()) -> Iterator[tuple[DataPosition, Batch]]:
        for k in range(start.epoch, len(self.loaders)):
            self.wait_for(k)
            first = DataPosition(k, start.batch if k == start.epoch else 0)
            # One shard at a time: nothing of shard k+1 is read before shard k is trained, so a window of one
            # shard never waits on itself.
            yield from self.loaders[k].iterate(first, one_epoch=True)


def manifest_format(store: ArtifactStore, key: str) -> SampleFormat:
    m = ShardManifest.read(store, key)
    if m is None:
        raise ManifestError(f"shard {key} has no manifest: it was never completed")
    return SampleFormat(m.hidden_size, m.aux_layer_ids, m.model, m.dtype)


@dataclass
class ShardWindow:
    """One family's side of the window: wait for a shard, and record it once learnt, releasing it once every family
    training from the window (`families`) has."""

    store: ArtifactStore
    plan: RollingPlan
    is_main: bool
    poll_s: float
    wait_s: float
    log: LogFn
    on_event: Callable[[dict], None] | None = None
    family: FamilySpec = EAGLE3  # whose records this trainer writes
    families: tuple[str, ...] = (EAGLE3.name,)  # every family that must consume a shard before it is released

    @property
    def name(self) -> str:
        """The family's drafter asset, as its log lines start."""
        return self.family.drafter_asset

    def wait_for(self, k: int) -> SampleFormat:
        """Block until shard k passed its check (or was consumed already); its format from the manifest."""
        key = self.plan.keys[k]
        start = time.monotonic()
        next_note = 0.0
        while True:
            if read_consumed_one(self.store, key, self.family.name) is not None:
                return manifest_format(self.store, key)
            verdict = check_verdict(self.store, key)
            if verdict == "passed" and (lost := lost_sample_files(self.store, key)) is not None:
                if self.is_main:  # it reads as failed wherever the window is read (UI, the next run's refusal)
                    write_check_record(self.store, key, passed=False, problems=1)
                if released_by := self._released_by_others(key):
                    family = self.family.name
                    records = self.store.url_of(window_dir(family))
                    raise ShardFailedError(
                        f"shard {key} (#{k + 1} of {len(self.plan.keys)} in training order) was released once "
                        f"{', '.join(released_by)} consumed it, before {family} did: {family} joined the "
                        f"rolling pass after it began (or its records under {records} were removed): {lost}. "
                        f"Materialize the shard again (the window admits it until {family} consumed it, and its "
                        f"rows are extracted again), then materialize `{self.name}`"
                    )
                raise ShardFailedError(
                    f"shard {key} (#{k + 1} of {len(self.plan.keys)} in training order) lost sample files after its "
                    f"integrity check passed: {lost}. It now reads as failed: training stops at it, and no later "
                    f"shard is trained before it. Materialize the shard again (its missing rows are extracted), then "
                    f"materialize `{self.name}`"
                )
            if verdict == "passed":
                return manifest_format(self.store, key)
            if verdict == "failed":
                raise ShardFailedError(
                    f"shard {key} (#{k + 1} of {len(self.plan.keys)} in training order) failed its integrity check: "
                    "training stops at it, and no later shard is trained before it. Repair it (the `verify_shards` "
                    f"job names the bad files; materialize the shard again), then materialize `{self.name}`"
                )
            waited = time.monotonic() - start
            if waited > self.wait_s:
                raise ShardWaitTimeout(
                    f"shard {key} (#{k + 1} of {len(self.plan.keys)}) has not passed its integrity check after "
                    f"{waited:.0f} s (training.shard_wait_s={self.wait_s:g}); is extraction running"
                    + (
                        ""
                        if len(self.families) == 1
                        else f", and the trainer of every family ({', '.join(self.families)}): the window moves on "
                        "once all of them consumed a shard"
                    )
                    + "? The next run resumes from the newest checkpoint"
                )
            if self.is_main and waited >= next_note:
                state = "extracted, awaiting its check" if self.store.exists(manifest_path(key)) else "not extracted yet"
                self.log(f"{self.name}: waiting for shard {key} (#{k + 1} of {len(self.plan.keys)}): {state}")
                next_note = waited + 60.0
            time.sleep(self.poll_s)

    def started(self, k: int) -> None:
        if self.is_main and self.on_event is not None:
            self.on_event({"shard": self.plan.keys[k], "state": "training"})

    def consumed(self, k: int, step: int) -> None:
        """Shard k's last batch was step `step`, and checkpoint step_<step> is published: record, then release once
        every family has."""
        if self.is_main:
            self._consume(k, step)
        barrier()

    def _consume(self, k: int, step: int) -> None:
        key = self.plan.keys[k]
        checkpoint = f"{self.family.root}/{checkpoint_rel(step)}".lstrip("/")
        # The one write before the shard's bytes may go: a record of a few hundred bytes, so no file leaves the shard
        # before every family's record exists.
        record = record_consumed(self.store, key, step=step, checkpoint=checkpoint, family=self.family.name)
        crash_point(f"recorded:{key}")
        # Before the release may delete them: every family keeps the same seeded rows (identical files), so whichever
        # releases the shard has kept them. The one that releases it moves them (no new bytes: on a full disk a copy
        # would fail before the release that frees the shard's gigabytes, every time); the others copy them.
        releasing = all(read_consumed_one(self.store, key, f) is not None for f in self.families if f != self.family.name)
        self._keep_rows(k, move=releasing)
        done, waiting = release_when_consumed(self.store, record, self.family.name, self.families)
        crash_point(f"released:{key}")
        if waiting:
            self.log(
                f"{self.name}: shard {key} consumed at step {step}; kept on disk until {', '.join(waiting)} consumed it"
            )
        else:
            self.log(f"{self.name}: shard {key} consumed at step {step}; released {done.bytes_released:,} bytes")
        if self.on_event is not None:
            state = "consumed" if waiting else "released"
            self.on_event({"shard": key, "state": state, "step": step, "bytes_released": done.bytes_released})

    def reconcile(self, next_shard: int, steps_before: Callable[[int], int]) -> None:
        """After a resume: every shard before `next_shard` is learnt by the checkpoint; finish its record, and its
        release when every family has consumed it. Rank 0 decides and writes, alone: the others wait for it once."""
        if self.is_main:
            for k in range(next_shard):
                key = self.plan.keys[k]
                record = read_consumed_one(self.store, key, self.family.name)
                if record is not None and (record.released or self._released_by_others(key)):
                    continue
                self._consume(k, steps_before(k + 1))
        barrier()

    def _released_by_others(self, key: str) -> list[str]:
        """The other families whose trainer released shard `key` (deleted its files)."""
        others = [f for f in self.families if f != self.family.name]
        return [f for f in others if (r := read_consumed_one(self.store, key, f)) is not None and r.released]

    def _keep_rows(self, k: int, *, move: bool) -> None:
        """Keep shard k's held-out rows (the first shard's) and reservoir rows out of the shard, moved or copied."""
        # Copied again over an earlier run's copies (another target's states, say); a continuation's held-out rows
        # are the release's, whose shard is gone: their copies are the ones that run made.
        held = [(SampleRef(r.shard, r.row, r.length).rel, r.rel) for r in self.plan.heldout] if k == 0 else []
        kept = [(r.rel, f"{REPLAY_DIR}/{r.row}{SAMPLE_SUFFIX}") for r in (self.plan.keep[k] if self.plan.keep else ())]
        for source, dest in held + kept:
            try:
                if move:
                    self.store.move(source, dest)
                elif self.store.exists(source):
                    self.store.write_bytes(dest, self.store.read_bytes(source))
            except FileNotFoundError:
                pass  # another family released the shard, keeping these first (or a kill after this move)

    def start_over(self) -> None:
        """This trainer starts a pass at step 0: it clears its family's window records of the pass's shards (another
        run's), and trims the replay reservoir to the rows this plan keeps. Rank 0 alone; the others wait."""
        if self.is_main:
            if removed := start_over(self.store, self.plan.keys, self.family.name):
                self.log(
                    f"{self.name}: a new pass starts at step 0; {len(removed)} of its shards were consumed by another "
                    f"run ({removed[0]}{', …' if len(removed) > 1 else ''}): their window records are cleared, and "
                    "the window admits them again (released ones are extracted again)"
                )
            keep = {f"{r}{SAMPLE_SUFFIX}" for r in self.plan.reservoir_rows()}
            for name in self.store.listdir(REPLAY_DIR):
                if name not in keep:
                    self.store.remove(f"{REPLAY_DIR}/{name}")
        barrier()
