"""HF transformers backend: the target model loaded in this process.

One forward pass with `output_hidden_states=True` per batch. HF's `hidden_states` is a
tuple of N+1 tensors: index 0 is the embedding output and index i the input of layer i
(DESIGN §4's convention for aux ids); the last entry has the final norm applied
(post-norm). Logits are computed for one position only: the states are all we keep.

Rows are sorted by length and packed under a padded-token budget, right-padded with an
attention mask; under a causal mask a real position never attends to padding, so each
row's states equal a batch-1 pass within dtype tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from eagle3_assets.hidden_states.extractor import (
    ExtractedSample,
    ExtractionRequest,
    ExtractorConfigError,
    check_aux_layer_ids,
)


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


class HFExtractor:
    """A `HiddenStateExtractor` over `AutoModelForCausalLM` from a local directory."""

    backend = "hf"
    last_hidden_state_norm = "post_norm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        aux_layer_ids: Sequence[int],
        batch_tokens: int,
        device: str = "auto",
        pad_token_id: int = 0,
    ):
        if batch_tokens < 1:
            raise ExtractorConfigError(f"batch_tokens must be >= 1, got {batch_tokens}")
        self.device = _resolve_device(device)
        # float32 on CPU (bf16 matmuls there are slow and inexact); the checkpoint's own dtype on GPU.
        dtype = torch.float32 if self.device.type == "cpu" else "auto"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
        cfg = self.model.config.get_text_config()
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.max_context = int(cfg.max_position_embeddings)
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.batch_tokens = batch_tokens
        # Any valid id: padded positions are masked out and cut off the results.
        self.pad_token_id = pad_token_id

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
        last = hs[-1]  # [B, T, H], post-norm
        return aux, last

    def extract(self, requests: Sequence[ExtractionRequest]) -> Iterator[ExtractedSample]:
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
