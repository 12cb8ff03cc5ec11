"""The export: exact tensor names and shapes, config.json, and loud failures."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from eagle3_assets.drafter.export import ExportError, export_drafter, expected_export_tensors, load_export
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.storage import ArtifactStore

from .test_drafter_model import CFG, make_model

EXPECTED_SHAPES = {
    "fc.weight": (64, 192),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (64, 128),
    "midlayer.self_attn.k_proj.weight": (32, 128),
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "norm.weight": (64,),
    "lm_head.weight": (64, 64),
    "d2t": (64,),
    "t2d": (256,),
}


def test_export_writes_exact_tensors_and_config(tmp_path):
    model = make_model()
    store = ArtifactStore(tmp_path)
    url = export_drafter(store, model.trainable_state_dict(), CFG, aux_layer_ids=[1, 2, 3], max_position_embeddings=8192)
    assert url == store.url_of("drafter/export")
    assert sorted(store.listdir("drafter/export")) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "drafter/export/model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert shapes == EXPECTED_SHAPES
    assert {k for k, d in dtypes.items() if d != "BF16"} == {"d2t", "t2d"}
    assert (dtypes["d2t"], dtypes["t2d"]) == ("I64", "BOOL")
    tensors = st_load((tmp_path / "drafter/export/model.safetensors").read_bytes())
    assert torch.equal(tensors["d2t"], model.d2t) and torch.equal(tensors["t2d"], model.t2d)
    assert torch.equal(tensors["fc.weight"], model.fc.weight.detach().bfloat16())

    cfg = json.loads((tmp_path / "drafter/export/config.json").read_text())
    assert cfg == {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 8192,
        "vocab_size": 256,
        "draft_vocab_size": 64,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def test_missing_renamed_misshaped_tensors_are_named(tmp_path):
    store = ArtifactStore(tmp_path)
    sd = make_model().trainable_state_dict()

    missing = {k: v for k, v in sd.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ExportError, match=r"missing tensor midlayer.hidden_norm.weight \[64\]"):
        export_drafter(store, missing, CFG, aux_layer_ids=[1, 2, 3])

    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.mlp.up") else k): v for k, v in sd.items()}
    with pytest.raises(ExportError) as e:
        export_drafter(store, renamed, CFG, aux_layer_ids=[1, 2, 3])
    assert "missing tensor midlayer.mlp.up_proj.weight [128, 64]" in str(e.value)
    assert "unexpected tensor layers.0.mlp.up_proj.weight [128, 64]" in str(e.value)

    bad = dict(sd, **{"fc.weight": torch.zeros(64, 128)})
    with pytest.raises(ExportError, match=r"tensor fc.weight is \[64, 128\], expected \[64, 192\]"):
        export_drafter(store, bad, CFG, aux_layer_ids=[1, 2, 3])

    with_embed = dict(sd, **{"embed_tokens.weight": torch.zeros(256, 64)})
    with pytest.raises(ExportError, match=r"unexpected tensor embed_tokens.weight \[256, 64\]"):
        export_drafter(store, with_embed, CFG, aux_layer_ids=[1, 2, 3])

    swapped = dict(sd, d2t=torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ExportError, match=r"d2t and t2d disagree"):
        export_drafter(store, swapped, CFG, aux_layer_ids=[1, 2, 3])

    with pytest.raises(ExportError, match=r"aux_layer_ids \[1, 1, 3\]"):
        export_drafter(store, sd, CFG, aux_layer_ids=[1, 1, 3])
    # Nothing was published by the refused exports.
    assert not store.exists("drafter/export")


def test_full_vocab_drafter_leaves_out_d2t_and_memory_store_works():
    cfg = DrafterConfig(**{**CFG.to_dict(), "draft_vocab_size": 256})
    model = Eagle3Drafter(cfg, torch.zeros(256, dtype=torch.int64), torch.ones(256, dtype=torch.bool))
    assert "d2t" not in expected_export_tensors(cfg)
    store = ArtifactStore(f"memory://drafter-export-{uuid.uuid4().hex}")
    export_drafter(store, model.trainable_state_dict(), cfg, aux_layer_ids=[1, 2, 3], dtype="float32")
    tensors = st_load(store.read_bytes("drafter/export/model.safetensors"))
    assert "d2t" not in tensors and tensors["lm_head.weight"].dtype == torch.float32
    assert store.read_json("drafter/export/config.json")["draft_vocab_size"] == 256


def test_load_export_gives_back_the_exported_drafter_and_refuses_a_broken_one(tmp_path):
    model = make_model()
    store = ArtifactStore(tmp_path)
    export_drafter(store, model.trainable_state_dict(), CFG, aux_layer_ids=[1, 2, 3])
    loaded, aux_ids = load_export(tmp_path / "drafter/export", model.embed_tokens.weight)
    assert aux_ids == [1, 2, 3] and loaded.config == CFG
    for name, tensor in model.trainable_state_dict().items():
        want = tensor if name in ("d2t", "t2d") else tensor.bfloat16().float()
        assert torch.equal(loaded.state_dict()[name], want), name
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)

    path = tmp_path / "drafter/export/model.safetensors"
    tensors = st_load(path.read_bytes())
    del tensors["norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ExportError, match=r"not a loadable drafter export:\n  missing tensor norm.weight \[64\]"):
        load_export(tmp_path / "drafter/export", model.embed_tokens.weight)
