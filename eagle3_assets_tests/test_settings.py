import json
from pathlib import Path

import pytest

from eagle3_assets.settings import (
    Settings,
    SettingsError,
    TrainingSettings,
    artifact_root,
    demo_settings,
    load_settings,
)
from eagle3_assets.target import TargetModel, TargetModelError, resolve_aux_layer_ids


def write_config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "eagle3.yaml"
    path.write_text(text)
    return {"EAGLE3_CONFIG": str(path)}


def fake_model(tmp_path: Path, layers: int = 61, vocab: int = 163_840) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    cfg = {"num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": 7168, "num_attention_heads": 64}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def test_without_config_the_demo_applies():
    s = load_settings({})
    assert s == demo_settings()
    assert s.is_demo and (s.shard_size, s.demo.num_prompts) == (400, 4000)  # ten shards


def test_defaults_of_a_production_config(tmp_path: Path):
    model = fake_model(tmp_path)
    s = load_settings(write_config(tmp_path, f"target_model: {model}\nprompts: /data/p.jsonl\n"))
    assert (s.shard_size, s.draft_vocab_size, s.aux_layer_ids) == (2000, 32000, None)
    assert TargetModel.read(model).aux_layer_ids == (2, 30, 58)


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
    with pytest.raises(TargetModelError, match=r"aux_layer_ids: \[1, 2, 2\] are the defaults for a 4-layer model and collide"):
        resolve_aux_layer_ids(None, 4)


def test_a_bad_backfill_cron_is_named_at_load(tmp_path: Path):
    with pytest.raises(SettingsError) as e:
        load_settings(write_config(tmp_path, 'extraction:\n  backfill_cron: "every 15 minutes"\n'))
    assert "extraction.backfill_cron: Value error, 'every 15 minutes' is not a 5-field cron schedule" in str(e.value)


def test_a_cron_of_five_fields_dagster_refuses_fails_the_code_location_named(tmp_path: Path):
    # Settings import no Dagster: they check the shape, Dagster's parser the values, as the code location loads.
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.project import Project
    from eagle3_assets.storage import ArtifactStore

    settings = load_settings(write_config(tmp_path, 'extraction:\n  backfill_cron: "61 * * * *"\n'))
    with pytest.raises(SettingsError, match=r"^extraction.backfill_cron: '61 \* \* \* \*' is not a 5-field cron schedule"):
        build_definitions(Project(settings, ArtifactStore(str(tmp_path / "store"))))
    hourly = load_settings(write_config(tmp_path, 'extraction:\n  backfill_cron: "@hourly"\n'))
    build_definitions(Project(hourly, ArtifactStore(str(tmp_path / "store"))))


def test_a_config_path_naming_a_directory_or_an_unknown_protocol_is_named(tmp_path: Path):
    with pytest.raises(SettingsError, match=rf"EAGLE3_CONFIG={tmp_path}: is a directory; name the YAML settings file"):
        load_settings({"EAGLE3_CONFIG": str(tmp_path)})
    with pytest.raises(SettingsError, match=r"EAGLE3_CONFIG=foo://x/eagle3.yaml: cannot be read: Protocol not known: foo"):
        load_settings({"EAGLE3_CONFIG": "foo://x/eagle3.yaml"})
    with pytest.raises(SettingsError, match=r"EAGLE3_ROOT=foo://x: Protocol not known: foo"):
        artifact_root({"EAGLE3_ROOT": "foo://x"})
    assert artifact_root({"EAGLE3_ROOT": "memory://run"}) == "memory://run"


def test_a_byte_order_mark_before_the_settings_is_not_part_of_them(tmp_path: Path):
    (tmp_path / "eagle3.yaml").write_bytes("\ufeffshard_size: 7\n".encode())
    assert load_settings({"EAGLE3_CONFIG": str(tmp_path / "eagle3.yaml")}).shard_size == 7


