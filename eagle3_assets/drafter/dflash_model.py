"""The DFlash block drafter: a few Qwen3-style layers that draft a whole block of tokens in one forward.

Serving (vLLM's `qwen3_dflash.py`, `method: dflash`) for a request whose verified tokens are x_0..x_{a-1} and whose
newest token x_a the target has just produced:
  context  the target's hidden states at positions 0..a-1 (the aux layers the drafter reads, concatenated) -> `fc`
           -> context states c; every layer turns hidden_norm(c) into keys and values with its own k/v projections
           (keys normed per head and rotated at their positions). The context never runs through the layers;
  query    the block [x_a, m, ..., m] (K mask slots) at positions a..a+K, embedded with the target's embedding (a
           mask slot with the drafter's own `mask_embedding`), runs through the layers. Each query attends to every
           context key and to every query of its block: non-causal inside the block;
  draft    mask slot i (1..K) -> final norm -> lm_head proposes x_{a+i}: K tokens from one forward.

Training runs many blocks per row at once. A block is named by its last context index t = a - 1 ("the anchor
index"); it attends to context keys s <= t (of its own sample, when rows are packed) and to its own block. Mask
slot i then predicts token t + 1 + i from the target's distribution at t + i: exactly what EAGLE-3's TTT step
k = i - 1 predicts at index t (`ttt.py`), so both families are scored by the same code and their acc_k and
acceptance estimates mean the same thing (`dflash_loss.py`).

Parameter names are the ones vLLM loads (`layers.N.self_attn.q_proj`, `fc`, `hidden_norm`, `norm`, `lm_head`,
`d2t`); `dflash_export.py` owns the exact list and checks it.

Shapes: B batch, T positions, N blocks per row, K mask slots (block_size), Q = N (K + 1) query slots, H hidden
size, A = len(aux layers) x H the fused context width, nh/nkv query/kv heads, hd head dim, V / Vd target / draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.drafter.model import MLP, DrafterModule, DrafterShape, RMSNorm, apply_rotary, rotary_cos_sin


@dataclass(frozen=True)
class DFlashConfig(DrafterShape):
    """The DFlash drafter: the target's shape (`num_aux_layers` the layers its context fuses) and its own fields."""

    num_layers: int = 1
    block_size: int = 7  # K mask slots per block: the tokens drafted per target forward
    mask_token_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")


