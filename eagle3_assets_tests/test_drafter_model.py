"""The draft model: shapes, parameter names, and the TTT attention pattern against a naive reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3_assets.drafter.export import expected_export_tensors
from eagle3_assets.target import TargetModel
from eagle3_assets.drafter.model import (
    DrafterConfig, Eagle3Drafter, KVCache, MLAttention, rms_norm, rotary_cos_sin, rotary_frequencies, step_indices,
    ttt_attention_mask,
)  # fmt: skip

CFG = DrafterConfig(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    vocab_size=256,
    draft_vocab_size=64,
    rms_norm_eps=1e-5,
)


def make_model(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    used = torch.arange(0, 256, 4)
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[used] = True
    model = Eagle3Drafter(CFG, used - torch.arange(64), t2d)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)  # norms away from 1, so a skipped norm shows
    return model.eval()


def inputs(B: int = 2, T: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randn(B, T, 3 * 64, generator=g)


def test_forward_backward_shapes_and_frozen_embedding():
    model = make_model().train()
    ids, aux = inputs()
    logits = model(ids, aux, 3)
    assert [tuple(x.shape) for x in logits] == [(2, 7, 64)] * 3
    sum(x.logsumexp(-1).sum() for x in logits).backward()
    assert model.embed_tokens.weight.grad is None
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}


def test_parameter_names_are_the_ones_engines_load():
    sd = make_model().trainable_state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_export_tensors(CFG)
    assert sorted(sd) == sorted(
        [
            "fc.weight",
            "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight",
            "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight",
            "midlayer.mlp.down_proj.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
        ]
    )
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # q/k/v read the 2H-wide input


def test_ttt_mask_pattern():
    assert ttt_attention_mask(3, 3).int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


def naive_unroll(model: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The documented TTT computation written out position by position, for one sequence."""
    cfg, layer = model.config, model.midlayer
    attn = layer.self_attn
    T = ids.shape[0]
    hidden = model.fc(aux)  # [T, H]
    keys, values, outs = [], [], []  # per step: [nkv, T, hd]
    for k in range(steps):
        tok = torch.tensor([int(ids[t + 1 + k]) if t + 1 + k < T else 0 for t in range(T)])
        emb = model.embed_tokens(tok)
        x = torch.cat([rms_norm(emb, layer.input_layernorm.weight, cfg.rms_norm_eps),
                       rms_norm(hidden, layer.hidden_norm.weight, cfg.rms_norm_eps)], -1)
        cos, sin = rotary_cos_sin(torch.arange(T) + k, model.inv_freq)  # position t + k

        def rope(z):  # z [heads, T, hd]
            z1, z2 = z.chunk(2, -1)
            return z * cos + torch.cat([-z2, z1], -1) * sin

        q = rope(attn.q_proj(x).view(T, 2, 32).transpose(0, 1))
        keys.append(rope(attn.k_proj(x).view(T, 1, 32).transpose(0, 1)))
        values.append(attn.v_proj(x).view(T, 1, 32).transpose(0, 1))
        y = torch.zeros(T, 2, 32)
        for t in range(T):
            for h in range(2):
                # step-0 keys at s <= t, then step j's key at t for j = 1..k
                ks = [keys[0][0, s] for s in range(t + 1)] + [keys[j][0, t] for j in range(1, k + 1)]
                vs = [values[0][0, s] for s in range(t + 1)] + [values[j][0, t] for j in range(1, k + 1)]
                w = torch.softmax(torch.stack(ks) @ q[h, t] / math.sqrt(32), 0)
                y[t, h] = w @ torch.stack(vs)
        h1 = hidden + attn.o_proj(y.reshape(T, 64))
        hidden = h1 + layer.mlp(rms_norm(h1, layer.post_attention_layernorm.weight, cfg.rms_norm_eps))
        outs.append(hidden)
    return outs


