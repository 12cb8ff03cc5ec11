"""The EAGLE-3 draft model: one Llama-style decoder layer over fused target features (docs/DESIGN.md §5).

Read top to bottom: config, then the modules from small to large (norm, rotary,
attention, MLP, the decoder layer, the drafter). Parameter names are the ones vLLM's
`llama_eagle3.py` and SGLang load (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`);
the exporter (`export.py`) owns the exact list and checks it.

Shapes: B batch, T positions, H hidden size, A = 3H fused aux width, nh/nkv query/kv
heads, hd head dim, I MLP width, V target vocab, Vd draft vocab.

Training-time test (TTT) attention. Step 0 reads the fused target features fc(aux[t])
and the embedding of token t+1 at every index t. Step k > 0 reads, at index t, the
drafter's own pre-norm output of step k-1 at index t and the embedding of token
t+1+k: index t of step k plays the token the drafter would propose k places after
t+1. Its query attends to
  - step-0 keys/values at every index s <= t (causal: the prefix the target verified), and
  - step-j keys/values (1 <= j <= k) at index t only (its own earlier draft tokens),
which is the KV cache a serving engine holds when it drafts k tokens past t+1. This is
the pattern of the EAGLE-3 reference and SpecForge. Rotary positions follow the serving
engine too: step k at index t sits at position t + k (vLLM advances the position by one
per draft token), so query/key offsets match what the drafter meets at inference, and
the rotary embedding is the target's, scaling type and factors included (`rope`), as
the export declares it to the engine.

Training need not compute a step where nothing scores it: `unroll` takes, for each step
k >= 1, the indices to compute (`StepIndices`, chosen by `ttt.py`), and at those indices
gives what the full unroll gives.

Beside an MLA target (DeepSeek-V3, Kimi-K2) the attention is MLA like the target's (`MLAttention`, vLLM's
`Eagle3DeepseekV2ForCausalLM`), and `norm_before_fc` norms each aux layer's features apart (`fc_norm`).

Three placements of a norm are options (the EAGLE-3.1 / speculators variants; each
written into the export for vLLM, `export.py`):
  norm_before_fc        RMSNorm over the 3H fused features before `fc` (`input_norm`)
  norm_before_residual  the residual of the layer is hidden_norm(h), not the raw h
  norm_output           step k feeds step k+1 the normed output, not the pre-norm one
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.target import TargetModel


@dataclass(frozen=True)
class DrafterShape:
    """What a drafter of any family takes from the target: its layers' shape and rotary embedding, its vocabulary,
    the draft vocabulary, and how many of its layers the drafter reads (`num_aux_layers`)."""

    hidden_size: int  # H, the target's hidden size
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # V, the target vocabulary (the frozen embedding's rows)
    draft_vocab_size: int  # Vd, the lm_head's rows
    rms_norm_eps: float = 1e-6
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    num_aux_layers: int = 3

    def __post_init__(self) -> None:
        if self.head_dim < 32:
            raise ValueError(f"head_dim {self.head_dim} < 32: vLLM cannot serve it (docs/DESIGN.md §6)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} outside 1..vocab_size ({self.vocab_size})")
        rope_type = self.rope.get("rope_type", "default")
        if rope_type != "default" and rope_type not in _rope_init_functions():
            raise ValueError(f"rope_type {rope_type!r} of the target is not one transformers knows")

    @classmethod
    def from_target(
        cls, target: TargetModel, *, draft_vocab_size: int, intermediate_size: int | None = None, **options: Any
    ) -> Self:
        """Shaped like the target's decoder layers, with its rotary embedding; `options` are the family's fields."""
        return cls(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=int(intermediate_size or target.intermediate_size),
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope=dict(target.rope),
            max_position_embeddings=target.max_context or 4096,
            **options,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def rope_dim(self) -> int:
        """The width the rotary embedding turns: every head dim, unless the attention says otherwise."""
        return self.head_dim


@dataclass(frozen=True)
class DrafterConfig(DrafterShape):
    """The EAGLE-3 drafter: the target's shape and the norm placements (the module docstring)."""

    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # MLA attention, as the target's (DeepSeek-V3, Kimi-K2; `MLAttention`); kv_lora_rank 0 = grouped-query attention.
    q_lora_rank: int = 0  # 0 = queries straight from the input, no latent
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_target(cls, target: TargetModel, **kwargs: Any) -> Self:
        """As `DrafterShape.from_target`; beside an MLA target the attention is MLA of the target's shape, its
        queries through a latent even where the target's have none (DeepSeek-V2-Lite's form): vLLM's EAGLE-3 DeepSeek
        drafter loads `q_a_proj` fused with `kv_a_proj_with_mqa` and has no other query weight."""
        mla = mla_fields(target.config)
        if mla and not mla["q_lora_rank"]:
            mla["q_lora_rank"] = target.hidden_size
        return super().from_target(target, **(mla | kwargs))

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.mla else self.head_dim


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rope_init_functions() -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def rotary_frequencies(cfg: DrafterShape) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [hd/2], attention scaling) of the target's rotary embedding.

    Plain rotary is computed here; a scaled one (llama3, yarn, linear, ...) by transformers'
    own init function for that type, so the drafter trains with what the engine applies.
    """
    theta = float(cfg.rope["rope_theta"])
    if cfg.rope.get("rope_type", "default") == "default":
        return 1.0 / (theta ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float32) / cfg.rope_dim)), 1.0
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.rope_dim,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope),
    )  # fmt: skip
    inv_freq, scaling = _rope_init_functions()[cfg.rope["rope_type"]](config, "cpu")
    return inv_freq.float(), float(scaling)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama ("neox", rotate-half) rotary tables for integer positions [...] -> [..., hd]."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, hd]; cos/sin [B, T, hd] broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)


def ttt_attention_mask(
    seq_len: int, num_steps: int, device: torch.device | None = None, segments: torch.Tensor | None = None,
    query_index: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Which keys a query of the latest TTT step sees: bool [T, num_steps * T] (True = attend).

    Block 0 is the causal mask over step-0 keys; block j >= 1 is the identity (step j's
    key at the query's own index). See the module docstring. With `segments` [B, T]
    (packed rows: the sample each token belongs to) block 0 is also cut to the query's
    own sample, and the mask is [B, 1, T, num_steps * T]. With `query_index` [B, Tq]
    (a step computed at some indices only, `StepIndices`) the queries are those indices
    and the later blocks are Tq wide: [B, 1, Tq, T + (num_steps - 1) * Tq].
    """
    if query_index is None and segments is None:  # one mask for every row
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        own = torch.eye(seq_len, dtype=torch.bool, device=device)
        return torch.cat([causal] + [own] * (num_steps - 1), dim=-1)
    if query_index is None:  # every index of every row queries
        query_index = torch.arange(seq_len, device=device).expand(segments.shape[0], seq_len)
    B, Tq = query_index.shape
    causal = torch.arange(seq_len, device=device)[None, None, :] <= query_index[:, :, None]  # [B, Tq, T]
    if segments is not None:
        causal &= segments[:, None, :] == segments.gather(1, query_index)[:, :, None]
    own = torch.eye(Tq, dtype=torch.bool, device=device).expand(B, Tq, Tq)
    return torch.cat([causal] + [own] * (num_steps - 1), dim=-1)[:, None]


