"""The backend interface: something that turns token rows into hidden states.

Two kinds of backend fit behind it: a model loaded in this process (HF transformers,
`hf_extractor.py`) and a long-lived server that already holds the model (vLLM's
`extract_hidden_states` method, one safetensors file per request; a later issue).
So the interface only speaks in rows and tensors: it never hands out the model, and
results arrive one row at a time, in whatever order the backend finishes them, so a
shard can write each sample as it comes and a server can answer requests concurrently.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from eagle3_assets.hidden_states.sample_file import NormConvention
from eagle3_assets.settings import Settings, SettingsError, read_model_shape


class ExtractorConfigError(ValueError):
    """A backend cannot be built as configured; the message names the setting."""


@dataclass(frozen=True)
class ExtractionRequest:
    row: int  # global tokenized row index; the result carries it back
    input_ids: np.ndarray  # [T] int32


@dataclass(frozen=True)
class ExtractedSample:
    row: int
    input_ids: np.ndarray  # [T] int32: the tokens the backend actually ran (checked against the row)
    aux_hidden_states: torch.Tensor  # [T, 3H] on CPU, "input of layer i" states for the aux ids, ascending
    last_hidden_state: torch.Tensor  # [T, H] on CPU, norm convention = the extractor's last_hidden_state_norm


@runtime_checkable
class HiddenStateExtractor(Protocol):
    """A hidden-state backend. Attributes describe what `extract` returns."""

    backend: str  # "hf", "vllm": recorded in every file
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]  # ascending, each in 1..num_layers-1
    last_hidden_state_norm: NormConvention
    max_context: int  # longest row (tokens) the backend accepts

    def extract(self, requests: Sequence[ExtractionRequest]) -> Iterator[ExtractedSample]:
        """One sample per request, in any order (each names its row)."""
        ...

    def close(self) -> None:
        """Release what this process holds (a model, a client); a shared server stays up."""
        ...


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Sorted ids, each an 'input of layer i' id in 1..num_layers-1, distinct; else ExtractorConfigError."""
    ids = tuple(sorted(int(i) for i in aux_layer_ids))
    if len(set(ids)) != len(ids):
        raise ExtractorConfigError(f"aux_layer_ids: {list(aux_layer_ids)} has a repeated layer id")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ExtractorConfigError(
            f"aux_layer_ids: {bad} outside the model, which has {num_layers} layers "
            f"(valid 'input of layer i' ids: 1..{num_layers - 1})"
        )
    return ids


def extract_in_order(extractor: HiddenStateExtractor, requests: Sequence[ExtractionRequest]) -> list[ExtractedSample]:
    """All samples, in the order of `requests` (holds them all in memory: small inputs only)."""
    by_row = {s.row: s for s in extractor.extract(requests)}
    missing = [r.row for r in requests if r.row not in by_row]
    if missing:
        raise RuntimeError(f"the {extractor.backend} backend returned no sample for rows {missing}")
    return [by_row[r.row] for r in requests]


def open_extractor(settings: Settings, model_dir: str | Path, *, device: str = "auto") -> HiddenStateExtractor:
    """The backend `settings.extraction.backend` names, for the model in local `model_dir`.

    Aux ids come from `settings.aux_layer_ids` or the default [2, N//2, N-3], checked against the model.
    The vLLM backend uses the server at `vllm.server_url`, or starts one that its `close()` stops.
    """
    if settings.extraction.backend not in ("hf", "vllm"):
        raise ExtractorConfigError(
            f"extraction.backend: {settings.extraction.backend!r} is not one of 'hf', 'vllm'"
        )
    shape = read_model_shape(str(model_dir))
    if shape is None:
        raise ExtractorConfigError(f"target model: cannot read num_hidden_layers from {model_dir}/config.json")
    try:
        aux_layer_ids = settings.resolved_aux_layer_ids(shape[0])
    except SettingsError as e:
        raise ExtractorConfigError(str(e)) from None
    if settings.extraction.backend == "vllm":
        from eagle3_assets.hidden_states.vllm_extractor import VLLMExtractor

        return VLLMExtractor(model_dir, settings.vllm, aux_layer_ids=aux_layer_ids)
    # transformers is imported only when a model is really loaded here
    from eagle3_assets.hidden_states.hf_extractor import HFExtractor

    return HFExtractor(
        model_dir, aux_layer_ids=aux_layer_ids, batch_tokens=settings.extraction.batch_tokens, device=device
    )