@torch.no_grad()
def test_unroll_matches_the_documented_attention_pattern():
    model = make_model()
    ids, aux = inputs(B=2, T=6)
    got = model.unroll(ids, aux, 3)
    for b in range(2):
        want = naive_unroll(model, ids[b], aux[b], 3)
        for k in range(3):
            torch.testing.assert_close(got[k][b], want[k], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_step_k_feeds_back_step_k_minus_1_output_at_the_same_index():
    model = make_model()
    ids, aux = inputs(B=1, T=8)
    base = model.unroll(ids, aux, 3)

    calls = {"n": 0}

    def perturb_first_step(module, args, output):
        calls["n"] += 1
        if calls["n"] == 1:  # step 0's output, index 3 only
            output = output.clone()
            output[:, 3] += 1.0
            return output

    handle = model.midlayer.register_forward_hook(perturb_first_step)
    try:
        perturbed = model.unroll(ids, aux, 3)
    finally:
        handle.remove()
    changed = (perturbed[1] - base[1]).abs().amax(-1)[0] > 1e-6  # [T]
    # Step 1 at index 3 read the perturbed state; no other index of step 1 reads it
    # (they attend to step-0 keys, computed from fc(aux), and their own index).
    assert changed.tolist() == [t == 3 for t in range(8)]
    assert ((perturbed[2] - base[2]).abs().amax(-1)[0] > 1e-6).tolist() == [t == 3 for t in range(8)]


@torch.no_grad()
def test_aux_features_reach_later_indices_only():
    model = make_model()
    ids, aux = inputs(B=1, T=8)
    base = model.unroll(ids, aux, 2)
    aux2 = aux.clone()
    aux2[0, 4] += 1.0
    moved = model.unroll(ids, aux2, 2)
    for k in range(2):
        changed = ((moved[k] - base[k]).abs().amax(-1)[0] > 1e-6).tolist()
        assert changed == [t >= 4 for t in range(8)], k


def test_step_indices_lay_out_each_step_within_the_one_before():
    needed = torch.tensor(
        [
            [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]],  # step 0: every index
            [[0, 1, 0, 1, 1], [1, 0, 0, 0, 0]],
            [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]],  # row 1 needs nothing at step 2
        ],
        dtype=torch.bool,
    )
    one, two = step_indices(needed)
    assert one.index.tolist() == [[1, 3, 4], [0, 0, 0]]
    assert one.valid.tolist() == [[True, True, True], [True, False, False]]
    assert one.prev.tolist() == [[1, 3, 4], [0, 0, 0]]  # step 0's layout is the indices themselves
    assert two.index.tolist() == [[3, 4], [0, 0]]
    assert two.valid.tolist() == [[True, True], [False, False]]
    assert two.prev.tolist() == [[1, 2], [0, 0]]  # index 3 was step 1's slot 1, index 4 its slot 2


@pytest.mark.parametrize("norm_output", [False, True])
@torch.no_grad()
def test_an_unroll_at_some_indices_equals_the_full_unroll_there(norm_output):
    torch.manual_seed(0)
    model = make_model()
    if norm_output:
        model = Eagle3Drafter(
            DrafterConfig(**{**CFG.to_dict(), "norm_output": True, "norm_before_residual": True}), model.d2t, model.t2d,
            model.embed_tokens.weight,
        )  # fmt: skip
    ids, aux = inputs(B=2, T=9)
    segments = torch.tensor([[0] * 5 + [1] * 4, [0] * 7 + [-1] * 2])
    positions = torch.tensor([list(range(5)) + list(range(4)), list(range(7)) + [0, 0]])
    g = torch.Generator().manual_seed(2)
    needed = torch.rand(4, 2, 9, generator=g) < 0.6
    needed = needed.flip(0).cummax(0).values.flip(0)  # nested: step k's within step k-1's
    needed[0] = True
    layouts = step_indices(needed)
    assert [tuple(x.index.shape) for x in layouts] != [(2, 9)] * 3  # indices were dropped
    full = model.unroll(ids, aux, 4, positions, segments)
    part = model.unroll(ids, aux, 4, positions, segments, layouts)
    torch.testing.assert_close(part[0], full[0])
    for k, at in enumerate(layouts, start=1):
        want = full[k].gather(1, at.index[..., None].expand(-1, -1, 64))
        torch.testing.assert_close(part[k][at.valid], want[at.valid], rtol=1e-5, atol=1e-5)