@dataclass(frozen=True)
class StepIndices:
    """The indices one TTT step k >= 1 computes, when not all of them are needed.

    A prediction nothing scores (a prompt index far from any answer, padding, the last
    indices of a sample) still costs a full step; training computes step k only at the
    indices whose step-k or later prediction counts (`ttt.needed_indices`). Those sets
    shrink with k, so step k's indices are a subset of step k-1's: each step reads its
    input from the step before through `prev`.
      index [B, Tk] ascending indices into T; slots past a row's count repeat index 0
      valid [B, Tk] which slots are real
      prev  [B, Tk] each slot's slot in step k-1's layout (step 0's is all of T)
    """

    index: torch.Tensor
    valid: torch.Tensor
    prev: torch.Tensor


def step_indices(needed: torch.Tensor) -> list[StepIndices]:
    """Layouts of steps 1..K-1 from needed bool [K, B, T], each step's set within the one before."""
    K, B, T = needed.shape
    arange = torch.arange(T, device=needed.device)
    slot_before = arange.expand(B, T)  # step 0: index t is slot t
    layouts = []
    for k in range(1, K):
        count = needed[k].sum(1)  # [B]
        width = max(int(count.max()), 1)
        # Needed indices first, in order: sort keys t (needed) and T + t (not).
        index = torch.where(needed[k], arange, arange + T).argsort(dim=1)[:, :width]  # [B, Tk]
        valid = torch.arange(width, device=needed.device)[None, :] < count[:, None]
        index = index.masked_fill(~valid, 0)
        prev = slot_before.gather(1, index).masked_fill(~valid, 0)
        layouts.append(StepIndices(index, valid, prev))
        slot_before = torch.zeros(B, T, dtype=torch.long, device=needed.device).scatter(
            1, index, torch.arange(width, device=needed.device).expand(B, width).masked_fill(~valid, 0)
        )  # fmt: skip
    return layouts


