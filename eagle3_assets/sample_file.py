"""The sample format: one row's hidden states in one safetensors file (docs/DESIGN.md §4).

This module is the one definition of the format; the writers (`shard.py`, the vLLM
connector), the integrity check and the drafter's loader all go through it.

`hidden_states/<shard key>/<row>.safetensors` holds

    input_ids                [T]      int32
    loss_mask                [T]      uint8
    aux_hidden_states        [T, 3H]  storage dtype: "input of layer i" states for the aux ids, ascending
    last_hidden_state        [T, H]   storage dtype: the last layer's output, pre- or post-final-norm
    aux_hidden_states_scale  [T]      float32, only for float8 storage: one scale per token
    last_hidden_state_scale  [T]      float32, only for float8 storage

and string metadata: format, aux_layer_ids (JSON list), last_hidden_state_norm, model,
dtype, hidden_size, row, backend. Float8 (`float8_e4m3fn`) stores `x / scale` with
`scale = max|x| / 448` over each token's row, so every token uses the whole e4m3 range;
`decode_hidden` multiplies it back. Format 2 added the scales; files of format 1 (no
float8) are read as before, so shards written before stay valid.

`sample_problem` is the one validation both the resume scan and the integrity check
apply, so a file extraction would skip is exactly a file the check accepts;
`written_sample_problem` is its header-only part, for files the vLLM server wrote itself.
`sample_buffers` is the one writer: the file as buffers streamed to disk without a copy.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import IO, Literal

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from eagle3_assets.storage_dtypes import STORAGE_DTYPE_NAMES

FORMAT = "eagle3-hidden-states/2"
READABLE_FORMATS = ("eagle3-hidden-states/1", FORMAT)
HIDDEN_STATES_DIR = "hidden_states"
MANIFEST_NAME = "_SUCCESS.json"
CHECK_RECORD_NAME = "_CHECK.json"  # the integrity check's verdict on the manifest (shard_window.py)
SAMPLE_SUFFIX = ".safetensors"
MISSING = "missing"

NormConvention = Literal["post_norm", "pre_norm"]
NORM_CONVENTIONS: tuple[str, ...] = ("post_norm", "pre_norm")

STORAGE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in STORAGE_DTYPE_NAMES}
SCALED_DTYPES = ("float8_e4m3fn",)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# How safetensors headers name the dtypes.
HEADER_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}
TENSOR_DTYPES = {STORAGE_DTYPES[v]: k for k, v in HEADER_DTYPES.items()} | {torch.int32: "I32", torch.uint8: "U8"}
# What a float8 file is decoded to: wide enough for e4m3 times its scale, half the size of float32.
DECODED_DTYPE = torch.bfloat16

HIDDEN_NAMES = ("aux_hidden_states", "last_hidden_state")
SCALE_SUFFIX = "_scale"
TOKEN_NAMES = ("input_ids", "loss_mask")


def shard_dir(key: str) -> str:
    return f"{HIDDEN_STATES_DIR}/{key}"


def shard_lease_dir(key: str) -> str:
    """Where the lease of the shard's extractor lies: beside the shard, since the integrity check
    flags any file in the shard directory that is not the shard's."""
    return f"{HIDDEN_STATES_DIR}/_leases/{key}"


def sample_path(key: str, row: int) -> str:
    """`hidden_states/rows_0-200/17.safetensors`: row is the global tokenized row index."""
    return f"{shard_dir(key)}/{row}{SAMPLE_SUFFIX}"


def manifest_path(key: str) -> str:
    return f"{shard_dir(key)}/{MANIFEST_NAME}"


def check_record_path(key: str) -> str:
    return f"{shard_dir(key)}/{CHECK_RECORD_NAME}"


def sample_row(name: str) -> int | None:
    """The row of a file name `<row>.safetensors`, or None for any other name."""
    stem = name[: -len(SAMPLE_SUFFIX)] if name.endswith(SAMPLE_SUFFIX) else ""
    return int(stem) if stem.isdigit() else None


def is_scaled(dtype: str) -> bool:
    return dtype in SCALED_DTYPES


def tensor_names(dtype: str) -> tuple[str, ...]:
    scales = tuple(n + SCALE_SUFFIX for n in HIDDEN_NAMES) if is_scaled(dtype) else ()
    return TOKEN_NAMES + HIDDEN_NAMES + scales


