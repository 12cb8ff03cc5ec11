"""Hidden-state samples for drafter training: the shard guard, the sample index, batches.

Samples are `hidden_states/<shard key>/<row>.safetensors` (docs/DESIGN.md §4, the format
in `sample_file.py`). Indexing reads only each file's header (a few hundred
bytes), so the whole set is checked for format, shapes and one consistent set of aux
layers before training starts; a bad file is named. Batches read one file at a time,
memory-mapped when the store is local; a shard is never held in RAM. Every sample is
checked for non-finite values as it is read (a file corrupted after its check passed
must not turn training into NaN), and float8 files are dequantized here.

Order is a pure function of (seed, epoch): each epoch shuffles the samples and fills
batches under the token budget in that order. How a batch holds its samples
(`batch_order`):
  packed     several samples per row, first fit into rows as wide as the longest
             sample, each sample attending only to itself (`Batch.segments`): a random
             draw with little padding;
  random     one sample per row, padded to the batch's longest;
  by_length  one sample per row, neighbours of similar length grouped first: little
             padding, but where length follows content (templated data) each batch is
             one kind of row, and the drafter learns measurably less per step
             (BENCHMARKS.md).
A run resumes from a `DataPosition` (epoch, batch) by recomputing that epoch's plan
and skipping to the batch.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.sample_file import (
    HIDDEN_NAMES,
    MANIFEST_NAME,
    SAMPLE_SUFFIX,
    TOKEN_NAMES,
    decode_hidden,
    describe_header,
    manifest_path,
    read_header,
    sample_path,
    sample_row,
    shard_dir,
    tensor_names,
)
from eagle3_assets.storage import ArtifactStore
# Samples per shuffle window whose lengths are sorted before batching ("by_length"): large
# enough that neighbours have similar lengths, small enough that the order stays random.
_LENGTH_WINDOW = 256

BatchOrder = Literal["packed", "random", "by_length"]


class DataError(TrainingError):
    """Hidden-state data that cannot be trained on; the message names the file or shard."""


class MissingShardsError(DataError):
    """Training was asked to start before every shard was complete."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        super().__init__(
            f"{len(missing)} hidden-state shard(s) are not complete (no {MANIFEST_NAME}): "
            + ", ".join(missing)
            + ". Materialize them first; training on part of the data would be silent."
        )


def missing_shards(store: ArtifactStore, shard_keys: Sequence[str]) -> list[str]:
    """The keys among `shard_keys` whose shard has no success manifest, in the given order."""
    return [k for k in shard_keys if not store.exists(manifest_path(k))]


def require_complete_shards(store: ArtifactStore, shard_keys: Sequence[str]) -> None:
    if not shard_keys:
        raise DataError("no hidden-state shards given: nothing to train on")
    missing = missing_shards(store, shard_keys)
    if missing:
        raise MissingShardsError(missing)


# -- the sample index ---------------------------------------------------------


@dataclass(frozen=True)
class SampleRef:
    shard: str
    row: int
    length: int  # tokens
    copied_to: str | None = None  # a directory holding a copy, read instead of the shard (rolling held-out rows)

    @property
    def rel(self) -> str:
        if self.copied_to is not None:
            return f"{self.copied_to}/{self.row}{SAMPLE_SUFFIX}"
        return sample_path(self.shard, self.row)


@dataclass(frozen=True)
class SampleFormat:
    """What every sample of one training set shares."""

    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    model: str
    storage_dtype: str


def _check_sample(store: ArtifactStore, rel: str) -> tuple[int, SampleFormat]:
    """(length, format) of one file from its header, or DataError naming it and the fault."""
    with store.open(rel) as f:
        header, problem = read_header(f)
    if problem is None:
        summary, problem = describe_header(header)
    if problem is not None:
        raise DataError(f"{store.url_of(rel)}: {problem}")
    return summary.length, SampleFormat(summary.hidden_size, summary.aux_layer_ids, summary.model, summary.dtype)


