"""The hidden-states file protocol between our vLLM connector (the writer) and the extractor (the reader).

One `/v1/completions` request per row; the connector (`connector.py`, inside the vLLM
server) writes the row's hidden states to a file and the answer names it in
`kv_transfer_params.hidden_states_path`. Two kinds of file:

- a sample file, in our format (`hidden_states/sample_file.py`), written straight into
  the shard directory of a store the server can see, when the request carries
  `kv_transfer_params = sample_params(...)`: one write per sample;
- otherwise vLLM's raw file in the server's own storage directory (`hidden_states`
  [T, L, H] for the sorted layer ids, `token_ids` [T]), which the extractor reads,
  re-encodes and deletes: the path for stores the server cannot see.

The server answers before the file is on disk: the connector holds an exclusive lock
on `lock_path(file)` from before the answer until the file is complete, so the reader
takes a shared lock and waits exactly as long as needed. Lock names are temporaries of
the store (`.<name>.tmp-lock`): never listed, and swept by a rerun.

No vLLM import here: both sides use this module.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_assets.hidden_states.sample_file import SampleSpec
from eagle3_assets.storage import TMP_MARK

SERVER_INFO_FILE = "eagle3_server.json"  # in the storage dir, next to the raw hidden-state files
PARAMS_KEY = "eagle3_sample"  # our part of a request's kv_transfer_params


def lock_path(path: str | Path) -> str:
    path = Path(path)
    return str(path.parent / f".{path.name}{TMP_MARK}lock")


def temporary_path(path: str | Path, tag: str) -> str:
    """Where a writer puts `path`'s bytes before renaming them into place: a store temporary."""
    path = Path(path)
    return str(path.parent / f".{path.name}{TMP_MARK}{tag}")


def wait_until_written(path: str | Path) -> None:
    """Block until the writer of `path` released its lock; the lock file is removed."""
    lock = lock_path(path)
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
    except FileNotFoundError:
        return  # the writer finished (and a reader removed the lock) or never locked
    Path(lock).unlink(missing_ok=True)


@contextmanager
def raw_hidden_states_file(path: str) -> Iterator[Path]:
    """A raw file the server wrote in its own directory, once complete; removed afterwards (the server never does)."""
    try:
        wait_until_written(path)
        yield Path(path)
    finally:
        for p in (path, lock_path(path)):
            Path(p).unlink(missing_ok=True)


def mask_spans(mask: np.ndarray) -> list[list[int]]:
    """[start, end) runs of 1 in a 0/1 mask: a loss mask is one or a few runs, so this stays short on the wire."""
    m = np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def mask_from_spans(spans: list[list[int]], length: int) -> np.ndarray:
    mask = np.zeros(length, dtype=np.uint8)
    for a, b in spans:
        mask[a:b] = 1
    return mask


@dataclass(frozen=True)
class SampleParams:
    """What the connector needs to write a row's sample file itself."""

    path: str
    row: int
    loss_spans: list[list[int]]
    spec: SampleSpec

    def to_kv_transfer_params(self) -> dict[str, Any]:
        s = self.spec
        return {
            "hidden_states_path": self.path,
            PARAMS_KEY: {
                "row": self.row,
                "loss_spans": self.loss_spans,
                "hidden_size": s.hidden_size,
                "aux_layer_ids": list(s.aux_layer_ids),
                "dtype": s.dtype,
                "model": s.model,
                "last_hidden_state_norm": s.last_hidden_state_norm,
            },
        }

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any]) -> SampleParams | None:
        """The sample request carried by a request's kv_transfer_params, or None for a raw-file request."""
        ours = params.get(PARAMS_KEY)
        if not ours:
            return None
        spec = SampleSpec(
            hidden_size=int(ours["hidden_size"]),
            aux_layer_ids=tuple(int(i) for i in ours["aux_layer_ids"]),
            dtype=str(ours["dtype"]),
            model=str(ours["model"]),
            last_hidden_state_norm=str(ours["last_hidden_state_norm"]),
        )
        return cls(str(params["hidden_states_path"]), int(ours["row"]), [list(s) for s in ours["loss_spans"]], spec)


def is_under(path: str | Path, root: str | Path) -> bool:
    """Whether `path` lies inside `root` once both are resolved (no `..` escapes)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([p, r]) == r