class KVCache:
    """Keys/values of the TTT steps so far, one [B, nkv, T, hd] pair per step (steps >= 1 [B, nkv, Tk, hd]
    when computed at some indices only: `StepIndices`)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(k)
        self.values.append(v)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)  # [B, nkv, steps*T, hd]

    def select(self, prev: torch.Tensor) -> None:
        """Steps >= 1 follow the next step's layout: slot s takes slot prev[:, s] (prev [B, Tk])."""
        for kv in (self.keys, self.values):
            for j in range(1, len(kv)):
                kv[j] = kv[j].gather(2, prev[:, None, :, None].expand(-1, kv[j].shape[1], -1, kv[j].shape[3]))


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read the 2H-wide [embedding | hidden] input."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, segments: torch.Tensor | None,
        query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # x [B, T, 2H], or [B, Tk, 2H] at query_index [B, Tk] (indices into the step-0 keys' T)
        B, T, _ = x.shape
        nh, nkv, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = cache.append(k, v)  # [B, nkv, steps*T, hd]
        seq_len = cache.keys[0].shape[2]
        mask = ttt_attention_mask(seq_len, len(cache), x.device, segments, query_index)  # [T, steps*T] or [B, 1, T, ...]
        # The fused kernels take an arbitrary mask, so the [T, steps*T] scores are never
        # materialised per head (memory stays linear in T on GPU).
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=nh != nkv)  # [B, nh, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hd))  # [B, T, H]


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_fields(config: Mapping[str, Any]) -> dict[str, int]:
    """The MLA shape of an HF config (a DeepSeek-V3 target's, or an MLA drafter export's); {} for other attention."""
    if not config.get("kv_lora_rank"):
        return {}
    return {name: int(config.get(name) or 0) for name in MLA_FIELDS}