def index_samples(store: ArtifactStore, shard_keys: Sequence[str]) -> tuple[list[SampleRef], SampleFormat]:
    """Every sample of the shards, in (shard, row) order, checked from headers to share one format."""
    refs: list[SampleRef] = []
    fmt: SampleFormat | None = None
    first = ""
    for key in shard_keys:
        rows = sorted(row for n in store.listdir(shard_dir(key)) if (row := sample_row(n)) is not None)
        for row in rows:
            ref_rel = sample_path(key, row)
            length, f = _check_sample(store, ref_rel)
            if fmt is None:
                fmt, first = f, ref_rel
            elif (f.hidden_size, f.aux_layer_ids) != (fmt.hidden_size, fmt.aux_layer_ids):
                raise DataError(
                    f"{store.url_of(ref_rel)}: hidden size {f.hidden_size}, aux layers {list(f.aux_layer_ids)} "
                    f"differ from {store.url_of(first)} ({fmt.hidden_size}, {list(fmt.aux_layer_ids)}): "
                    "the shards were extracted with different settings"
                )
            refs.append(SampleRef(key, row, length))
    if fmt is None:
        raise DataError(f"no samples in shards {list(shard_keys)}")
    return refs, fmt


def split_heldout(samples: Sequence[SampleRef], n: int, seed: int) -> tuple[list[SampleRef], list[SampleRef]]:
    """(train, held-out): `n` samples drawn with `seed`, the rest in index order."""
    if n >= len(samples):
        raise DataError(
            f"heldout_rows={n} leaves nothing to train on: the shards hold {len(samples)} samples"
        )
    pick = set(np.random.default_rng([seed, 0x4E1D]).permutation(len(samples))[:n].tolist())
    train = [s for i, s in enumerate(samples) if i not in pick]
    held = [s for i, s in enumerate(samples) if i in pick]
    return train, held


# -- batches ------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, 0-padded
    loss_mask: torch.Tensor  # [B, T] uint8, 0-padded
    aux: torch.Tensor  # [B, T, 3H] storage dtype
    last: torch.Tensor  # [B, T, H] storage dtype
    lengths: torch.Tensor  # [B] int64: tokens used in each row
    pre_norm: torch.Tensor  # [B] (packed: [B, T]) bool: last_hidden_state stored before the final norm
    samples: list[SampleRef] = field(default_factory=list)
    # Packed rows only: which sample of its row each token belongs to (-1: padding) and its
    # position within that sample; None when each row is one sample.
    segments: torch.Tensor | None = None  # [B, T] int64
    positions: torch.Tensor | None = None  # [B, T] int64

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device | str) -> Batch:
        nb = torch.device(device).type == "cuda"
        tensors = (self.input_ids, self.loss_mask, self.aux, self.last, self.lengths, self.pre_norm)
        return Batch(
            *(t.to(device, non_blocking=nb) for t in tensors),
            self.samples,
            *(None if t is None else t.to(device, non_blocking=nb) for t in (self.segments, self.positions)),
        )


def load_sample(store: ArtifactStore, ref: SampleRef) -> tuple[dict[str, torch.Tensor], bool]:
    """(tensors, pre_norm) of one sample, hidden states decoded; memory-mapped from local stores.

    DataError naming the file when it cannot be read, has another length than indexed, or
    holds a non-finite value (checked here, as it is read: a check that passed earlier says
    nothing about the bytes now on disk).
    """
    local = store.local_path(ref.rel)
    try:
        if local is not None:
            with safe_open(str(local), framework="pt") as f:
                names = [n for n in f.keys() if n in tensor_names("float8_e4m3fn")]
                raw = {k: f.get_tensor(k) for k in names}
                meta = f.metadata() or {}
        else:
            data = store.read_bytes(ref.rel)
            raw = st_load(data)
            meta = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]]).get("__metadata__") or {}
        tensors = {k: raw[k] for k in TOKEN_NAMES} | {k: decode_hidden(raw, k) for k in HIDDEN_NAMES}
    except (OSError, RuntimeError, KeyError) as e:
        raise DataError(f"{store.url_of(ref.rel)}: cannot read sample: {e}") from e
    if tensors["input_ids"].shape[0] != ref.length:
        raise DataError(f"{store.url_of(ref.rel)}: {tensors['input_ids'].shape[0]} tokens, indexed as {ref.length}")
    for name in HIDDEN_NAMES:
        bad = int((~torch.isfinite(tensors[name])).sum())
        if bad:
            raise DataError(
                f"{store.url_of(ref.rel)}: {name} has {bad} non-finite values; re-extract it "
                "(run the `verify_shards` job, then materialize the shard it names)"
            )
    return tensors, meta.get("last_hidden_state_norm") == "pre_norm"


Loaded = Sequence[tuple[dict[str, torch.Tensor], bool]]  # (tensors, pre_norm) per sample, from load_sample


