"""The few target tensors drafter training needs, and the target's distribution from stored states.

A 1T target cannot be loaded for drafter training, and need not be: the drafter
uses the target's embedding (frozen input), and the training signal is the target's
next-token distribution, which is `lm_head(final_norm(last))`. Those three tensors
are read by name from the target's safetensors (sharded or not), nothing else.

The final norm is applied exactly once (docs/DESIGN.md §4): a sample whose
`last_hidden_state` was stored pre-norm (vLLM layer N) gets it here; a post-norm one
(HF's last `hidden_states` entry) goes straight into `lm_head`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.model import rms_norm
from eagle3_assets.target import TargetModel

# Where the language model sits inside a checkpoint: plain causal LMs first, then
# the layouts of vision-language wrappers (Kimi-K2.5, transformers 5 VLMs).
_MODEL_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
_HEAD_PREFIXES = ("", "language_model.")


class TargetWeightsError(TrainingError):
    """The target directory lacks a tensor the drafter needs; the message names it and the files searched."""


@dataclass
class TargetWeights:
    target: TargetModel
    embed_tokens: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    rms_norm_eps: float


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / fname for name, fname in weight_map.items()}
    single = target_dir / "model.safetensors"
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise TargetWeightsError(
        f"no model.safetensors or model.safetensors.index.json in {target_dir} (only safetensors targets are read)"
    )


def _find(files: dict[str, Path], candidates: list[str], what: str, target_dir: Path) -> str:
    hits = [c for c in candidates if c in files]
    if not hits:
        raise TargetWeightsError(f"{what} not found in {target_dir}: looked for {candidates}")
    return hits[0]


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_weights(target: TargetModel) -> TargetWeights:
    """Embedding, final norm and lm_head of the target (tied heads handled)."""
    target_dir = target.path
    files = _weight_files(target_dir)
    embed_name = _find(files, [p + "embed_tokens.weight" for p in _MODEL_PREFIXES], "the token embedding", target_dir)
    norm_name = _find(files, [p + "norm.weight" for p in _MODEL_PREFIXES], "the final norm", target_dir)
    tied = target.tie_word_embeddings
    head_candidates = [p + "lm_head.weight" for p in _HEAD_PREFIXES]
    if tied and not any(c in files for c in head_candidates):
        head_name = embed_name
    else:
        head_name = _find(files, head_candidates, "lm_head (tie_word_embeddings is false)", target_dir)
    embed = _read(files, embed_name)
    vocab, hidden = target.vocab_size, target.hidden_size
    lm_head = embed if head_name == embed_name else _read(files, head_name)
    for name, t in ((embed_name, embed), (head_name, lm_head)):
        if t.shape[1] != hidden or t.shape[0] < vocab:
            raise TargetWeightsError(f"{name} in {target_dir} is {list(t.shape)}, expected [{vocab}, {hidden}]")
    return TargetWeights(
        target=target,
        # Some checkpoints pad the vocab rows; the config's vocab_size is what ids index.
        embed_tokens=embed[:vocab],
        final_norm=_read(files, norm_name),
        lm_head=lm_head[:vocab],
        rms_norm_eps=target.rms_norm_eps,
    )


@dataclass
class Targets:
    """What the TTT loss needs from the target at each position, the full-vocab logits dropped."""

    probs: torch.Tensor  # [B, T, Vd] float32: softmax over target_logits[..., t2d]
    argmax: torch.Tensor  # [B, T] int64: target top-1 over the FULL vocab (a target id)
    in_draft: torch.Tensor  # [B, T] bool: that top-1 is in the draft vocab


class TargetHead(nn.Module):
    """final_norm + lm_head of the target, frozen (buffers: never trained, never in optimizer state)."""

    def __init__(self, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("final_norm", final_norm.detach().clone())  # [H]
        self.register_buffer("lm_head", lm_head.detach().clone())  # [V, H]
        self.eps = eps

    @classmethod
    def from_weights(cls, w: TargetWeights) -> TargetHead:
        return cls(w.final_norm, w.lm_head, w.rms_norm_eps)

    @torch.no_grad()
    def logits(self, last: torch.Tensor, pre_norm: torch.Tensor | bool) -> torch.Tensor:
        """Target logits [..., V] from stored final states [..., H]; `pre_norm` per sample ([B] bool), per
        token (a bool tensor of the states' leading shape) or one bool."""
        x = last.to(self.lm_head.dtype)
        normed = rms_norm(x, self.final_norm.to(x.dtype), self.eps)
        if isinstance(pre_norm, bool):
            x = normed if pre_norm else x
        else:
            flag = pre_norm.to(x.device).view(*pre_norm.shape, *([1] * (x.dim() - pre_norm.dim())))
            x = torch.where(flag, normed, x)
        return (x @ self.lm_head.T).float()

    @torch.no_grad()
    def targets(
        self, last: torch.Tensor, pre_norm: torch.Tensor | bool, t2d: torch.Tensor, chunk_tokens: int = 2048
    ) -> Targets:
        """Targets for [B, T, H] states, computed `chunk_tokens` rows at a time so the [*, V]
        logits of a large vocabulary (Kimi: 163,840) never exist for the whole batch."""
        B, T, H = last.shape
        flat = last.reshape(B * T, H)
        flags = (
            torch.full((B * T,), pre_norm, dtype=torch.bool, device=last.device)
            if isinstance(pre_norm, bool)
            else pre_norm.to(last.device).repeat_interleave(T)  # [B] per sample
            if pre_norm.dim() == 1
            else pre_norm.to(last.device).reshape(B * T)  # [B, T] per token (packed rows)
        )
        t2d = t2d.to(last.device)
        probs, argmax = [], []
        for i in range(0, B * T, chunk_tokens):
            logits = self.logits(flat[i : i + chunk_tokens], flags[i : i + chunk_tokens])  # [n, V]
            argmax.append(logits.argmax(-1))
            probs.append(torch.softmax(logits[:, t2d], dim=-1))  # [n, Vd]
        top1 = torch.cat(argmax).view(B, T)
        return Targets(probs=torch.cat(probs).view(B, T, -1), argmax=top1, in_draft=t2d[top1])
