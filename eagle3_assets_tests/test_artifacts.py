"""The asset registry (`artifacts.py`) against the assets themselves (issue 42): each asset's parents against its
Dagster deps, and every setting an asset reads against its provenance. Each check is shown failing when one
entry is left out. The reads are recorded for the data assets and a shard, which run here in-process; the drafter
trains in torchrun ranks and drafter_eval serves in vLLM, beyond a recording settings object."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from dagster import AssetKey, Definitions
from pydantic import BaseModel

from eagle3_assets.artifacts import ARTIFACTS, Artifact
from eagle3_assets.definitions import build_definitions
from eagle3_assets.families import EAGLE3
from eagle3_assets.project import Project
from eagle3_assets.provenance import Inputs, expected
from eagle3_assets.settings import VllmSettings
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings
from .helpers import gpu_instance

# Settings properties, and the fields of their section they read.
PROPERTIES = {"is_demo": ("target_model",), "extraction_urls": ("server_url", "server_urls"), "rolling": ("mode",)}
DATA = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]


def parents_apart_from_deps(defs: Definitions, artifacts: Mapping[str, Artifact], settings=None) -> list[str]:
    """Where an asset's parents and its Dagster deps differ with no reason given, or a reason names no difference."""
    graph, problems = defs.resolve_asset_graph(), []
    for key in graph.toposorted_asset_keys:
        artifact = artifacts[key.to_user_string()]
        deps = {k.to_user_string() for k in graph.get(key).parent_keys}
        parents = artifact.parents_under(settings or tiny_settings())
        reasons = artifact.deps_apart_under(settings or tiny_settings())
        apart = set(parents) ^ deps
        for name in sorted(apart - set(reasons)):
            where = "a parent" if name in parents else "a Dagster dep"
            problems.append(f"{artifact.name}: {name} is {where} only, and no reason is given")
        for name in sorted(set(reasons) - apart):
            problems.append(f"{artifact.name}: a reason is given for {name}, but parents and deps agree on it")
    return problems


def test_each_assets_parents_are_its_dagster_deps_but_where_a_reason_is_named(tmp_path):
    defs = build_definitions(Project(tiny_settings(), ArtifactStore(tmp_path)))
    assert parents_apart_from_deps(defs, ARTIFACTS) == []
    left_out = {**ARTIFACTS, "vocab_map": replace(ARTIFACTS["vocab_map"], parents=())}
    assert parents_apart_from_deps(defs, left_out) == ["vocab_map: token_freq is a Dagster dep only, and no reason is given"]
    added = {**ARTIFACTS, "prompts": replace(ARTIFACTS["prompts"], parents=("target_model",))}
    assert parents_apart_from_deps(defs, added) == ["prompts: target_model is a parent only, and no reason is given"]


class Recording:
    """Settings that note every field read through them, by dotted name (a section hands out a recording of itself)."""

    def __init__(self, model: BaseModel, seen: set[str], path: str = ""):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        if name.startswith("_") or name.startswith("model_") or (callable(value) and not isinstance(value, BaseModel)):
            return value
        if isinstance(value, BaseModel):
            return Recording(value, self._seen, f"{self._path}{name}.")
        self._seen.update(f"{self._path}{f}" for f in PROPERTIES.get(name, (name,)))
        return value


def provenance_fields(artifact: Artifact, settings, artifacts: Mapping[str, Artifact]) -> set[str]:
    """The fields in `artifact`'s provenance and its ancestors' (their change reaches it as a new input version),
    and those `reads` consults to choose them."""
    fields: set[str] = set()
    todo, seen = [artifact.name], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            fields |= set(artifacts[name].reads(Recording(settings, fields)))  # the consulted ones land in `fields`
            todo += artifacts[name].parents_under(settings)
    return fields


def unrecorded(artifact: Artifact, settings, read: set[str], artifacts: Mapping[str, Artifact] = ARTIFACTS) -> list[str]:
    """The fields an asset read that neither its provenance (nor its ancestors') nor its `runs_with` names."""
    declared = provenance_fields(artifact, settings, {**artifacts, artifact.name: artifact}) | set(artifact.runs_with)
    return sorted(f for f in read if not any(f == d or f.startswith(f"{d}.") for d in declared))