def yarn_softmax_scale(rope: Mapping[str, Any]) -> float:
    """The factor DeepSeek's MLA multiplies its softmax scale by under yarn rotary (mscale², 1 otherwise)."""
    factor, mscale_all_dim = float(rope.get("factor") or 1.0), float(rope.get("mscale_all_dim") or 0.0)
    if rope.get("rope_type") != "yarn" or factor <= 1.0 or not mscale_all_dim:
        return 1.0
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return mscale * mscale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...], the half-split layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the 2H-wide [embedding | hidden] input; `Attention`'s forward.

    What vLLM serves beside an MLA target (`deepseek_eagle3.py`). Its CPU build shows why it must be the target's
    kind: without AMX, its MLA kernel takes KV blocks of 16 tokens and its grouped-query kernel multiples of 32,
    so a grouped-query drafter shares no block size with the target ("No common block size", docs/DESIGN.md §6).
    Trained in the plain, not weight-absorbed, form (the same function):
      q      = q_b_proj(q_a_layernorm(q_a_proj(x)))             [B, T, nh, nope + rope]
      latent, k_rope = kv_a_proj_with_mqa(x)                     [B, T, kv_lora], [B, T, rope]
      k_nope, v = kv_b_proj(kv_a_layernorm(latent)) per head     [B, T, nh, nope], [B, T, nh, vd]
      k      = [k_nope | k_rope, one head shared by all]         [B, T, nh, nope + rope]
    Rotary turns the `rope` part only, interleaved (vLLM's `is_neox_style=False` for DeepSeek); it is
    de-interleaved here and turned half-wise, a permutation of q's and k's dims alike that leaves q·k unchanged.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(2 * h, nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=False)
        self.scale = self.qk_head_dim**-0.5 * yarn_softmax_scale(cfg.rope)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, segments: torch.Tensor | None,
        query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        cfg = self.cfg
        B, T, _ = x.shape
        nh, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.view(B, T, nh, self.qk_head_dim).transpose(1, 2)  # [B, nh, T, nope + rope]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, nh, nope + vd).transpose(1, 2)
        k_nope, v = kv.split([nope, vd], dim=-1)  # [B, nh, T, nope], [B, nh, T, vd]
        q_rope = apply_rotary(deinterleave(q[..., nope:]), cos, sin)  # [B, nh, T, rope]
        k_rope = apply_rotary(deinterleave(k_rope)[:, None], cos, sin)  # [B, 1, T, rope], one head shared by all
        q = torch.cat([q[..., :nope], q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, nh, -1, -1)], dim=-1)  # [B, nh, T, nope + rope]
        keys, values = cache.append(k, v)  # [B, nh, steps*T, nope + rope], [B, nh, steps*T, vd]
        mask = ttt_attention_mask(cache.keys[0].shape[2], len(cache), x.device, segments, query_index)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)  # [B, nh, T, vd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * vd))  # [B, T, H]


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The `midlayer`: attention (grouped-query, or MLA like the target's) over cat(input_layernorm(embed),
    hidden_norm(h)); the residual is the raw h, or hidden_norm(h) with `norm_before_residual` (the exported config
    says which)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        segments: torch.Tensor | None = None, query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # embeds, hidden [B, T, H]
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.self_attn(x, cos, sin, cache, segments, query_index)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H], the pre-norm output


class DrafterModule(nn.Module):
    """What a drafter of any family holds besides its layers: the target's frozen embedding, the vocab map's
    buffers and the rotary frequencies; how its weights start, and which of them are saved. A family's drafter
    builds its layers after this `__init__`, then calls `reset_parameters`."""

    def __init__(
        self, cfg: DrafterShape, d2t: torch.Tensor, t2d: torch.Tensor, embed_tokens: torch.Tensor | None = None
    ):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        # The target's embedding [V, H], frozen and kept in its own dtype (Kimi: 2.3 GB in
        # bf16); engines share the target's, so it is never exported. Zeros when not given.
        if embed_tokens is None:
            embed_tokens = torch.zeros(cfg.vocab_size, h)
        if tuple(embed_tokens.shape) != (cfg.vocab_size, h):
            raise ValueError(f"embedding is {list(embed_tokens.shape)}, expected [{cfg.vocab_size}, {h}]")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=embed_tokens.detach(), _freeze=True)
        d2t, t2d = torch.as_tensor(d2t, dtype=torch.int64), torch.as_tensor(t2d, dtype=torch.bool)
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise ValueError(
                f"vocab map shapes d2t {list(d2t.shape)}, t2d {list(t2d.shape)} do not fit "
                f"draft_vocab_size {cfg.draft_vocab_size} / vocab_size {cfg.vocab_size}"
            )
        self.register_buffer("d2t", d2t)  # [Vd] target id = draft id + d2t[draft id]
        self.register_buffer("t2d", t2d)  # [V] target id is in the draft vocab
        inv_freq, self.rope_scaling = rotary_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd/2]

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embedding: what checkpoints and exports hold."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


