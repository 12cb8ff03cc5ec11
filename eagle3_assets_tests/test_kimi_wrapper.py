"""Kimi-K2.5's wrapper (issue 51, item 1), engine-free: `KimiK25ForConditionalGeneration` around a DeepSeek-V3 text
model. The pipeline reads the shape from `text_config` and the drafter's embedding, final norm and head under the
published checkpoint's names (`language_model.…`), and the HF backend extracts the text model's hidden states from it; a
wrapper without `text_config` is refused, naming it. Through the whole graph: `test_architectures.py`'s `kimi_k25` leg."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_assets.demo.kimi_k25 import (
    ARCHITECTURE,
    INDEX_FILE,
    TINY_VISION_CONFIG,
    wrapped_name,
    wrapper_config,
    write_kimi_k25_wrapper,
)
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.hidden_states import ExtractionRequest, extract_in_order
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.settings import CONFIG_ENV, SettingsError, load_settings
from eagle3_assets.target import TargetModel, TargetModelError


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> tuple[Path, DeepseekV3ForCausalLM]:
    """A random DeepSeek-V3 (MLA, a dense first layer, then routed experts with a shared one), saved in shards."""
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # a flat norm would not show which tensor was read
    out = tmp_path_factory.mktemp("dsv3") / "text"
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / INDEX_FILE).exists()
    return out, model


@pytest.fixture(scope="module")
def kimi_k25(deepseek_v3, tmp_path_factory) -> Path:
    return write_kimi_k25_wrapper(deepseek_v3[0], tmp_path_factory.mktemp("k25") / "model")


def test_the_wrapper_config_holds_the_text_model_under_text_config(deepseek_v3, kimi_k25: Path):
    text = json.loads((deepseek_v3[0] / "config.json").read_text())
    config = json.loads((kimi_k25 / "config.json").read_text())
    assert config == wrapper_config(text)
    text.pop("transformers_version")
    assert (config["architectures"], config["model_type"], config["text_config"]) == ([ARCHITECTURE], "kimi_k25", text)
    assert config["text_config"]["model_type"] == "deepseek_v3"
    assert (config["vision_config"], config["tie_word_embeddings"], config["dtype"]) == (
        TINY_VISION_CONFIG, False, "float32",
    )  # fmt: skip
    # vLLM's model reads the first, its EAGLE-3 proposer the second
    assert config["image_token_id"] == config["media_placeholder_token_id"] == 163605
    again = write_kimi_k25_wrapper(deepseek_v3[0], kimi_k25.parent / "again")
    for name in ("config.json", INDEX_FILE):
        assert (again / name).read_bytes() == (kimi_k25 / name).read_bytes()
    with pytest.raises(FileExistsError) as e:
        write_kimi_k25_wrapper(deepseek_v3[0], again)
    assert str(e.value) == f"{again}: the wrapper's directory exists already"


def test_the_shape_is_read_from_text_config(kimi_k25: Path):
    target = TargetModel.read(kimi_k25)
    assert target.architecture == ARCHITECTURE
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 64, 512)
    assert (target.num_attention_heads, target.intermediate_size, target.max_context) == (2, 128, 1024)
    assert (target.rms_norm_eps, target.tie_word_embeddings, target.dtype) == (1e-5, False, "float32")
    assert target.aux_layer_ids == (2, 4, 5)  # the defaults [2, N//2, N-3] of the text model's 8 layers
    assert target.config["model_type"] == "deepseek_v3" and target.config["kv_lora_rank"] == 32
    with pytest.raises(TargetModelError) as e:  # the text model's layers, not the wrapper's (it has none)
        TargetModel.read(kimi_k25, aux_layer_ids=[2, 4, 8])
    assert str(e.value) == (
        "aux_layer_ids: layer id(s) [8] outside the model, which has 8 layers (valid 'input of layer i' ids: 1..7)"
    )


def test_the_drafters_embedding_norm_and_head_are_read_under_the_wrappers_names(deepseek_v3, kimi_k25: Path):
    model = deepseek_v3[1]
    weight_map = json.loads((kimi_k25 / INDEX_FILE).read_text())["weight_map"]
    names = [f"language_model.{n}.weight" for n in ("model.embed_tokens", "model.norm", "lm_head")]
    assert all(n in weight_map for n in names) and not any(n.startswith(("model.", "lm_head.")) for n in weight_map)
    assert len(set(weight_map.values())) > 1  # sharded, as the published checkpoint is
    w = load_target_weights(TargetModel.read(kimi_k25))
    assert torch.equal(w.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(w.final_norm, model.model.norm.weight)
    assert torch.equal(w.lm_head, model.lm_head.weight)
    assert w.rms_norm_eps == 1e-5
    with pytest.raises(ValueError) as e:
        wrapped_name("vision_tower.patch_embed.weight")
    assert str(e.value) == (
        "vision_tower.patch_embed.weight: not a causal-LM tensor name (expected model.… or lm_head.…)"
    )


def test_the_hf_backend_extracts_the_text_models_hidden_states_from_the_wrapper(deepseek_v3, kimi_k25: Path):
    """transformers loads a wrapper as image-text-to-text (`target.load_hf_model`); given token ids alone it runs the
    text model: the same aux and last hidden states as the text model's own directory, to the bit."""
    request = ExtractionRequest(0, np.array([1, 7, 42, 300, 5, 9], dtype=np.int32))
    samples = []
    for path in (deepseek_v3[0], kimi_k25):
        extractor = HFExtractor(TargetModel.read(path, aux_layer_ids=[1, 3, 5]), batch_tokens=64, device="cpu")
        assert extractor.last_hidden_state_norm == "pre_norm"  # the text model's final norm was found
        samples.append(extract_in_order(extractor, [request])[0])
    text, wrapped = samples
    assert torch.equal(wrapped.aux_hidden_states, text.aux_hidden_states)
    assert torch.equal(wrapped.last_hidden_state, text.last_hidden_state)
    assert wrapped.aux_hidden_states.shape == (6, 3 * 64)


def test_a_wrapper_without_text_config_is_refused_naming_it(kimi_k25: Path, tmp_path: Path):
    config = json.loads((kimi_k25 / "config.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "text_config"}))
    wrapper_message = (
        f"{bare}/config.json: {ARCHITECTURE} wraps a text model but has no `text_config`; the text model's shape "
        "(num_hidden_layers, hidden_size, vocab_size, num_attention_heads) is read from there"
    )
    with pytest.raises(TargetModelError) as e:
        TargetModel.read(bare)
    assert str(e.value) == wrapper_message
    # At settings load, before anything runs.
    settings_file = tmp_path / "eagle3.yaml"
    settings_file.write_text(f"target_model: {bare}\nprompts: /data/p.jsonl\n")
    with pytest.raises(SettingsError) as e:
        load_settings({CONFIG_ENV: str(settings_file)})
    assert str(e.value) == f"invalid settings in {settings_file}: {wrapper_message}"
    (bare / "config.json").write_text(json.dumps({**config, "text_config": None}))
    with pytest.raises(TargetModelError) as e:
        TargetModel.read(bare)
    assert str(e.value) == wrapper_message
    (bare / "config.json").write_text(json.dumps({**config, "text_config": "deepseek_v3"}))
    with pytest.raises(TargetModelError) as e:
        TargetModel.read(bare)
    assert str(e.value) == (
        f"{bare}/config.json: `text_config` must be an object holding the text model's config, got 'deepseek_v3'"
    )