@pytest.fixture(scope="module")
def reads(tmp_path_factory, tiny_target_dir) -> dict[str, set[str]]:
    """Every settings field each data asset and the first shard read as they ran, one run each."""
    seen: set[str] = set()
    settings = tiny_settings()
    project = Project(Recording(settings, seen), ArtifactStore(tmp_path_factory.mktemp("reads")))  # type: ignore[arg-type]
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    out: dict[str, set[str]] = {}
    with gpu_instance() as instance:
        for name, partition in [*((n, None) for n in DATA), ("hidden_states", "rows_0-20")]:
            seen.clear()
            assert job.execute_in_process(instance=instance, asset_selection=[AssetKey(name)], partition_key=partition).success
            out[name] = set(seen)
    return out


@pytest.mark.parametrize("name", [*DATA, "hidden_states"])
def test_every_setting_an_asset_reads_is_in_its_provenance_or_named_as_how_it_runs(reads, name):
    settings = tiny_settings()
    assert unrecorded(ARTIFACTS[name], settings, reads[name]) == []


def test_a_setting_read_but_left_out_of_the_provenance_is_named(reads):
    settings = tiny_settings()
    responses = ARTIFACTS["responses"]
    left_out = replace(responses, reads=lambda s: tuple(f for f in responses.reads(s) if f != "generation.temperature"))
    assert unrecorded(left_out, settings, reads["responses"]) == ["generation.temperature"]


def code_versions(settings, tmp_path) -> dict[str, str]:
    defs = build_definitions(Project(settings, ArtifactStore(tmp_path)))
    graph = defs.resolve_asset_graph()
    return {k.to_user_string(): graph.get(k).code_version for k in graph.get_all_asset_keys() if graph.get(k).code_version}


@pytest.mark.parametrize(
    ("change", "redone"),
    [
        ({"dflash": {"block_size": 8}}, {"drafter_dflash"}),
        ({"dflash": {"num_layers": 2}}, {"drafter_dflash"}),
        ({"training": {"ttt_steps": 5}}, {"drafter"}),
        ({"training": {"norm_output": False}}, {"drafter"}),
        ({"training": {"batch_tokens": 1024}}, {"drafter", "drafter_dflash"}),
        # DFlash's schedule is its own section's (`FamilySpec.recipe_fields`): EAGLE-3's does not reach it.
        ({"training": {"lr": 5e-3}}, {"drafter"}),
        ({"dflash": {"lr": 5e-3}}, {"drafter_dflash"}),
    ],
)
def test_a_familys_own_setting_redoes_that_familys_drafter_alone(tmp_path, change, redone):
    """Issue 43: each family's drafter is its own asset with its own provenance; a shared training setting redoes
    both (what follows them, their evals and the release, follows their new versions); a field a family's section
    holds in place of a training setting (issue 54: DFlash's lr, epochs, weight decay) redoes that family alone."""
    base = tiny_settings().model_dump()
    both = type(tiny_settings()).model_validate({**base, "drafters": ["eagle3", "dflash"]})
    changed = type(both).model_validate(
        {**both.model_dump(), **{k: {**both.model_dump()[k], **v} for k, v in change.items()}}
    )
    before, after = code_versions(both, tmp_path / "a"), code_versions(changed, tmp_path / "b")
    assert {"drafter", "drafter_dflash", "drafter_eval_dflash"} <= set(before)
    assert {k for k in before if before[k] != after.get(k)} == redone


def test_with_both_families_each_assets_parents_are_its_dagster_deps_but_where_a_reason_is_named(tmp_path):
    settings = type(tiny_settings()).model_validate({**tiny_settings().model_dump(), "drafters": ["eagle3", "dflash"]})
    defs = build_definitions(Project(settings, ArtifactStore(tmp_path)))
    assert parents_apart_from_deps(defs, ARTIFACTS, settings) == []


