"""HF transformers backend: the target model loaded in this process.

One forward pass with `output_hidden_states=True` per batch. HF's `hidden_states` is a
tuple of N+1 tensors: index 0 is the embedding output and index i the input of layer i
(docs/DESIGN.md §4's convention for aux ids). The last entry has the final norm applied,
so the last layer's own output is taken where it enters the final norm (a forward
pre-hook): files from both backends hold the same pre-norm state, and the drafter's
target head applies the norm once. A model with no recognisable final norm falls back
to the post-norm entry, and its files say so. Logits are computed for one position only.

Rows are sorted by length and packed under a padded-token budget, right-padded and passed
with no attention mask: under causal attention a real position never attends to the padding
after it, so each row's states equal a batch-1 pass within dtype tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from eagle3_assets.hidden_states.base import ExtractedSample, ExtractionRequest, ExtractorConfigError
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.target import TargetModel, load_hf_model


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, longest first, grouped so len(batch) * longest <= batch_tokens.

    Longest first so an out-of-memory batch shows up at the start of a shard, not at the end.
    A row longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # the batch's first row is its longest, so the padded size is len(batch) * lengths[batch[0]]
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's final norm (`model.model.norm` for Llama-likes), or None when there is none to find."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


class HFExtractor:
    """A `HiddenStateExtractor` over the target in transformers (`load_hf_model`), from a local directory."""

    backend = "hf"

    def __init__(
        self,
        target: TargetModel,
        *,
        batch_tokens: int,
        device: str = "auto",
        pad_token_id: int = 0,
        model: torch.nn.Module | None = None,
    ):
        """`model`: the target already loaded (benchmarks build one in place); else loaded from `target.path`."""
        if batch_tokens < 1:
            raise ExtractorConfigError(f"extraction.batch_tokens must be >= 1, got {batch_tokens}")
        if not target.aux_layer_ids:
            raise ExtractorConfigError("the target's aux layer ids are not resolved (TargetModel.read resolves them)")
        self.device = _resolve_device(device)
        if model is None:
            # float32 on CPU (bf16 matmuls there are slow and inexact); the checkpoint's own dtype on GPU.
            dtype = torch.float32 if self.device.type == "cpu" else "auto"
            model = load_hf_model(target, dtype)
        self.model = model.to(self.device).eval()
        self.hidden_size = target.hidden_size
        self.num_layers = target.num_layers
        self.max_context = target.max_context or 1 << 30
        self.aux_layer_ids = target.aux_layer_ids
        self.batch_tokens = batch_tokens
        # Any valid id: padded positions are cut off the results.
        self.pad_token_id = pad_token_id
        self._prenorm: torch.Tensor | None = None
        norm = final_norm(self.model)
        self.last_hidden_state_norm = "post_norm" if norm is None else "pre_norm"
        if norm is not None:
            norm.register_forward_pre_hook(self._capture_prenorm)

    def _capture_prenorm(self, _module: torch.nn.Module, args: tuple) -> None:
        self._prenorm = args[0]

    def writes_files(self, shard_dir: Path | None) -> bool:
        return False

    @torch.no_grad()  # not inference_mode: callers may modify the returned tensors
    def _forward(self, rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = len(rows), max(len(r) for r in rows)
        ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        # Right padding under causal attention: a real position never sees the padding after it,
        # so no padding mask is needed, and without one attention takes its fast causal path
        # (an explicit mask made batched CPU extraction 0.76x the speed of batch 1).
        out = self.model(
            input_ids=ids.to(self.device),
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,
        )
        hs = out.hidden_states  # N+1 x [B, T, H]
        aux = torch.cat([hs[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, 3H]
        last = hs[-1] if self._prenorm is None else self._prenorm  # [B, T, H]
        self._prenorm = None
        return aux, last

    def extract(self, requests: Sequence[ExtractionRequest], spec: SampleSpec | None = None) -> Iterator[ExtractedSample]:
        """Samples batch by batch, longest rows first."""
        for batch in plan_batches([len(r.input_ids) for r in requests], self.batch_tokens):
            reqs = [requests[i] for i in batch]
            aux, last = self._forward([r.input_ids for r in reqs])
            aux, last = aux.cpu(), last.cpu()
            for b, r in enumerate(reqs):
                T = len(r.input_ids)
                yield ExtractedSample(
                    row=r.row,
                    input_ids=np.asarray(r.input_ids, dtype=np.int32),
                    aux_hidden_states=aux[b, :T],  # [T, 3H]
                    last_hidden_state=last[b, :T],  # [T, H]
                )

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
