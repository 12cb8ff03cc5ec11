"""The drafter families' specs (`eagle3_assets/families.py`) against the registry made from them: every spec's assets,
pools and record directories are in the code location, and a stand-in third family declared only by its spec gets
all of them with no other edit."""

import subprocess
import sys
from dataclasses import replace

import pytest
from dagster import AssetKey

from eagle3_assets.artifacts import ARTIFACTS, family_artifacts
from eagle3_assets.families import DFLASH, EAGLE3, FAMILIES, FamilySpec, by_rule, family_spec
from eagle3_assets.project import Project
from eagle3_assets.settings import Settings, SettingsError, TrainingSettings, parse_settings
from eagle3_assets.shard_window import window_dir
from eagle3_assets.storage import ArtifactStore
from eagle3_assets_tests.conftest import tiny_settings
from eagle3_assets_tests.helpers import REPO

ROLLING = TrainingSettings(mode="rolling", batch_tokens=512, warmup_steps=2, epochs=1.0, heldout_rows=4)


def family_entries(settings: Settings, tmp_path) -> dict[str, dict]:
    """Per family the settings train: its assets' deps and pools, as the code location defines them."""
    from eagle3_assets.definitions import build_definitions

    graph = build_definitions(Project(settings, ArtifactStore(str(tmp_path / "store")))).resolve_asset_graph()
    keys = graph.get_all_asset_keys()
    out = {}
    for spec in map(family_spec, settings.drafters):
        drafter, evaluation = AssetKey(spec.drafter_asset), AssetKey(spec.eval_asset)
        assert {drafter, evaluation} <= keys, spec.name
        out[spec.name] = {
            "eval_deps": graph.get(evaluation).parent_keys,
            "pool": graph.get(drafter).pools,
            "released_after": evaluation in graph.get(AssetKey("drafter_release")).parent_keys,
            "records": (ARTIFACTS[spec.drafter_asset].record_dir, ARTIFACTS[spec.eval_asset].record_dir),
            "code_version": graph.get(drafter).code_version is not None,
        }
    return out


def test_every_spec_has_its_assets_pool_and_records_in_the_code_location(tmp_path):
    settings = tiny_settings(drafters=list(FAMILIES), training=ROLLING)
    assert family_entries(settings, tmp_path) == {
        "eagle3": {
            "eval_deps": {AssetKey("drafter")}, "pool": {"trainer"}, "released_after": True,
            "records": ("drafter", "drafter_eval"), "code_version": True,
        },
        "dflash": {
            "eval_deps": {AssetKey("drafter_dflash")}, "pool": {"trainer_dflash"}, "released_after": True,
            "records": ("families/dflash/drafter", "families/dflash/drafter_eval"), "code_version": True,
        },
    }  # fmt: skip
    # What was made before there were specs stays where it is.
    assert (window_dir(EAGLE3.name), window_dir(DFLASH.name)) == ("drafter/window", "families/dflash/drafter/window")
    assert DFLASH == by_rule("dflash", DFLASH.description, recipe_fields=("lr", "epochs", "weight_decay"))


def test_a_third_family_declared_by_its_spec_alone_gets_its_entries(tmp_path, monkeypatch):
    # A stand-in reading only the shared training settings: a real family also adds its section to `Settings`.
    medusa = replace(by_rule("medusa", "A stand-in family"), settings_section="training")
    with pytest.raises(SettingsError, match="drafter family 'medusa' does not exist; the families are eagle3, dflash"):
        parse_settings({"drafters": ["eagle3", "medusa"]})
    monkeypatch.setitem(FAMILIES, medusa.name, medusa)
    for artifact in family_artifacts(medusa):  # what `ARTIFACTS` makes of every spec as it is imported
        monkeypatch.setitem(ARTIFACTS, artifact.name, artifact)

    settings = tiny_settings(drafters=["eagle3", "medusa"], training=ROLLING)
    assert family_entries(settings, tmp_path)["medusa"] == {
        "eval_deps": {AssetKey("drafter_medusa")}, "pool": {"trainer_medusa"}, "released_after": True,
        "records": ("families/medusa/drafter", "families/medusa/drafter_eval"), "code_version": True,
    }  # fmt: skip
    assert window_dir("medusa") == "families/medusa/drafter/window"
    # It reads what EAGLE-3 reads, less EAGLE-3's own recipe.
    eagle3_reads = ARTIFACTS["drafter"].reads(settings)
    assert ARTIFACTS["drafter_medusa"].reads(settings) == tuple(
        f for f in eagle3_reads if f.removeprefix("training.") not in EAGLE3.training_fields
    )


def test_both_families_are_served_beside_the_targets_vllm_gives_aux_hidden_states():
    for spec in FAMILIES.values():
        assert isinstance(spec, FamilySpec)
        # The demo's target, the GGUF test target (SmolLM2) and the families DESIGN §6 and §8 checked.
        assert {
            "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "GptOssForCausalLM", "MiniMaxM2ForCausalLM",
        } <= spec.target_architectures  # fmt: skip
        # vLLM 0.32 has no aux hidden states for these: no EAGLE-3 or DFlash drafter serves beside them.
        assert not {"GPT2LMHeadModel", "Gemma2ForCausalLM", "MixtralForCausalLM"} & spec.target_architectures


def test_the_specs_and_settings_load_without_torch_or_dagster():
    # `--plan`, settings checks and the registry read them: neither torch nor Dagster may come with them.
    code = (
        "import sys, eagle3_assets.families, eagle3_assets.settings, eagle3_assets.artifacts\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'dagster'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout == "[]\n"