def test_with_start_from_and_traffic_the_baseline_is_served_first_and_every_eval_follows_it(tmp_path):
    """`release_baseline` is in the graph only with `start_from` set; each eval runs after it (it reads its passes)
    without it being an input of the eval's content, as `deps_apart` says."""
    settings = tiny_settings(
        drafters=["eagle3", "dflash"], start_from={"drafter": "/published"}, traffic={"log": "/gateway.jsonl"}
    )
    defs = build_definitions(Project(settings, ArtifactStore(tmp_path)))
    assert parents_apart_from_deps(defs, ARTIFACTS, settings) == []
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get(AssetKey("release_baseline")).parent_keys} == {
        "prompts", "target_model", "traffic_prompts"
    }  # fmt: skip
    for name in ("drafter_eval", "drafter_eval_dflash"):
        assert AssetKey("release_baseline") in graph.get(AssetKey(name)).parent_keys
    unset = build_definitions(Project(tiny_settings(), ArtifactStore(tmp_path))).resolve_asset_graph()
    assert not unset.has(AssetKey("release_baseline"))
    assert [a for a, art in ARTIFACTS.items() if not art.in_graph(tiny_settings())] == ["traffic_prompts", "release_baseline"]


def made_from(asset: str, settings, store: ArtifactStore, partition: str | None = None) -> str:
    return expected(asset, Inputs(settings, store), partition).made_from


def test_vllm_settings_that_change_content_redo_what_a_vllm_engine_made_and_only_that(tmp_path):
    """`vllm.dtype`, `vllm.extra_args` (a quantization flag) and `vllm.max_model_len` shape what a vLLM engine makes
    (issue 44, item 6): each is in the provenance of what one made with them (responses, shards), so a change redoes
    it, and of nothing else. At
    their defaults they are left out, so a store recorded before them stays current."""
    store = ArtifactStore(tmp_path)
    vllm = {
        "generation": tiny_settings().generation.model_copy(update={"backend": "vllm"}),
        "extraction": tiny_settings().extraction.model_copy(update={"backend": "vllm"}),
    }
    base, engine = tiny_settings(), tiny_settings(**vllm)
    fp8 = tiny_settings(**vllm, vllm=VllmSettings(extra_args=["--quantization", "fp8"]))
    f32 = tiny_settings(**vllm, vllm=VllmSettings(dtype="float32"))
    longer = tiny_settings(**vllm, vllm=VllmSettings(max_model_len=4096))
    hf_f32 = tiny_settings(vllm=VllmSettings(dtype="float32", extra_args=["--quantization", "fp8"]))
    for asset, partition in [("responses", None), ("hidden_states", "rows_0-20")]:
        default = made_from(asset, base, store, partition)
        # The defaults leave every record as it was before these were recorded (and one engine as the other).
        assert made_from(asset, engine, store, partition) == default
        assert made_from(asset, fp8, store, partition) != default
        assert made_from(asset, f32, store, partition) != default
    assert made_from("responses", longer, store) != made_from("responses", base, store)
    # Extraction refuses a row past the context, never cuts one: the context changes no shard.
    assert made_from("hidden_states", longer, store, "rows_0-20") == made_from("hidden_states", base, store, "rows_0-20")
    # Generated and extracted by HF, nothing depends on them; drafter_eval starts its engines with settings of its own.
    assert made_from("responses", hf_f32, store) == made_from("responses", base, store)
    assert made_from("hidden_states", hf_f32, store, "rows_0-20") == made_from("hidden_states", base, store, "rows_0-20")
    for asset in ("prompts", "target_model", "tokenized", "token_freq", "vocab_map", "drafter_eval", "drafter_release"):
        assert made_from(asset, fp8, store) == made_from(asset, base, store), asset
    # The redo names the setting.
    before, after = expected("responses", Inputs(engine, store)), expected("responses", Inputs(fp8, store))
    assert before.changes(after) == ['setting vllm.extra_args: (unset) -> ["--quantization", "fp8"]']