class Eagle3Drafter(DrafterModule):
    config: DrafterConfig

    def __init__(
        self, cfg: DrafterConfig, d2t: torch.Tensor, t2d: torch.Tensor, embed_tokens: torch.Tensor | None = None
    ):
        super().__init__(cfg, d2t, t2d, embed_tokens)
        h = cfg.hidden_size
        # The norm over the fused features exists only with norm_before_fc. vLLM's Llama form norms their
        # concatenation (`input_norm`); its DeepSeek (MLA) form each aux layer's H apart (`fc_norm.{i}`).
        self.input_norm = RMSNorm(cfg.num_aux_layers * h, cfg.rms_norm_eps) if cfg.norm_before_fc and not cfg.mla else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers))
            if cfg.norm_before_fc and cfg.mla
            else None
        )
        self.fc = nn.Linear(cfg.num_aux_layers * h, h, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.reset_parameters()

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        aux = aux.to(self.fc.weight.dtype)  # [B, T, A]
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        elif self.fc_norm is not None:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)  # [B, T, H]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # [B, T] -> [B, T, H]

    def step(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        segments: torch.Tensor | None = None, query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One TTT step: token ids [B, T], hidden [B, T, H], positions [B, T] -> pre-norm hidden [B, T, H]
        (T -> Tk throughout at `query_index` [B, Tk])."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.rope_scaling)
        return self.midlayer(self.embed(input_ids), hidden, cos, sin, cache, segments, query_index)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))  # [B, T, H] -> [B, T, Vd]

    def forward(
        self, input_ids: torch.Tensor, aux: torch.Tensor, num_steps: int,
        positions: torch.Tensor | None = None, segments: torch.Tensor | None = None,
        indices: list[StepIndices] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Draft logits of TTT steps 0..num_steps-1, each [B, T, Vd] ([B, Tk, Vd] with `indices`; see `unroll`)."""
        return [self.logits(h) for h in self.unroll(input_ids, aux, num_steps, positions, segments, indices)]

    def unroll(
        self, input_ids: torch.Tensor, aux: torch.Tensor, num_steps: int,
        positions: torch.Tensor | None = None, segments: torch.Tensor | None = None,
        indices: list[StepIndices] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """The TTT unroll: pre-norm hidden states of steps 0..num_steps-1, each [B, T, H].

        input_ids [B, T] are the sequence's own tokens (index t holds token t); aux
        [B, T, A] the target's fused features at each position. Step k reads token
        t+1+k (0 past the end; those positions carry no loss) and, for k > 0, the
        step k-1 output at the same index (normed with `norm_output`). Packed rows pass
        `segments` [B, T] (the sample of each token) and `positions` [B, T] (its index
        within that sample): attention then stays inside a sample, and a read past a
        sample's end is, like one past the row's end, never scored. With `indices`
        (one `StepIndices` per step k >= 1) step k is computed at those indices only and
        its output is [B, Tk, H], slot s holding index indices[k-1].index[:, s]; at
        every computed index it equals the full unroll's.
        """
        B, T = input_ids.shape
        cache = KVCache()
        index = torch.arange(T, device=input_ids.device).expand(B, T) if positions is None else positions
        hidden = self.project(aux)  # [B, T, H]
        outputs = []
        for k in range(num_steps):
            at = indices[k - 1] if indices is not None and k > 0 else None
            if at is None:
                read, step_positions = torch.arange(T, device=input_ids.device).expand(B, T) + 1 + k, index + k
            else:
                hidden = hidden.gather(1, at.prev[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, Tk, H]
                cache.select(at.prev)
                read, step_positions = at.index + 1 + k, index.gather(1, at.index) + k
            tokens = input_ids.gather(1, read.clamp(max=T - 1)).masked_fill(read >= T, 0)
            prenorm = self.step(tokens, hidden, step_positions, cache, segments, None if at is None else at.index)
            outputs.append(prenorm)
            hidden = self.norm(prenorm) if self.config.norm_output else prenorm
        return outputs


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "DrafterConfig",
    "Eagle3Drafter",
    "KVCache",
    "MLAttention",
    "StepIndices",
    "count_parameters",
    "mla_fields",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_frequencies",
    "step_indices",
    "ttt_attention_mask",
]