def test_sdpa_mask_rows_match_explicit_softmax():
    # The fused kernel with a boolean mask computes the masked softmax we document.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 32, generator=g) for _ in range(3))
    keys, vals = torch.cat([k, k * 2], 2), torch.cat([v, -v], 2)
    mask = ttt_attention_mask(4, 2)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(32)
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vals
    torch.testing.assert_close(F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask), want)


def test_config_from_target_config_and_bad_shapes():
    target = {
        "num_hidden_layers": 61,
        "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432,
        "vocab_size": 163840, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    }
    cfg = DrafterConfig.from_target(TargetModel.from_config({"text_config": target}, path="kimi"), draft_vocab_size=32000)
    assert (cfg.head_dim, cfg.rope, cfg.max_position_embeddings) == (112, {"rope_type": "default", "rope_theta": 50000.0}, 262144)
    assert (cfg.intermediate_size, cfg.num_key_value_heads) == (18432, 64)
    with pytest.raises(ValueError, match="head_dim 16 < 32"):
        DrafterConfig.from_target(TargetModel.from_config({**target, "head_dim": 16}, path="x"), draft_vocab_size=32000)
    with pytest.raises(ValueError, match=r"vocab map shapes d2t \[10\]"):
        Eagle3Drafter(CFG, torch.zeros(10, dtype=torch.int64), torch.zeros(256, dtype=torch.bool))
    assert KVCache().__len__() == 0


MLA = dict(q_lora_rank=48, kv_lora_rank=40, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)


def test_mla_attention_is_deepseek_v3s_own():
    """The drafter's MLA equals transformers' DeepSeek-V3 attention (interleaved rotary, as vLLM serves it) given the
    same weights: HF's reads an input as wide as its hidden size, so it is built 2H wide and its output cut to H."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    torch.manual_seed(0)
    H, T = 64, 7
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                        vocab_size=100, draft_vocab_size=100, **MLA)  # fmt: skip
    ours = MLAttention(cfg)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hf_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=cfg.rms_norm_eps,
                              rope_interleave=True, **MLA)  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    weights = dict(ours.state_dict())
    weights["o_proj.weight"] = torch.cat([weights["o_proj.weight"], torch.zeros(H, 2 * MLA["v_head_dim"])])
    hf.load_state_dict(weights, strict=True)
    x, positions = torch.randn(1, T, 2 * H), torch.arange(T)[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    want = hf(x, position_embeddings=DeepseekV3RotaryEmbedding(hf_cfg)(x, positions), attention_mask=causal)[0][..., :H]
    cos, sin = rotary_cos_sin(positions, *rotary_frequencies(cfg))
    got = ours(x, cos, sin, KVCache(), None)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_an_mla_targets_drafter_has_mla_and_per_layer_feature_norms_under_vllms_deepseek_names():
    target = TargetModel.from_config(
        {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
         "num_attention_heads": 2, "intermediate_size": 96, **MLA},
        path="mla-target",
    )  # fmt: skip
    cfg = DrafterConfig.from_target(target, draft_vocab_size=50, norm_before_fc=True)
    assert cfg.mla and (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.rope_dim) == (40, 16, 16)
    model = Eagle3Drafter(cfg, torch.zeros(50, dtype=torch.long), torch.arange(100) < 50)
    shapes = {n: tuple(t.shape) for n, t in model.trainable_state_dict().items()}
    assert shapes == expected_export_tensors(cfg)
    assert {n for n in shapes if "self_attn" in n or "norm" in n} == {
        "midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.q_a_layernorm.weight", "midlayer.self_attn.q_b_proj.weight",
        "midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.kv_a_layernorm.weight",
        "midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
        "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight",
    }  # fmt: skip
    # Queries without a latent in the target (DeepSeek-V2-Lite's form, the demo's miniature): the drafter's go through
    # one of the hidden size, the only query weight vLLM's EAGLE-3 DeepSeek drafter loads (fused with kv_a_proj).
    lite = TargetModel.from_config({**target.config, "q_lora_rank": None}, path="mla-target")
    assert DrafterConfig.from_target(lite, draft_vocab_size=50).q_lora_rank == 64
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (40 + 16, 128)  # latent + shared rope key
    logits = model(torch.randint(0, 100, (2, 9)), torch.randn(2, 9, 3 * 64), num_steps=3)
    assert [tuple(l.shape) for l in logits] == [(2, 9, 50)] * 3
