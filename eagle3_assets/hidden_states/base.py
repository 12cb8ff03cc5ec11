"""The backend interface: something that turns token rows into hidden states.

Two kinds of backend fit behind it: a model loaded in this process (HF transformers,
`hf_extractor.py`) and a long-lived server that already holds the model (vLLM's
`extract_hidden_states` method, `vllm_extractor.py`). So the interface only speaks in
rows and results: it never hands out the model, and results arrive one row at a time,
in whatever order the backend finishes them, so a shard can write each sample as it
comes and a server can answer requests concurrently.

A result is either the row's tensors (`ExtractedSample`, the shard writes the file) or,
for a backend that writes the final file itself (`WrittenSample`: the vLLM server's
connector writing straight into the store), the size of the file it wrote.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.sample_file import NormConvention, SampleSpec


class ExtractorError(Eagle3Error, RuntimeError):
    """A backend broke its contract (a row it did not return, a file where tensors were asked for)."""


class ExtractorConfigError(Refusal, ValueError):
    """A backend cannot be built as configured; the message names the setting."""


@dataclass(frozen=True)
class ExtractionRequest:
    row: int  # global tokenized row index; the result carries it back
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray | None = None  # [T] uint8; needed by backends that write the file themselves
    path: str | None = None  # local path of the row's file, for backends that write it themselves


@dataclass(frozen=True)
class ExtractedSample:
    row: int
    input_ids: np.ndarray  # [T] int32: the tokens the backend actually ran (checked against the row)
    aux_hidden_states: torch.Tensor  # [T, 3H] on CPU, "input of layer i" states for the aux ids, ascending
    last_hidden_state: torch.Tensor  # [T, H] on CPU, norm convention = the extractor's last_hidden_state_norm


@dataclass(frozen=True)
class WrittenSample:
    row: int
    bytes: int  # size of the file the backend wrote (and the caller has verified) at the request's path


@runtime_checkable
class HiddenStateExtractor(Protocol):
    """A hidden-state backend. Attributes describe what `extract` returns."""

    backend: str  # "hf", "vllm": recorded in every file
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]  # ascending, each in 1..num_layers-1
    last_hidden_state_norm: NormConvention
    max_context: int  # longest row (tokens) the backend accepts

    def writes_files(self, shard_dir: Path | None) -> bool:
        """Whether `extract` can write each row's final file itself into `shard_dir` (a local directory,
        None for a store that is not on a local filesystem)."""
        ...

    def extract(
        self, requests: Sequence[ExtractionRequest], spec: SampleSpec | None
    ) -> Iterator[ExtractedSample | WrittenSample]:
        """One result per request, in any order (each names its row): a `WrittenSample` for a request with a
        `path` (the backend wrote the file, encoded with `spec`), else an `ExtractedSample`."""
        ...

    def close(self) -> None:
        """Release what this process holds (a model, a client); a shared server stays up."""
        ...