def block_attention_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block: int,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each query slot sees: bool [B, 1, Q, T + Q] (True = attend), keys = T context + Q query slots.

    anchors [B, N]: each block's anchor index t (its last context position; -1 = no block there). A block's
    queries see the context keys s <= t (of t's own sample with `segments` [B, T]) and every query of their own
    block; a padding block sees only itself, so its softmax stays finite.
    """
    B, N = anchors.shape
    t = anchors.clamp(min=0)
    context = torch.arange(seq_len, device=anchors.device)[None, None, :] <= t[:, :, None]  # [B, N, T]
    context &= (anchors >= 0)[:, :, None]
    if segments is not None:
        context &= segments[:, None, :] == segments.gather(1, t)[:, :, None]
    own = torch.eye(N, dtype=torch.bool, device=anchors.device)  # [N, N] block-to-block
    own = own.repeat_interleave(block + 1, 0).repeat_interleave(block + 1, 1).expand(B, -1, -1)  # [B, Q, Q]
    context = context.repeat_interleave(block + 1, 1)  # [B, Q, T]
    return torch.cat([context, own], dim=-1)[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the context states and the block itself; per-head q/k norms."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd, h = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        )
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.cfg.head_dim).transpose(1, 2)  # [B, n, L, hd]

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_c: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        # x [B, Q, H] the normed block; context [B, T, H] hidden_norm(fc(aux))
        nh, nkv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), nh)), *rope_q)  # [B, nh, Q, hd]
        k_block = apply_rotary(self.k_norm(self._heads(self.k_proj(x), nkv)), *rope_q)  # [B, nkv, Q, hd]
        k_ctx = apply_rotary(self.k_norm(self._heads(self.k_proj(context), nkv)), *rope_c)  # [B, nkv, T, hd]
        keys = torch.cat([k_ctx, k_block], dim=2)  # [B, nkv, T + Q, hd]
        values = torch.cat(
            [self._heads(self.v_proj(context), nkv), self._heads(self.v_proj(x), nkv)],
            dim=2,
        )
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=nh != nkv)  # [B, nh, Q, hd]
        B, _, Q, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, nh * self.cfg.head_dim))  # [B, Q, H]


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer over the block's residual stream, attending to the context too."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_c: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_c, mask)  # [B, Q, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(DrafterModule):
    config: DFlashConfig

    def __init__(
        self,
        cfg: DFlashConfig,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        embed_tokens: torch.Tensor | None = None,
    ):
        super().__init__(cfg, d2t, t2d, embed_tokens)
        h = cfg.hidden_size
        # The mask slots' input, trained: exported as `mask_embedding.pt`, which vLLM puts in place of the mask
        # token's row, so the mask token may be any id the text never holds.
        self.mask_embedding = nn.Parameter(self.embed_tokens.weight[cfg.mask_token_id].detach().float().clone())
        self.fc = nn.Linear(cfg.num_aux_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.reset_parameters()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] -> [B, L, H]; the mask token reads the mask embedding, as vLLM serves it."""
        dtype = self.fc.weight.dtype
        e = self.embed_tokens(ids).to(dtype)
        return torch.where(
            (ids == self.config.mask_token_id)[..., None],
            self.mask_embedding.to(dtype),
            e,
        )

    def forward(
        self, input_ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
        positions: torch.Tensor | None = None, segments: torch.Tensor | None = None, block_size: int | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Draft logits of mask slots 1..K, each [B, N, Vd], for the blocks at `anchors` [B, N] (-1 = none).

        input_ids [B, T]; aux [B, T, A] the target's features at each position; packed rows pass `positions`
        (each token's index within its sample) and `segments` [B, T] (`block_attention_mask`). `block_size` drafts
        K mask slots other than the trained ones, as an engine serving another num_speculative_tokens does."""
        B, T = input_ids.shape
        K = block_size or self.config.block_size
        t = anchors.clamp(min=0)  # [B, N]
        index = torch.arange(T, device=input_ids.device).expand(B, T) if positions is None else positions  # [B, T]
        anchor_token = input_ids.gather(1, (t + 1).clamp(max=T - 1))  # [B, N]: x_a, the block's first query
        mask_ids = torch.full(
            (*t.shape, K),
            self.config.mask_token_id,
            dtype=input_ids.dtype,
            device=input_ids.device,
        )
        block_ids = torch.cat([anchor_token[..., None], mask_ids], dim=-1).flatten(1)  # [B, Q]
        offsets = torch.arange(1, K + 2, device=input_ids.device)  # the block sits at a = t + 1 .. t + 1 + K
        block_pos = (index.gather(1, t)[..., None] + offsets).flatten(1)  # [B, Q]
        rope_q = rotary_cos_sin(block_pos, self.inv_freq, self.rope_scaling)  # [B, Q, hd] each
        rope_c = rotary_cos_sin(index, self.inv_freq, self.rope_scaling)  # [B, T, hd] each
        context = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # [B, T, H]
        mask = block_attention_mask(anchors, T, K, segments)  # [B, 1, Q, T + Q]
        h = self.embed(block_ids)  # [B, Q, H]
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_c, mask)
        slots = self.norm(h).view(B, -1, K + 1, h.shape[-1])[:, :, 1:]  # [B, N, K, H]: the mask slots
        logits = self.lm_head(slots)  # [B, N, K, Vd]
        return list(logits.unbind(2))


__all__ = ["DFlashConfig", "DFlashDrafter", "block_attention_mask"]
