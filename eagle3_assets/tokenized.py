"""The tokenized conversation set: flat arrays plus row offsets (docs/DESIGN.md §2).

Row r is `input_ids[offsets[r]:offsets[r+1]]` with the matching `loss_mask` slice. One
safetensors file holds all of it; `row_ids` keeps the `responses` row each row came from, and
`shard_ends` the shards the rows are cut into (`plan_rows`: a row keeps its place and its shard
when rows are added; rows new to the set, appended prompts or rows retried after failing, land in
new shards after the others).

A row is token-exact: the `responses` row's `prompt_token_ids` (mask 0: the prompt and
any history turns, which the target did not write) followed by its
`completion_token_ids` (mask 1: reasoning, answer and the stop token, exactly as the
target produced them). Nothing is re-rendered, so no template behaviour (dropped
history reasoning, empty think blocks, a newline after the end-of-turn token, a stop
token it never renders) can change what is trained on. A response cut by
`max_new_tokens` is kept as generated or dropped (`unfinished_responses`), never given
an end-of-turn it did not produce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from eagle3_assets.errors import Refusal
from eagle3_assets.provenance import bytes_digest, setting_change
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore

TOKENIZED_FILE = "tokenized/tokenized.safetensors"


@dataclass(frozen=True)
class TokenizedSet:
    input_ids: np.ndarray  # [total_tokens] int32
    loss_mask: np.ndarray  # [total_tokens] uint8
    offsets: np.ndarray  # [num_rows + 1] int64, offsets[0] == 0
    row_ids: np.ndarray  # [num_rows] int64: index of the source row in `responses`
    # [num_shards] int64: where each shard ends (`plan_rows`); None in a set written before it was kept, cut then as
    # `plan_shards` cuts it.
    shard_ends: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} differ")
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.input_ids):
            raise ValueError("offsets must start at 0 and end at the number of tokens")
        if np.any(np.diff(self.offsets) <= 0):
            raise ValueError("every row needs at least one token (offsets must increase)")
        if len(self.row_ids) != self.num_rows:
            raise ValueError(f"{len(self.row_ids)} row ids for {self.num_rows} rows")
        ends = self.shard_ends
        if ends is not None and (len(ends) == 0 or ends[-1] != self.num_rows or np.any(np.diff(ends, prepend=0) <= 0)):
            raise ValueError(f"shard ends {ends.tolist()} do not cut {self.num_rows} rows into non-empty shards")

    def shards(self, shard_size: int) -> list[Shard]:
        """The shards its rows are cut into: as planned when it was made (`plan_rows`), or, in a set written before
        the plan was kept, every `shard_size` rows."""
        if self.shard_ends is None:
            return plan_shards(self.num_rows, shard_size)
        starts = [0, *self.shard_ends[:-1].tolist()]
        return [Shard(a, b) for a, b in zip(starts, self.shard_ends.tolist(), strict=True)]

    def with_shards(self, shards: list[Shard]) -> TokenizedSet:
        return replace(self, shard_ends=np.array([s.end for s in shards], dtype=np.int64))

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def row_length(self, row: int) -> int:
        return int(self.offsets[row + 1] - self.offsets[row])

    def row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of one row."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} outside the tokenized set of {self.num_rows} rows")
        a, b = self.offsets[row], self.offsets[row + 1]
        return self.input_ids[a:b], self.loss_mask[a:b]

    def tokens_in(self, start: int, end: int) -> int:
        """Tokens in rows [start, end)."""
        return int(self.offsets[end] - self.offsets[start])

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[int]]], row_ids: list[int]) -> TokenizedSet:
        lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((t for r, _ in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
        mask = np.fromiter((m for _, r in rows for m in r), dtype=np.uint8, count=int(offsets[-1]))
        return cls(ids, mask, offsets, np.asarray(row_ids, dtype=np.int64))

    def shuffled(self, seed: int) -> TokenizedSet:
        """The same rows in a seeded random order (`row_ids` follows them), so that any run of consecutive
        rows, a shard, is a uniform sample of the set: a prompt file sorted by topic or source does not
        become a drift across a single pass."""
        return self.reordered(np.random.default_rng([seed, 0x5A4D]).permutation(self.num_rows))

    def reordered(self, order: np.ndarray) -> TokenizedSet:
        """Rows `order[0]`, `order[1]`, … of this set (a permutation or a subset)."""
        lengths = np.diff(self.offsets)[order]
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        take = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in order])
        return TokenizedSet(self.input_ids[take], self.loss_mask[take], offsets, self.row_ids[order])

    def rows_digest(self, start: int, end: int) -> str:
        """A digest of rows [start, end): their tokens, masks and source row ids (what a shard is extracted from)."""
        a, b = self.offsets[start], self.offsets[end]
        lengths = np.diff(self.offsets[start : end + 1])
        return bytes_digest(
            self.input_ids[a:b].tobytes(), self.loss_mask[a:b].tobytes(), lengths.tobytes(), self.row_ids[start:end].tobytes()
        )

    def to_bytes(self, metadata: dict[str, str] | None = None) -> bytes:
        arrays = {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "offsets": self.offsets, "row_ids": self.row_ids}
        return st_save(arrays | ({"shard_ends": self.shard_ends} if self.shard_ends is not None else {}), metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenizedSet:
        t = st_load(data)
        return cls(t["input_ids"], t["loss_mask"], t["offsets"], t["row_ids"], t.get("shard_ends"))

    def save(self, store: ArtifactStore, metadata: dict[str, str] | None = None) -> int:
        return store.write_bytes(TOKENIZED_FILE, self.to_bytes(metadata))

    @classmethod
    def load(cls, store: ArtifactStore) -> TokenizedSet:
        return cls.from_bytes(store.read_bytes(TOKENIZED_FILE))


# The settings a row plan is made under: another value of any places every row again.
PLAN_SETTINGS = ("shard_size", "training.mode", "training.seed")


def replan_reason(changed: Mapping[str, tuple[Any, Any]]) -> str | None:
    """Why every row is placed again, when settings that cut the plan (`PLAN_SETTINGS`) are among those `changed`
    since the set in the store was made (`Provenance.changed_settings`: name -> (then, now)); None when none is."""
    moved = [setting_change(name, *changed[name]) for name in PLAN_SETTINGS if name in changed]
    return f"{'; '.join(moved)}: every row is placed again and every shard is cut again" if moved else None


@dataclass(frozen=True)
class RowPlan:
    """The rows in training order, cut into shards (`tset.shards`), and what became of the plan before."""

    tset: TokenizedSet
    kept_rows: int  # rows that kept their place and shard from the set before
    notes: list[str]  # why every row was placed again, when it was


def plan_rows(rows: TokenizedSet, shard_size: int, seed: int | None, previous: TokenizedSet | None, replan: str | None = None) -> RowPlan:
    """Order `rows` (in `responses` order) and cut them into shards, keeping the plan of `previous` (the set in the
    store, made under the same `PLAN_SETTINGS`; None when there is none or they differ, `replan` then saying why).

    Every row of `previous` keeps its place, so its shard keeps its rows (a shard is extracted again only when its
    own rows' content changed); rows new to the set (appended prompts, rows retried after they failed) follow in
    new shards of `shard_size` rows, in `responses` order or, with `seed` (rolling), shuffled among themselves. A
    shard that was the last and short stays short: it may be trained and released already (rolling). With no
    `previous`, or when one of its rows is gone, every row is placed again: `seed` shuffles the whole set, so any
    shard is a uniform slice of it."""
    if previous is not None:
        where = {int(r): i for i, r in enumerate(rows.row_ids.tolist())}
        gone = [int(r) for r in previous.row_ids.tolist() if int(r) not in where]
        if not gone:
            before = set(previous.row_ids.tolist())
            new = np.array([i for i, r in enumerate(rows.row_ids.tolist()) if r not in before], dtype=np.int64)
            if seed is not None and len(new):
                new = new[np.random.default_rng([seed, 0x5A4D, previous.num_rows]).permutation(len(new))]
            order = np.concatenate([np.array([where[int(r)] for r in previous.row_ids.tolist()], dtype=np.int64), new])
            tset = rows.reordered(order)
            added = [Shard(a, min(a + shard_size, tset.num_rows)) for a in range(previous.num_rows, tset.num_rows, shard_size)]
            return RowPlan(tset.with_shards(previous.shards(shard_size) + added), previous.num_rows, [])
        replan = (
            f"{len(gone)} row(s) of the tokenized set before are no longer usable (responses rows "
            f"{', '.join(map(str, gone[:5]))}{', …' if len(gone) > 5 else ''}): every row is placed again"
        )
    tset = rows.shuffled(seed) if seed is not None else rows
    return RowPlan(tset.with_shards(plan_shards(tset.num_rows, shard_size)), 0, [replan] if replan else [])


def remove_stale_shard_dirs(store: ArtifactStore, keys: list[str]) -> dict[str, int]:
    """Remove every shard directory under `hidden_states/` that is no shard of `keys` (cut for another `shard_size`
    or rows placed again): nothing trains on it, and it may hold as much as the shards that do. Returns each removed
    directory with the bytes it held."""
    # torch comes with sample_file: imported only when shards are planned.
    from eagle3_assets.sample_file import HIDDEN_STATES_DIR

    removed: dict[str, int] = {}
    for name in store.listdir(HIDDEN_STATES_DIR):
        if name in keys or not name.startswith("rows_"):  # `_leases/` and anything not a shard stay
            continue
        rel = f"{HIDDEN_STATES_DIR}/{name}"
        removed[name] = sum(store.sizes(rel).values())
        store.remove(rel, recursive=True)
    return removed


class ResponsesFormatError(Refusal, ValueError):
    """`responses` rows that do not carry the token ids a training row is made of."""


class NoUsableRowsError(Refusal, ValueError):
    """Every row was failed, dropped or empty."""


@dataclass(frozen=True)
class TokenizeSummary:
    rows_in: int
    rows: int
    rows_failed_generation: int  # responses rows with an error, skipped
    rows_unfinished: int  # cut by max_new_tokens (finish_reason length)
    rows_dropped_unfinished: int  # of those, dropped (unfinished_responses: drop)
    rows_truncated: int
    rows_dropped_overlong: int
    tokens: int
    loss_tokens: int
    max_row_tokens: int
    mean_row_tokens: float
    unfinished_ids: list[str]  # the first ids of rows cut by max_new_tokens


def tokenize_responses(
    records: list[dict], *, max_seq_len: int, overlong: str, unfinished: str
) -> tuple[TokenizedSet, TokenizeSummary]:
    """One token-exact row per successful response; truncate or drop rows over `max_seq_len`."""
    rows: list[tuple[list[int], list[int]]] = []
    row_ids: list[int] = []
    failed = truncated = dropped_long = dropped_unfinished = 0
    unfinished_ids: list[str] = []
    for record in records:
        if record.get("error"):
            failed += 1
            continue
        if "prompt_token_ids" not in record or "completion_token_ids" not in record:
            raise ResponsesFormatError(
                f"responses row {record.get('row')} (id {record.get('id')}) has no prompt_token_ids/"
                "completion_token_ids: it was generated by an earlier version of the pipeline, which kept text "
                "only. Re-materialize `responses` (parts without token ids are regenerated), then `tokenized`."
            )
        prompt, completion = list(record["prompt_token_ids"]), list(record["completion_token_ids"])
        if not completion:
            failed += 1
            continue
        if record.get("finish_reason") == "length":
            unfinished_ids.append(str(record.get("id")))
            if unfinished == "drop":
                dropped_unfinished += 1
                continue
        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        if len(ids) > max_seq_len:
            if overlong == "drop":
                dropped_long += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            truncated += 1
        rows.append((ids, mask))
        row_ids.append(int(record["row"]))
    if not rows:
        raise NoUsableRowsError(
            f"no usable rows out of {len(records)} responses ({failed} failed generation, {dropped_long} over "
            f"max_seq_len dropped, {dropped_unfinished} unfinished dropped)"
        )
    tset = TokenizedSet.from_rows(rows, row_ids)
    lengths = np.diff(tset.offsets)
    return tset, TokenizeSummary(
        rows_in=len(records),
        rows=tset.num_rows,
        rows_failed_generation=failed,
        rows_unfinished=len(unfinished_ids),
        rows_dropped_unfinished=dropped_unfinished,
        rows_truncated=truncated,
        rows_dropped_overlong=dropped_long,
        tokens=tset.num_tokens,
        loss_tokens=int(tset.loss_mask.sum()),
        max_row_tokens=int(lengths.max()),
        mean_row_tokens=round(float(lengths.mean()), 2),
        unfinished_ids=unfinished_ids[:20],
    )