def _place_rows(loaded: Loaded, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    """Samples laid out in rows, each row its samples end to end, 0-padded to the longest row:
    ids, loss mask, aux, last [R, T(, width)], tokens used per row [R], and per token its
    pre_norm flag, sample within the row (-1: padding) and position within the sample [R, T]."""
    used = [sum(loaded[i][0]["input_ids"].shape[0] for i in row) for row in rows]
    R, T = len(rows), max(used)
    first = loaded[0][0]
    ids = torch.zeros(R, T, dtype=torch.int64)
    mask = torch.zeros(R, T, dtype=torch.uint8)
    aux = torch.zeros(R, T, first["aux_hidden_states"].shape[1], dtype=first["aux_hidden_states"].dtype)
    last = torch.zeros(R, T, first["last_hidden_state"].shape[1], dtype=first["last_hidden_state"].dtype)
    pre = torch.zeros(R, T, dtype=torch.bool)
    segments = torch.full((R, T), -1, dtype=torch.int64)
    positions = torch.zeros(R, T, dtype=torch.int64)
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row):
            t, pre_norm = loaded[i]
            n = t["input_ids"].shape[0]
            span = slice(start, start + n)
            ids[r, span], mask[r, span] = t["input_ids"], t["loss_mask"]
            aux[r, span], last[r, span] = t["aux_hidden_states"], t["last_hidden_state"]
            pre[r, span], segments[r, span] = pre_norm, seg
            positions[r, span] = torch.arange(n)
            start += n
    return ids, mask, aux, last, torch.tensor(used), pre, segments, positions


def collate(loaded: Loaded, refs: Sequence[SampleRef]) -> Batch:
    """One 0-padded row per sample, in the given order."""
    ids, mask, aux, last, lengths, _, _, _ = _place_rows(loaded, [[i] for i in range(len(loaded))])
    pre = torch.tensor([p for _, p in loaded], dtype=torch.bool)
    return Batch(ids, mask, aux, last, lengths, pre, list(refs))


def collate_packed(loaded: Loaded, refs: Sequence[SampleRef], width: int) -> Batch:
    """The samples first-fit into rows of `width` tokens (`pack_rows`), in the given order."""
    rows = pack_rows([t["input_ids"].shape[0] for t, _ in loaded], width)
    ids, mask, aux, last, used, pre, segments, positions = _place_rows(loaded, rows)
    return Batch(ids, mask, aux, last, used, pre, [refs[i] for row in rows for i in row], segments, positions)


def _first_fit(room: list[int], n: int, width: int) -> int:
    """Place `n` tokens in the first row of `room` (free tokens per row) that has them, else a new row; its index."""
    for r, free in enumerate(room):
        if n <= free:
            room[r] -= n
            return r
    room.append(width - n)  # below 0 for a sample longer than the width: a row of its own
    return len(room) - 1


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First fit of samples (their lengths, in order) into rows of `width` tokens: indices per row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        r = _first_fit(room, n, width)
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
    return rows