def test_drafter_eval_has_its_own_decode_length_and_a_timeout_that_grows_with_the_work(tmp_path: Path):
    from eagle3_assets.drafter.evaluate import eval_timeout_s

    s = load_settings(write_config(tmp_path, "evaluation: {max_new_tokens: 64, engine_load_s: 100, min_tokens_per_s: 10}\n"))
    assert (s.evaluation.max_new_tokens, s.generation.max_new_tokens) == (64, 2048)
    # 5 passes x (100 s to load + 40 prompts x 64 tokens at 10 tokens/s)
    assert eval_timeout_s(s.evaluation, passes=5, prompts=40, max_tokens=64) == 5 * (100 + 256)
    assert eval_timeout_s(s.evaluation, passes=5, prompts=80, max_tokens=64) == 5 * (100 + 512)
    with pytest.raises(SettingsError, match="evaluation.max_new_tokens: Input should be greater than or equal to 1"):
        load_settings(write_config(tmp_path, "evaluation: {max_new_tokens: 0}\n"))


def test_non_finite_numbers_are_refused_naming_the_field(tmp_path: Path):
    text = "generation:\n  temperature: .inf\ntraining:\n  epochs: .nan\nextraction:\n  disk_margin: .inf\n"
    with pytest.raises(SettingsError) as e:
        load_settings(write_config(tmp_path, text))
    msg = str(e.value)
    for field in ("generation.temperature", "training.epochs", "extraction.disk_margin"):
        assert f"{field}: Input should be a finite number" in msg


def test_an_empty_settings_file_and_a_target_model_that_is_a_file_are_named(tmp_path: Path):
    with pytest.raises(SettingsError, match=r"eagle3.yaml: the file holds no settings; name at least target_model"):
        load_settings(write_config(tmp_path, "# nothing yet\n"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(SettingsError, match=r"target_model: .*model.safetensors is a file; name the model's directory"):
        load_settings(write_config(tmp_path, f"target_model: {weights}\n"))


def test_a_kv_cache_of_a_fraction_of_a_gib_is_refused_naming_the_field(tmp_path: Path):
    with pytest.raises(SettingsError) as e:
        load_settings(write_config(tmp_path, "vllm: {cpu_kv_cache_gib: 0.5}\n"))
    assert str(e.value) == (
        f"invalid settings in {tmp_path / 'eagle3.yaml'}:\n  vllm.cpu_kv_cache_gib: Value error, 0.5: the CPU build "
        "takes its KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE is read as an integer); give a whole number, 1 or "
        "more (e.g. 4)"
    )
    assert load_settings(write_config(tmp_path, "vllm: {cpu_kv_cache_gib: 4.0}\n")).vllm.cpu_kv_cache_gib == 4


def test_a_prompt_file_without_held_out_prompts_cannot_be_evaluated_and_the_start_command_knows_when_that_matters():
    from eagle3_assets.start import EVALUATED

    with pytest.raises(SettingsError, match=r"^eval_prompts: not set, but `prompts` is: drafter_eval serves"):
        Settings(prompts="/data/prompts.jsonl").check_evaluable()
    Settings(prompts="/data/prompts.jsonl", eval_prompts="/data/heldout.jsonl").check_evaluable()
    Settings().check_evaluable()  # the demo brings its own held-out prompts
    # not --through drafter
    assert {k.to_user_string() for k in EVALUATED} == {"drafter_eval", "drafter_eval_dflash", "drafter_release"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("drafters: [eagle3, medusa]\n",
         "drafters: Value error, drafter family 'medusa' does not exist; the families are eagle3, dflash"),
        ("drafters: [dflash]\ndflash: {block_size: 3}\n",
         "(top level): Value error, dflash.block_size: 3 mask slots, but drafter_eval serves 7 speculative tokens and "
         "vLLM would draft the slots past the block untrained; set it to at least 7"),
        ("drafters: [eagle3, dflash]\naux_layer_ids: [1, 2, 3]\ndflash: {aux_layer_ids: [1, 4]}\n",
         "(top level): Value error, dflash.aux_layer_ids: layers [4] are not among the stored aux_layer_ids [1, 2, 3]; "
         "the shards hold only those"),
        ("drafters: [eagle3, dflash]\ntraining: {mode: rolling, launch: {nnodes: 2, rdzv_endpoint: 'head:29500'}}\n",
         "(top level): Value error, training.launch.nnodes: 2 nodes with training.mode rolling and drafters ['eagle3', "
         "'dflash']: the families train at once, and their jobs would meet at the one training.launch.rdzv_endpoint "
         "(head:29500); train them on one node each (nnodes: 1), or in mode: offline"),
    ],
)
def test_a_drafter_family_setting_that_cannot_be_trained_or_served_is_refused_naming_the_field(
    tmp_path: Path, config: str, message: str
):
    """Issue 43: refused when the settings load, before any data is built for it."""
    with pytest.raises(SettingsError) as e:
        load_settings(write_config(tmp_path, config))
    assert str(e.value) == f"invalid settings in {tmp_path / 'eagle3.yaml'}:\n  {message}"


def test_both_families_train_in_rolling_mode_on_one_node():
    """Issue 43: one window feeds both families' trainers (each shard released once both consumed it)."""
    settings = Settings(drafters=["eagle3", "dflash"], training=TrainingSettings(mode="rolling"))
    assert settings.training.rolling and settings.drafters == ["eagle3", "dflash"]


def target_of(**config) -> TargetModel:
    shape = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 256,
             "num_attention_heads": 2}  # fmt: skip
    return TargetModel.from_config(shape | config, path="/models/t")