def element_bytes(dtype: str) -> int:
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
    def hidden_bytes_per_token(self) -> int:
        """Hidden-state bytes of one token: 3H aux + H last, plus the two float32 scales of float8 storage."""
        scales = 2 * 4 if is_scaled(self.dtype) else 0
        return 4 * self.hidden_size * element_bytes(self.dtype) + scales

    @property
    def bytes_per_token(self) -> int:
        """Everything stored per token: the hidden states plus its input id (int32) and loss mask (uint8)."""
        return self.hidden_bytes_per_token + 4 + 1

    def file_overhead(self, length: int = 1) -> int:
        """Bytes of a `length`-token file beyond its per-token bytes (the safetensors header, whose
        offsets grow a digit now and then with the length), measured on such a file."""
        zeros = torch.zeros(length, self.hidden_size)
        data = encode_sample(
            row=0, input_ids=np.zeros(length, np.int32), loss_mask=np.zeros(length, np.uint8),
            aux_hidden_states=zeros.repeat(1, 3), last_hidden_state=zeros,
            spec=SampleSpec(self.hidden_size, self.aux_layer_ids, self.dtype, self.model or "", "pre_norm"),
            backend="vllm",
        )  # fmt: skip
        return len(data) - length * self.bytes_per_token

    def projected_bytes(self, tokens: int, files: int) -> int:
        """What `files` files holding `tokens` tokens in all will take on disk."""
        if not files:
            return 0
        return tokens * self.bytes_per_token + files * self.file_overhead(max(1, tokens // files))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [T, W], float32 scales [T]): per-token scaling onto the e4m3 range."""
    x32 = x.detach().float()
    scale = x32.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [T]
    q = (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def encode_hidden(aux_hidden_states: torch.Tensor, last_hidden_state: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The hidden-state tensors of a file, in storage dtype (float8: quantized, with scales), on their device."""
    out: dict[str, torch.Tensor] = {}
    for name, x in zip(HIDDEN_NAMES, (aux_hidden_states, last_hidden_state), strict=True):
        if is_scaled(dtype):
            out[name], out[name + SCALE_SUFFIX] = quantize(x)
        else:
            out[name] = x.detach().to(STORAGE_DTYPES[dtype])
    return out


def sample_buffers(
    *, row: int, input_ids: np.ndarray, loss_mask: np.ndarray, hidden: dict[str, torch.Tensor], spec: SampleSpec, backend: str
) -> list[bytes | np.ndarray]:
    """One row's file as buffers, in file order: the safetensors header, then each tensor's bytes.

    A writer streams them to disk one after another (`write_sample_file`), so the hidden
    states are never joined into a second copy in memory; safetensors reads the result.
    Tensors are laid out widest element first, as safetensors lays them out, so each starts
    at a multiple of its element size. `spec.model` and `spec.last_hidden_state_norm` are recorded.
    """
    if spec.model is None or spec.last_hidden_state_norm is None:
        raise ValueError("a sample file records spec.model and spec.last_hidden_state_norm: both must be set")
    tensors = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int32)),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        **{name: t.to("cpu").contiguous() for name, t in hidden.items()},
    }
    header: dict = {
        "__metadata__": {
            "format": FORMAT,
            "aux_layer_ids": json.dumps(list(spec.aux_layer_ids)),
            "last_hidden_state_norm": spec.last_hidden_state_norm,
            "model": spec.model,
            "dtype": spec.dtype,
            "hidden_size": str(spec.hidden_size),
            "row": str(row),
            "backend": backend,
        }
    }
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": TENSOR_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    # view(uint8).numpy(): the tensor's own memory, little-endian as safetensors stores it.
    return [struct.pack("<Q", len(text)) + text, *(tensors[n].reshape(-1).view(torch.uint8).numpy() for n in order)]


def pack_sample(
    *, row: int, input_ids: np.ndarray, loss_mask: np.ndarray, hidden: dict[str, torch.Tensor], spec: SampleSpec, backend: str
) -> bytes:
    """The file's bytes from `encode_hidden`'s tensors (`sample_buffers`, joined)."""
    buffers = sample_buffers(row=row, input_ids=input_ids, loss_mask=loss_mask, hidden=hidden, spec=spec, backend=backend)
    return b"".join(memoryview(b).cast("B") for b in buffers)


def write_sample_file(buffers: list[bytes | np.ndarray], filename: str, temporary: str) -> int:
    """Write `sample_buffers` to `filename` through `temporary` (same directory), renamed into place:
    a reader never sees half a file. Returns the file's size."""
    try:
        with open(temporary, "wb") as f:
            f.writelines(buffers)
            size = f.tell()
        os.replace(temporary, filename)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return size


def encode_sample(
    *,
    row: int,
    input_ids: np.ndarray,  # [T] int32
    loss_mask: np.ndarray,  # [T] uint8
    aux_hidden_states: torch.Tensor,  # [T, 3H], any float dtype; cast (or quantized) to spec.dtype
    last_hidden_state: torch.Tensor,  # [T, H]
    spec: SampleSpec,
    backend: str,
) -> bytes:
    """The bytes of one row's file."""
    hidden = encode_hidden(aux_hidden_states.detach().to("cpu"), last_hidden_state.detach().to("cpu"), spec.dtype)
    return pack_sample(row=row, input_ids=input_ids, loss_mask=loss_mask, hidden=hidden, spec=spec, backend=backend)


def decode_hidden(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Hidden states `name` of a loaded file: as stored, or dequantized to bfloat16 for float8 files."""
    t = tensors[name]
    if t.dtype != torch.float8_e4m3fn:
        return t
    return (t.float() * tensors[name + SCALE_SUFFIX].float()[:, None]).to(DECODED_DTYPE)


# -- headers: what the loader and the resume scan read without loading tensors ----------------


def parse_header(data: bytes) -> tuple[dict, str | None]:
    """(safetensors header, problem) from the file's first bytes; problem names a truncation."""
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


def read_header(f: IO[bytes]) -> tuple[dict | None, str | None]:
    """(header, problem) reading only the header's bytes from an open file (a few hundred bytes)."""
    raw = f.read(8)
    if len(raw) != 8:
        return None, "truncated, not a safetensors file"
    (n,) = struct.unpack("<Q", raw)
    if n > 100_000_000:
        return None, f"header of {n} bytes, not a safetensors file"
    try:
        return json.loads(f.read(n)), None
    except ValueError as e:
        return None, f"unreadable safetensors header: {e}"


@dataclass(frozen=True)
class SampleHeader:
    """What a file's header says about it."""

    length: int  # T
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    dtype: str
    last_hidden_state_norm: str
    model: str


def describe_header(header: dict) -> tuple[SampleHeader | None, str | None]:
    """(summary, problem) of a sample file from its header alone: format, names, dtypes, shapes agree."""
    header = dict(header)
    meta = header.pop("__metadata__", None) or {}
    if meta.get("format") not in READABLE_FORMATS:
        return None, f"format {meta.get('format')!r}, expected one of {list(READABLE_FORMATS)}"
    dtype = HEADER_DTYPES.get((header.get("aux_hidden_states") or {}).get("dtype", ""))
    if dtype is None:
        return None, "aux_hidden_states is missing or not a float storage dtype"
    missing = [n for n in tensor_names(dtype) if n not in header]
    if missing:
        return None, f"tensor(s) {missing} missing"
    ids, mask, aux, last = (header[n] for n in TOKEN_NAMES + HIDDEN_NAMES)
    T = ids["shape"][0] if len(ids["shape"]) == 1 else -1
    H = last["shape"][-1] if last["shape"] else -1
    try:
        aux_ids = tuple(int(i) for i in json.loads(meta.get("aux_layer_ids", "")))
    except (ValueError, TypeError):
        return None, f"aux_layer_ids metadata {meta.get('aux_layer_ids')!r} is not a JSON list"
    problems = []
    if ids["dtype"] != "I32" or T < 1:
        problems.append(f"input_ids is {ids['dtype']}{ids['shape']}, expected I32[T] with T >= 1")
    if mask["dtype"] != "U8" or mask["shape"] != [T]:
        problems.append(f"loss_mask is {mask['dtype']}{mask['shape']}, expected U8[{T}]")
    if HEADER_DTYPES.get(last["dtype"]) != dtype:
        problems.append(f"last_hidden_state is {last['dtype']}, aux_hidden_states {aux['dtype']}")
    if last["shape"] != [T, H]:
        problems.append(f"last_hidden_state is {last['shape']}, expected [{T}, H]")
    if aux["shape"] != [T, len(aux_ids) * H]:
        problems.append(f"aux_hidden_states is {aux['shape']}, expected [{T}, {len(aux_ids)} * {H}]")
    for name in HIDDEN_NAMES:
        scale = header.get(name + SCALE_SUFFIX)
        if scale is not None and (scale["dtype"] != "F32" or scale["shape"] != [T]):
            problems.append(f"{name}{SCALE_SUFFIX} is {scale['dtype']}{scale['shape']}, expected F32[{T}]")
    if len(aux_ids) != 3:
        problems.append(f"aux_layer_ids {list(aux_ids)}: EAGLE-3 fuses exactly 3 layers")
    if meta.get("hidden_size") not in (None, str(H)):
        problems.append(f"hidden_size metadata {meta.get('hidden_size')} but tensors are {H} wide")
    norm = meta.get("last_hidden_state_norm")
    if norm not in NORM_CONVENTIONS:
        problems.append(f"last_hidden_state_norm {norm!r}, expected one of {NORM_CONVENTIONS}")
    if problems:
        return None, "; ".join(problems)
    return SampleHeader(T, H, aux_ids, dtype, str(norm), str(meta.get("model", ""))), None


# -- full validation: the resume scan and the integrity check ---------------------------------


def tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """Non-finite values or an all-zero tensor: what a crashed or unwritten buffer looks like."""
    # A finite, non-zero sum proves both at a fraction of the cost (a NaN or inf makes the sum
    # non-finite); only a sum that fails it is looked at value by value.
    total = t.sum()
    if t.numel() and bool(torch.isfinite(total)) and bool(total != 0):
        return None
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        return f"{name} has {bad} non-finite values"
    if t.numel() == 0 or not bool(t.any()):
        return f"{name} all zero"
    return None


def metadata_problem(meta: dict[str, str], *, row: int, spec: SampleSpec) -> str | None:
    """Why a file's metadata does not belong to tokenized `row` under `spec`, or None."""
    if meta.get("format") not in READABLE_FORMATS:
        return f"metadata format is {meta.get('format')!r}, expected one of {list(READABLE_FORMATS)}"
    expected_meta = {
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
    return None


def sample_problem(
    data: bytes, *, row: int, input_ids: np.ndarray, loss_mask: np.ndarray, spec: SampleSpec
) -> str | None:
    """Why `data` is not a valid file for tokenized `row` (input_ids/loss_mask), or None when it is."""
    header, problem = parse_header(data)
    if problem:
        return problem
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        return f"cannot load: {e}"
    if set(tensors) != set(tensor_names(spec.dtype)):
        return f"tensors {sorted(tensors)} differ from the spec {sorted(tensor_names(spec.dtype))}"

    problem = metadata_problem(header.get("__metadata__") or {}, row=row, spec=spec)
    if problem:
        return problem
    T, H = len(input_ids), spec.hidden_size
    stored = STORAGE_DTYPES[spec.dtype]
    want_shapes = {
        "input_ids": (torch.int32, [T]),
        "loss_mask": (torch.uint8, [T]),
        "aux_hidden_states": (stored, [T, 3 * H]),
        "last_hidden_state": (stored, [T, H]),
    }
    if is_scaled(spec.dtype):
        want_shapes |= {n + SCALE_SUFFIX: (torch.float32, [T]) for n in HIDDEN_NAMES}
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
    for name in HIDDEN_NAMES:
        if is_scaled(spec.dtype):
            scale = tensors[name + SCALE_SUFFIX]
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                return f"{name}{SCALE_SUFFIX} has non-finite or non-positive scales"
        problem = tensor_problem(name, decode_hidden(tensors, name))
        if problem:
            return problem
    return None


def written_sample_problem(
    path: str, *, row: int, input_ids: np.ndarray, loss_mask: np.ndarray, spec: SampleSpec
) -> tuple[str | None, int]:
    """(problem, size) of a file another process wrote (the vLLM server), reading only its header,
    input_ids and loss_mask: that it is complete, is tokenized `row`'s and has the spec's layout.

    Its values were checked finite and non-zero where they were computed, before writing (the
    connector); the blocking integrity check reads every value after the shard.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, problem = read_header(f)
        if problem:
            return problem, size
        data_start = f.tell()
        summary, problem = describe_header(header)
        if problem:
            return problem, size
        problem = metadata_problem(header.get("__metadata__") or {}, row=row, spec=spec)
        if problem:
            return problem, size
        T = len(input_ids)
        if (summary.length, summary.hidden_size, summary.dtype) != (T, spec.hidden_size, spec.dtype):
            return (
                f"holds {summary.length} tokens x {summary.hidden_size} in {summary.dtype}, expected {T} x "
                f"{spec.hidden_size} in {spec.dtype} (tokenized row {row})"
            ), size
        ends = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        if size != data_start + ends:
            return f"truncated ({size} bytes, header describes {data_start + ends})", size
        for name, want, dtype in (("input_ids", input_ids, np.int32), ("loss_mask", loss_mask, np.uint8)):
            begin, end = header[name]["data_offsets"]
            f.seek(data_start + begin)
            differ = int((np.frombuffer(f.read(end - begin), dtype=dtype) != np.asarray(want)).sum())
            if differ:
                verb = "differ" if name == "input_ids" else "differs"
                return f"{name} {verb} from tokenized row {row} at {differ} of {T} positions", size
    return None, size