def fill_packed(lengths: Sequence[int], order: Sequence[int], budget: int, width: int) -> list[list[int]]:
    """Batches of `order` whose first-fit rows of `width` tokens number at most budget // width (at least one)."""
    max_rows = max(1, budget // width)
    batches: list[list[int]] = []
    cur: list[int] = []
    room: list[int] = []
    for i in order:
        # A sample that fits no open row of a full batch starts the next batch.
        if cur and len(room) >= max_rows and all(lengths[i] > free for free in room):
            batches.append(cur)
            cur, room = [], []
        _first_fit(room, lengths[i], width)
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def fill_batches(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy batches of `order` (sample indices) with padded size max_len * count <= budget.

    A sample longer than the budget is a batch of its own: it is never truncated, so
    the budget bounds memory only up to the longest row (max_seq_len upstream).
    """
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = lengths[i]
        if cur and max(cur_max, n) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def packing_width(lengths: Sequence[int], budget: int) -> int:
    """Row width of packed batches: the longest sample, so none is split, within the budget."""
    return max(1, min(max(lengths), budget))


def plan_epoch(
    lengths: Sequence[int], epoch: int, seed: int, budget: int, order_by: BatchOrder = "random"
) -> list[list[int]]:
    """The batches (lists of sample indices) of one epoch: a pure function of its arguments."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if order_by == "packed":
        return fill_packed(lengths, order.tolist(), budget, packing_width(lengths, budget))
    if order_by == "random":
        return fill_batches(lengths, order.tolist(), budget)
    batches: list[list[int]] = []
    for w in range(0, len(order), _LENGTH_WINDOW):
        window = sorted(order[w : w + _LENGTH_WINDOW].tolist(), key=lambda i: (-lengths[i], i))
        batches.extend(fill_batches(lengths, window, budget))
    return [batches[i] for i in rng.permutation(len(batches))]


def split_batch(lengths: Sequence[int], batch: Sequence[int], world_size: int) -> list[list[int]]:
    """One batch's samples dealt to `world_size` ranks, each (longest first) to the rank with the fewest
    tokens so far: every rank about the same work, and every rank at least one sample when there are enough."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for i in sorted(batch, key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares


@dataclass(frozen=True, order=True)
class DataPosition:
    """The next batch to train on: `batch` counts this rank's steps within `epoch`."""

    epoch: int = 0
    batch: int = 0


class BatchLoader:
    """Training batches of one rank, in the planned order, loaded ahead by worker threads.

    The plan does not depend on the number of ranks: with `world_size` ranks each planned batch
    (of `batch_tokens`) is dealt out between them (`split_batch`), so one optimizer step over all
    ranks trains the batch one process would; a batch with fewer samples than ranks is skipped.
    """

    def __init__(
        self,
        store: ArtifactStore,
        samples: Sequence[SampleRef],
        *,
        batch_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        order: BatchOrder = "random",
        prefetch: int = 4,
        workers: int = 2,
    ):
        if not samples:
            raise DataError("no training samples")
        self.store = store
        self.samples = list(samples)
        self.lengths = [s.length for s in self.samples]
        self.budget = batch_tokens
        self.seed, self.rank, self.world_size, self.order = seed, rank, world_size, order
        self.prefetch, self.workers = max(1, prefetch), max(1, workers)
        self._plans: dict[int, list[list[int]]] = {}

    def rank_plan(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch` (sample indices), cached."""
        if epoch not in self._plans:
            plan = plan_epoch(self.lengths, epoch, self.seed, self.budget, self.order)
            if self.world_size > 1:
                n = self.world_size
                plan = [split_batch(self.lengths, b, n)[self.rank] for b in plan if len(b) >= n]
            self._plans[epoch] = plan
        return self._plans[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.rank_plan(epoch))

    def total_steps(self, epochs: float) -> int:
        """Optimizer steps in `epochs` (a fractional last epoch is rounded to whole steps)."""
        whole = int(epochs)
        total = sum(self.steps_in_epoch(e) for e in range(whole))
        if epochs > whole:
            total += round((epochs - whole) * self.steps_in_epoch(whole))
        return max(total, 1)

    def position_after(self, pos: DataPosition) -> DataPosition:
        nxt = DataPosition(pos.epoch, pos.batch + 1)
        return nxt if nxt.batch < self.steps_in_epoch(pos.epoch) else DataPosition(pos.epoch + 1, 0)

    def load(self, indices: Sequence[int]) -> Batch:
        refs = [self.samples[i] for i in indices]
        loaded = [load_sample(self.store, r) for r in refs]
        if self.order == "packed":
            return collate_packed(loaded, refs, packing_width(self.lengths, self.budget))
        return collate(loaded, refs)

    def iterate(self, start: DataPosition = DataPosition(), *, one_epoch: bool = False) -> Iterator[tuple[DataPosition, Batch]]:
        """(position, batch) from `start` on, endlessly across epochs (the caller stops), or to the end of
        `start`'s epoch with `one_epoch`, loading nothing past it."""

        def positions() -> Iterator[DataPosition]:
            pos = start
            while True:
                if pos.batch >= self.steps_in_epoch(pos.epoch):
                    if one_epoch:
                        return
                    if self.steps_in_epoch(pos.epoch) == 0:
                        raise DataError(
                            f"epoch {pos.epoch} has no batches for rank {self.rank} of {self.world_size}: "
                            f"too few samples ({len(self.samples)}) for the world size"
                        )
                    pos = DataPosition(pos.epoch + 1, 0)
                    continue
                yield pos
                pos = DataPosition(pos.epoch, pos.batch + 1)

        with ThreadPoolExecutor(self.workers, thread_name_prefix="drafter-data") as pool:
            pending: deque[tuple[DataPosition, Future[Batch]]] = deque()
            source = positions()
            try:
                while True:
                    while len(pending) < self.prefetch and (pos := next(source, None)) is not None:
                        pending.append((pos, pool.submit(self.load, self.rank_plan(pos.epoch)[pos.batch])))
                    if not pending:
                        return
                    pos, fut = pending.popleft()
                    yield pos, fut.result()
            finally:
                for _, fut in pending:
                    fut.cancel()


def heldout_batches(samples: Sequence[SampleRef], budget: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Held-out batches of this rank: sorted by length (little padding), no shuffle."""
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].length, i))
    return fill_batches([s.length for s in samples], order, budget)[rank::world_size]