def test_a_mask_token_outside_the_targets_vocabulary_is_refused_naming_the_field():
    settings = Settings(drafters=["eagle3", "dflash"], dflash={"mask_token_id": 300}, draft_vocab_size=128)
    with pytest.raises(SettingsError) as e:
        settings.check_against_target(target_of())
    assert str(e.value) == "dflash.mask_token_id: 300 is outside the target vocabulary (ids 0..255)"
    Settings(dflash={"mask_token_id": 300}, draft_vocab_size=128).check_against_target(target_of())  # not trained


def test_a_quantized_target_is_refused_to_the_hf_backends_naming_the_one_to_use():
    int4 = target_of(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    assert int4.quantization == "compressed-tensors" and target_of().quantization is None
    with pytest.raises(SettingsError) as e:
        Settings(draft_vocab_size=128, generation={"backend": "vllm"}).check_against_target(int4)
    assert str(e.value) == (
        "extraction.backend: hf cannot be trusted to load /models/t, whose weights are quantized (compressed-tensors); "
        "set extraction.backend: vllm"
    )
    with pytest.raises(SettingsError, match=r"^generation.backend, extraction.backend: .* set generation.backend: vllm "
                                            r"and extraction.backend: vllm$"):  # fmt: skip
        Settings(draft_vocab_size=128).check_against_target(int4)
    Settings(draft_vocab_size=128, generation={"backend": "vllm"}, extraction={"backend": "vllm"}).check_against_target(int4)


def test_a_target_vllm_serves_no_drafter_beside_is_refused_naming_its_architecture():
    with pytest.raises(SettingsError) as e:
        Settings(draft_vocab_size=128).check_against_target(target_of(architectures=["MambaForCausalLM"]))
    assert str(e.value) == (
        "drafters: vLLM serves no eagle3 drafter beside MambaForCausalLM (/models/t/config.json): it serves one beside "
        "the 80 architectures whose model gives a drafter the target's hidden states (SupportsEagle3), e.g. "
        "LlamaForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration "
        "(eagle3_assets/families.py lists them)"
    )
    for architecture in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "Qwen3MoeForCausalLM"):
        Settings(draft_vocab_size=128, drafters=["eagle3", "dflash"]).check_against_target(
            target_of(architectures=[architecture])
        )
