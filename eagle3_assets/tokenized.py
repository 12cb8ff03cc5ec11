"""The tokenized conversation set: flat arrays plus row offsets (DESIGN §2).

Row r is `input_ids[offsets[r]:offsets[r+1]]` with the matching `loss_mask` slice
(1 exactly on assistant tokens). One safetensors file holds all of it; `row_ids`
keeps the id of the `responses` row each tokenized row came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from transformers import PreTrainedTokenizerBase

from eagle3_assets.chat import ChatTemplateError, render_with_loss_mask
from eagle3_assets.storage import ArtifactStore

TOKENIZED_FILE = "tokenized/tokenized.safetensors"


@dataclass(frozen=True)
class TokenizedSet:
    input_ids: np.ndarray  # [total_tokens] int32
    loss_mask: np.ndarray  # [total_tokens] uint8
    offsets: np.ndarray  # [num_rows + 1] int64, offsets[0] == 0
    row_ids: np.ndarray  # [num_rows] int64: index of the source row in `responses`

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} differ")
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.input_ids):
            raise ValueError("offsets must start at 0 and end at the number of tokens")
        if np.any(np.diff(self.offsets) <= 0):
            raise ValueError("every row needs at least one token (offsets must increase)")
        if len(self.row_ids) != self.num_rows:
            raise ValueError(f"{len(self.row_ids)} row ids for {self.num_rows} rows")

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

    def to_bytes(self, metadata: dict[str, str] | None = None) -> bytes:
        return st_save(
            {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "offsets": self.offsets, "row_ids": self.row_ids},
            metadata=metadata,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenizedSet:
        t = st_load(data)
        return cls(t["input_ids"], t["loss_mask"], t["offsets"], t["row_ids"])

    def save(self, store: ArtifactStore, metadata: dict[str, str] | None = None) -> int:
        return store.write_bytes(TOKENIZED_FILE, self.to_bytes(metadata))

    @classmethod
    def load(cls, store: ArtifactStore) -> TokenizedSet:
        return cls.from_bytes(store.read_bytes(TOKENIZED_FILE))


@dataclass(frozen=True)
class TokenizeSummary:
    rows_in: int
    rows: int
    rows_failed_generation: int  # responses rows with an error, skipped
    rows_truncated: int
    rows_dropped_overlong: int
    rows_dropped_no_assistant_tokens: int
    tokens: int
    loss_tokens: int
    max_row_tokens: int
    mean_row_tokens: float


def tokenize_responses(
    records: list[dict], tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, overlong: str
) -> tuple[TokenizedSet, TokenizeSummary]:
    """Render every successful conversation; truncate or drop rows over `max_seq_len`."""
    rows: list[tuple[list[int], list[int]]] = []
    row_ids: list[int] = []
    failed = truncated = dropped_long = dropped_empty = 0
    for record in records:
        if record.get("error"):
            failed += 1
            continue
        try:
            rendered = render_with_loss_mask(tokenizer, record["messages"])
        except ChatTemplateError as e:
            raise ChatTemplateError(f"responses row {record.get('row')} (id {record.get('id')}): {e}") from None
        ids, mask = rendered.input_ids, rendered.loss_mask
        if len(ids) > max_seq_len:
            if overlong == "drop":
                dropped_long += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            truncated += 1
        if not any(mask):
            dropped_empty += 1
            continue
        rows.append((ids, mask))
        row_ids.append(int(record["row"]))
    if not rows:
        raise ValueError(f"no usable rows out of {len(records)} responses ({failed} failed generation)")
    tset = TokenizedSet.from_rows(rows, row_ids)
    lengths = np.diff(tset.offsets)
    return tset, TokenizeSummary(
        rows_in=len(records),
        rows=tset.num_rows,
        rows_failed_generation=failed,
        rows_truncated=truncated,
        rows_dropped_overlong=dropped_long,
        rows_dropped_no_assistant_tokens=dropped_empty,
        tokens=tset.num_tokens,
        loss_tokens=int(tset.loss_mask.sum()),
        max_row_tokens=int(lengths.max()),
        mean_row_tokens=round(float(lengths.mean()), 2),
    )
