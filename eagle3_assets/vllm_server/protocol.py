"""The hidden-states file protocol between our vLLM connector (the writer) and the extractor (the reader).

One `/v1/completions` request per row; the connector (`connector.py`, inside the vLLM
server) writes the row's hidden states to a file and the answer names it in
`kv_transfer_params.hidden_states_path`. Two kinds of file:

- a sample file, in our format (`sample_file.py`), written straight into
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
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.storage import TMP_MARK

if TYPE_CHECKING:
    import torch

    from eagle3_assets.target import TargetModel

SERVER_INFO_FILE = "eagle3_server.json"  # in the storage dir, next to the raw hidden-state files
Role = Literal["generate", "extract", "both"]
ROLES: tuple[str, ...] = ("generate", "extract", "both")
PARAMS_KEY = "eagle3_sample"  # our part of a request's kv_transfer_params



@dataclass(frozen=True)
class ServerPlan:
    """What a server for a target extracts: written by the server as `SERVER_INFO_FILE` in its storage
    dir, read back by the extractor to check the layer ids before it writes any shard."""

    role: str
    model: str
    num_layers: int
    hidden_size: int
    aux_layer_ids: list[int]
    layer_ids: list[int]  # what an extract server writes, in file order; [] for generate

    @classmethod
    def for_target(cls, target: TargetModel, role: Role) -> ServerPlan:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        extracts = role in ("extract", "both")
        return cls(
            role,
            str(target.path),
            target.num_layers,
            target.hidden_size,
            list(target.aux_layer_ids) if extracts else [],
            target.extraction_layer_ids if extracts else [],
        )

    def write(self, storage_dir: Path) -> None:
        (storage_dir / SERVER_INFO_FILE).write_text(json.dumps(vars(self), indent=1))

    @classmethod
    def read(cls, storage_dir: Path) -> ServerPlan:
        """OSError when the file cannot be read, ValueError when it is not a plan."""
        data = json.loads((storage_dir / SERVER_INFO_FILE).read_text())
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"not a server plan: {e}") from None



def split_layers(
    states: torch.Tensor, layer_ids: Sequence[int], aux_layer_ids: Sequence[int], last_layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, len(aux) x H], last [T, H]) of vLLM's [T, L, H] states, whose layers are `layer_ids` in order."""
    index = {layer: i for i, layer in enumerate(layer_ids)}
    aux = states[:, [index[i] for i in aux_layer_ids], :].reshape(states.shape[0], -1)
    return aux, states[:, index[last_layer], :]


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