def test_extraction_numerics_retrain_the_drafters_resume_no_checkpoint_and_continue_no_release(tmp_path):
    """Issue 52, item 7: `vllm.dtype` and `vllm.extra_args` re-extracted every shard, but the drafters did not read
    them: `--from drafter` resumed the finished checkpoint and a rolling run continued on mixed features. Every
    setting in the shards' reads is now in each drafter's provenance, its run fingerprint and what a continuation
    must share with the release; the generation-only context, and the vLLM settings under HF extraction, are not."""
    from eagle3_assets.drafter.continuation import model_loss_settings
    from eagle3_assets.drafter.run import run_inputs

    store = ArtifactStore(tmp_path)
    both = {"drafters": ["eagle3", "dflash"]}
    engine = {"extraction": tiny_settings().extraction.model_copy(update={"backend": "vllm"}), **both}
    base = tiny_settings(**engine)
    changed = {
        "vllm.extra_args": tiny_settings(**engine, vllm=VllmSettings(extra_args=["--quantization", "fp8"])),
        "vllm.dtype": tiny_settings(**engine, vllm=VllmSettings(dtype="float32")),
    }
    same = [tiny_settings(**both), tiny_settings(**engine, vllm=VllmSettings(max_model_len=4096)),
            tiny_settings(**both, vllm=VllmSettings(dtype="float32", extra_args=["--quantization", "fp8"]))]  # fmt: skip

    def figures(settings) -> tuple[str, str, dict[str, str], dict[str, Any]]:
        want = expected("drafter", Inputs(settings, store))
        return (made_from("drafter", settings, store), made_from("drafter_dflash", settings, store),
                run_inputs(settings, want), model_loss_settings(settings, EAGLE3, {}))  # fmt: skip

    before = figures(base)
    for name, settings in changed.items():
        after = figures(settings)
        assert [a != b for a, b in zip(before, after, strict=True)] == [True] * 4, name
        assert expected("drafter", Inputs(base, store)).changes(expected("drafter", Inputs(settings, store))) == [
            f"setting {name}: (unset) -> {json.dumps(getattr(settings.vllm, name.split('.')[1]))}"
        ]
        assert json.loads(after[2][name]) == getattr(settings.vllm, name.split(".")[1])
    assert all(figures(settings) == before for settings in same)
    # At their defaults, a checkpoint and a release made before stay resumable and continuable.
    assert sorted(before[2]) == ["aux_layer_ids", "extraction.storage_dtype", "shard_size", "target_model", "tokenized",
                                 "vocab_map"]  # fmt: skip
    assert sorted(before[3]) == ["aux_layer_ids", "extraction.storage_dtype", "training"]


class Killed(BaseException):
    """Stands for SIGKILL in this process, between an artifact's write and its record's."""


def test_an_artifact_replaced_before_its_record_is_never_current_under_the_record_it_replaced(tmp_path, monkeypatch):
    """Issue 52, item 12: `prompts` wrote its file, then its record (the drafter its export, then its record): killed
    in between, the old record stayed, and putting the old settings back made the new file look current."""
    from dagster import DagsterInstance, materialize

    from eagle3_assets.defs import provenance as defs_provenance
    from eagle3_assets.defs.data.assets import prompts
    from eagle3_assets.defs.provenance import Staleness
    from eagle3_assets.prompts import PROMPTS_FILE

    from .conftest import TINY_DEMO

    store = ArtifactStore(tmp_path / "store")
    first = Project(tiny_settings(), store)
    other = Project(tiny_settings(demo=TINY_DEMO.model_copy(update={"num_prompts": 30})), store)
    with DagsterInstance.ephemeral() as instance:
        assert materialize([prompts], resources={"project": first}, instance=instance).success
        made_first = store.read_text(PROMPTS_FILE)

        def killed(name: str) -> None:
            if name == "record:prompts":
                raise Killed(name)

        monkeypatch.setattr(defs_provenance, "crash_point", killed)
        with pytest.raises(Killed):
            materialize([prompts], resources={"project": other}, instance=instance)
    assert store.read_text(PROMPTS_FILE) != made_first  # the file of the other settings, its record never written
    assert Staleness(first).problem("prompts") == (
        f"{store.url_of(PROMPTS_FILE)} was being replaced when its last run ended, before its record: made again"
    )
