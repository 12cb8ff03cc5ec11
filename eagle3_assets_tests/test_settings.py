import json
from pathlib import Path

import pytest

from eagle3_assets.settings import Settings, SettingsError, demo_settings, load_settings


def write_config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "eagle3.yaml"
    path.write_text(text)
    return {"EAGLE3_CONFIG": str(path)}


def fake_model(tmp_path: Path, layers: int = 61, vocab: int = 163_840) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "vocab_size": vocab}))
    return model


def test_without_config_the_demo_applies():
    s = load_settings({})
    assert s == demo_settings()
    assert s.is_demo and (s.shard_size, s.demo.num_prompts) == (400, 2000)  # five shards


def test_defaults_of_a_production_config(tmp_path: Path):
    model = fake_model(tmp_path)
    s = load_settings(write_config(tmp_path, f"target_model: {model}\nprompts: /data/p.jsonl\n"))
    assert (s.shard_size, s.draft_vocab_size, s.aux_layer_ids) == (2000, 32000, None)
    assert s.resolved_aux_layer_ids(61) == [2, 30, 58]


def test_duplicate_aux_layer_ids_name_the_field(tmp_path: Path):
    with pytest.raises(SettingsError, match=r"aux_layer_ids: Value error, layer id 2 appears twice in \[2, 2, 5\]"):
        load_settings(write_config(tmp_path, "aux_layer_ids: [2, 2, 5]\n"))


def test_unknown_and_mistyped_fields_are_named(tmp_path: Path):
    with pytest.raises(SettingsError) as e:
        load_settings(write_config(tmp_path, "shard_sise: 10\ngeneration:\n  batch_size: 0\n"))
    msg = str(e.value)
    assert "shard_sise: Extra inputs are not permitted" in msg
    assert "generation.batch_size: Input should be greater than or equal to 1" in msg


def test_layer_id_outside_the_model_is_refused_at_load(tmp_path: Path):
    model = fake_model(tmp_path, layers=8, vocab=100_000)
    with pytest.raises(SettingsError, match=r"aux_layer_ids: layer id\(s\) \[9\] outside the model, which has 8 layers"):
        load_settings(write_config(tmp_path, f"target_model: {model}\naux_layer_ids: [2, 4, 9]\n"))


def test_draft_vocab_larger_than_target_vocab_is_refused_at_load(tmp_path: Path):
    model = fake_model(tmp_path, layers=8, vocab=5000)
    with pytest.raises(SettingsError, match=r"draft_vocab_size: 32000 is larger than the target vocabulary \(5000\)"):
        load_settings(write_config(tmp_path, f"target_model: {model}\n"))


def test_missing_and_malformed_config_files(tmp_path: Path):
    with pytest.raises(SettingsError, match=r"EAGLE3_CONFIG=.*nope.yaml: file not found"):
        load_settings({"EAGLE3_CONFIG": str(tmp_path / "nope.yaml")})
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(write_config(tmp_path, "shard_size: [1,\n"))


def test_default_aux_ids_colliding_on_a_tiny_model_ask_for_explicit_ids():
    with pytest.raises(SettingsError, match="collide for a 4-layer model; set them explicitly"):
        Settings().resolved_aux_layer_ids(4)
