"""One sample's hidden states: the per-row safetensors file (DESIGN §2, §4).

`hidden_states/<shard key>/<row>.safetensors` holds exactly four tensors

    input_ids          [T]      int32
    loss_mask          [T]      uint8
    aux_hidden_states  [T, 3H]  storage dtype: HF hidden_states[i] for the aux ids, ascending, concatenated
    last_hidden_state  [T, H]   storage dtype: the last layer's output, pre- or post-final-norm

and string metadata: format, aux_layer_ids (JSON list), last_hidden_state_norm, model,
dtype, hidden_size, row, backend. The drafter's loader reads it with `safe_open`, so the
names here are a contract, not a detail.

`sample_problem` is the one validation both the resume scan and the integrity check
apply, so a file extraction would skip is exactly a file the check accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eagle3_assets.shards import Shard

FORMAT = "eagle3-hidden-states/1"
HIDDEN_STATES_DIR = "hidden_states"
MANIFEST_NAME = "_SUCCESS.json"
SAMPLE_SUFFIX = ".safetensors"

NormConvention = Literal["post_norm", "pre_norm"]
NORM_CONVENTIONS: tuple[str, ...] = ("post_norm", "pre_norm")

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

TENSOR_NAMES = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
MISSING = "missing"


def shard_dir(shard: Shard) -> str:
    return f"{HIDDEN_STATES_DIR}/{shard.key}"


def sample_path(shard: Shard, row: int) -> str:
    """`hidden_states/rows_0-200/17.safetensors`: row is the global tokenized row index."""
    return f"{shard_dir(shard)}/{row}{SAMPLE_SUFFIX}"


def manifest_path(shard: Shard) -> str:
    return f"{shard_dir(shard)}/{MANIFEST_NAME}"


def bytes_per_element(dtype: str) -> int:
    return torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size()


@dataclass(frozen=True)
class SampleSpec:
    """What every file of a shard must agree on. `model`/`norm` None = not checked."""

    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    dtype: str
    model: str | None = None
    last_hidden_state_norm: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype {self.dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        if self.last_hidden_state_norm is not None and self.last_hidden_state_norm not in NORM_CONVENTIONS:
            raise ValueError(f"last_hidden_state_norm {self.last_hidden_state_norm!r} is not one of {NORM_CONVENTIONS}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def bytes_per_token(self) -> int:
        """Hidden-state bytes per token: 3H aux + H last, in the storage dtype (the DESIGN §4 minimum)."""
        return 4 * self.hidden_size * bytes_per_element(self.dtype)


def encode_sample(
    *,
    row: int,
    input_ids: np.ndarray,  # [T] int32
    loss_mask: np.ndarray,  # [T] uint8
    aux_hidden_states: torch.Tensor,  # [T, 3H], any float dtype; cast to spec.dtype
    last_hidden_state: torch.Tensor,  # [T, H]
    spec: SampleSpec,
    backend: str,
) -> bytes:
    """The file's bytes. `spec.model` and `spec.last_hidden_state_norm` must be set: they are recorded."""
    if spec.model is None or spec.last_hidden_state_norm is None:
        raise ValueError("encode_sample needs spec.model and spec.last_hidden_state_norm to record them")
    dtype = STORAGE_DTYPES[spec.dtype]
    tensors = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int32)),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        "aux_hidden_states": aux_hidden_states.detach().to(device="cpu", dtype=dtype).contiguous(),
        "last_hidden_state": last_hidden_state.detach().to(device="cpu", dtype=dtype).contiguous(),
    }
    metadata = {
        "format": FORMAT,
        "aux_layer_ids": json.dumps(list(spec.aux_layer_ids)),
        "last_hidden_state_norm": spec.last_hidden_state_norm,
        "model": spec.model,
        "dtype": spec.dtype,
        "hidden_size": str(spec.hidden_size),
        "row": str(row),
        "backend": backend,
    }
    return st_save(tensors, metadata=metadata)


def read_header(data: bytes) -> tuple[dict, str | None]:
    """(safetensors header, problem) without loading the tensors; problem names truncation."""
    if len(data) < 8:
        return {}, f"truncated ({len(data)} bytes, shorter than the 8-byte header length)"
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        return {}, f"truncated ({len(data)} bytes, the header alone needs {8 + n})"
    try:
        header = json.loads(data[8 : 8 + n])
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return {}, f"unreadable (not a safetensors header: {e})"
    needed = 8 + n + max(ends, default=0)
    if len(data) < needed:
        return header, f"truncated ({len(data)} bytes, header describes {needed})"
    return header, None


def tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """Non-finite values or an all-zero tensor: what a crashed or unwritten buffer looks like."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        return f"{name} has {bad} non-finite values"
    if t.numel() == 0 or not bool(t.any()):
        return f"{name} all zero"
    return None


def sample_problem(
    data: bytes, *, row: int, input_ids: np.ndarray, loss_mask: np.ndarray, spec: SampleSpec
) -> str | None:
    """Why `data` is not a valid file for tokenized `row` (input_ids/loss_mask), or None when it is."""
    header, problem = read_header(data)
    if problem:
        return problem
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        return f"cannot load: {e}"
    if set(tensors) != set(TENSOR_NAMES):
        return f"tensors {sorted(tensors)} differ from the spec {sorted(TENSOR_NAMES)}"

    meta = header.get("__metadata__") or {}
    expected_meta = {
        "format": FORMAT,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "hidden_size": str(spec.hidden_size),
        "dtype": spec.dtype,
        "row": str(row),
    }
    if spec.model is not None:
        expected_meta["model"] = spec.model
    if spec.last_hidden_state_norm is not None:
        expected_meta["last_hidden_state_norm"] = spec.last_hidden_state_norm
    for key, want in expected_meta.items():
        got = meta.get(key)
        if key == "aux_layer_ids" and got is not None:
            try:
                got = json.loads(got)
            except ValueError:
                pass
        if got != want:
            return f"metadata {key} is {got!r}, expected {want!r}"
    norm = meta.get("last_hidden_state_norm")
    if norm not in NORM_CONVENTIONS:
        return f"metadata last_hidden_state_norm is {norm!r}, expected one of {NORM_CONVENTIONS}"

    T, H = len(input_ids), spec.hidden_size
    want_shapes = {
        "input_ids": (torch.int32, [T]),
        "loss_mask": (torch.uint8, [T]),
        "aux_hidden_states": (STORAGE_DTYPES[spec.dtype], [T, 3 * H]),
        "last_hidden_state": (STORAGE_DTYPES[spec.dtype], [T, H]),
    }
    for name, (dtype, shape) in want_shapes.items():
        t = tensors[name]
        if t.dtype != dtype:
            return f"{name} is {str(t.dtype).removeprefix('torch.')}, expected {str(dtype).removeprefix('torch.')}"
        if list(t.shape) != shape:
            return f"{name} has shape {list(t.shape)}, expected {shape} (tokenized row {row} has {T} tokens)"

    differ = int((tensors["input_ids"].numpy() != np.asarray(input_ids)).sum())
    if differ:
        return f"input_ids differ from tokenized row {row} at {differ} of {T} positions"
    differ = int((tensors["loss_mask"].numpy() != np.asarray(loss_mask)).sum())
    if differ:
        return f"loss_mask differs from tokenized row {row} at {differ} of {T} positions"
    for name in ("aux_hidden_states", "last_hidden_state"):
        problem = tensor_problem(name, tensors[name])
        if problem:
            return problem
    return None
