"""The asset graph through Dagster, in process, on a tiny demo configuration."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dagster import AssetKey, DagsterInstance, Definitions
from dagster._core.test_utils import instance_for_test
from safetensors.numpy import load as st_load

from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.definitions import build_definitions
from eagle3_assets.drafter.checkpoint import list_checkpoints
from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, PROMPTS_FILE, parse_prompts
from eagle3_assets.responses import read_responses
from eagle3_assets.training_settings import LaunchSettings, TrainingSettings
from eagle3_assets.shard_window import read_consumed
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VOCAB_MAP_FILE
from eagle3_assets_tests.conftest import TINY_DEMO, tiny_settings

pytestmark = pytest.mark.slow  # runs the data graph on a generating model

DATA_ASSETS = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]


def seed_demo_target(store: ArtifactStore, target_dir: Path) -> None:
    """Put the session's tiny target where the `target_model` asset caches the demo build."""
    store.put_dir(target_dir, DEMO_MODEL_DIR)
    store.write_json(DEMO_MODEL_SETTINGS, TINY_DEMO.model_dump())


def run(defs: Definitions, instance: DagsterInstance, keys: list[str], partition: str | None = None):
    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition, raise_on_error=False
    )


def latest_metadata(instance: DagsterInstance, key: str) -> dict:
    event = instance.get_latest_materialization_event(AssetKey(key))
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("pipeline") / "store"
    project = Project(tiny_settings(), ArtifactStore(root))
    seed_demo_target(project.store, tiny_target_dir)
    defs = build_definitions(project)
    with instance_for_test() as instance:
        result = run(defs, instance, DATA_ASSETS)
        assert result.success
        yield project, defs, instance


def test_the_five_assets_materialize_with_metadata(pipeline):
    project, _, instance = pipeline
    store = project.store
    assert len(store.read_text(PROMPTS_FILE).splitlines()) == 45
    records = read_responses(store)
    assert [r["row"] for r in records] == list(range(45))
    assert len({r["id"] for r in records}) == 45
    tset = TokenizedSet.load(store)
    assert tset.num_rows == 45 and tset.loss_mask.sum() > 0
    vmap = st_load(store.read_bytes(VOCAB_MAP_FILE))
    assert vmap["d2t"].shape == (64,) and vmap["t2d"].shape == (320,)
    assert np.array_equal(np.flatnonzero(vmap["t2d"]), vmap["d2t"] + np.arange(64))

    assert latest_metadata(instance, "prompts")["rows"] == 45
    assert latest_metadata(instance, "target_model")["source"] == "cached (demo)"
    assert latest_metadata(instance, "target_model")["num_layers"] == 4
    resp = latest_metadata(instance, "responses")
    assert (resp["rows"], resp["rows_failed"], resp["rows_generated"]) == (45, 0, 45)
    assert resp["modes"] == {"{}": 45}  # no chat-template kwargs: every row rendered with the template's defaults
    tok = latest_metadata(instance, "tokenized")
    assert (tok["rows"], tok["shards"], tok["tokens"]) == (45, 3, tset.num_tokens)
    assert latest_metadata(instance, "vocab_map")["draft_vocab_size"] == 64
    check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [__import__("dagster").AssetCheckKey(AssetKey("vocab_map"), "vocab_map_invariant")]
    )
    assert list(check.values())[0].status.value == "SUCCEEDED"


def test_tokenized_registers_shard_keys_matching_the_row_count(pipeline):
    _, _, instance = pipeline
    assert sorted(instance.get_dynamic_partitions("hidden_state_shards")) == ["rows_0-20", "rows_20-40", "rows_40-45"]


def test_appended_prompts_in_rolling_mode_land_in_new_shards_and_a_shard_size_change_is_said_and_cleaned(tmp_path, tiny_target_dir):
    """Issue 44, item 6: in rolling mode (rows shuffled) appending prompts re-extracted every shard; now every shard
    keeps its rows and the new rows land in a new shard, which the asset names. A `shard_size` change cuts every
    shard again, says so, and removes the directories of the old cut (they held as much as the new ones)."""
    from eagle3_assets.demo.prompts import demo_prompt_sets

    train, held = demo_prompt_sets(TINY_DEMO)
    prompts, heldout = tmp_path / "prompts.jsonl", tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in train[:40]))
    heldout.write_text("".join(json.dumps(p) + "\n" for p in held[:4]))
    rolling = tiny_settings(prompts=str(prompts), eval_prompts=str(heldout)).training.model_copy(update={"mode": "rolling"})
    settings = tiny_settings(prompts=str(prompts), eval_prompts=str(heldout), training=rolling)
    store = ArtifactStore(tmp_path / "store")
    seed_demo_target(store, tiny_target_dir)
    keys = ["prompts", "target_model", "responses", "tokenized"]

    def shard_rows() -> dict[str, str]:
        return json.loads((tmp_path / "store" / "tokenized" / "_PROVENANCE.json").read_text())["extra"]["shard_rows"]

    with instance_for_test() as instance:
        assert run(build_definitions(Project(settings, store)), instance, keys).success
        first = shard_rows()
        assert list(first) == ["rows_0-20", "rows_20-40"]
        store.write_bytes("hidden_states/rows_0-20/0.safetensors", b"x" * 10)  # as if extracted
        with prompts.open("a") as f:
            f.write("".join(json.dumps(p) + "\n" for p in train[40:45]))
        assert run(build_definitions(Project(settings, store)), instance, keys).success
        assert {k: shard_rows()[k] for k in first} == first and list(shard_rows()) == [*first, "rows_40-45"]
        meta = latest_metadata(instance, "tokenized")
        assert (meta["shards_to_extract"], meta["rows_kept_in_place"], meta["replanned"]) == (1, 40, "no")
        assert store.exists("hidden_states/rows_0-20/0.safetensors")

        smaller = settings.model_copy(update={"shard_size": 15})
        assert run(build_definitions(Project(smaller, store)), instance, ["tokenized"]).success
        meta = latest_metadata(instance, "tokenized")
        assert meta["replanned"] == "setting shard_size: 20 -> 15: every row is placed again and every shard is cut again"
        assert (meta["shards_to_extract"], meta["stale_shard_dirs_removed"], meta["stale_shard_bytes_removed"]) == (3, 1, 10)
        assert store.listdir("hidden_states") == []
        assert registered_shard_keys(instance) == ["rows_0-15", "rows_15-30", "rows_30-45"]


def test_one_shard_materializes_and_passes_its_check(pipeline):
    project, defs, instance = pipeline
    result = run(defs, instance, ["hidden_states"], "rows_40-45")
    assert result.success
    assert project.store.listdir("hidden_states/rows_40-45") == [
        "40.safetensors", "41.safetensors", "42.safetensors", "43.safetensors", "44.safetensors", "_CHECK.json",
        "_PROVENANCE.json", "_SUCCESS.json",
    ]  # the check's verdict is recorded beside the manifest it judged (shard_window.py), and what made it
    assert project.store.read_json("hidden_states/rows_40-45/_CHECK.json")["passed"] is True
    checks = [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert [(c.event_specific_data.check_name, c.event_specific_data.passed) for c in checks] == [
        ("shard_integrity", True)
    ]
    meta = latest_metadata(instance, "hidden_states")
    assert (meta["rows_total"], meta["rows_computed"]) == (5, 5)
    assert meta["samples_done"] == 5 and meta["bytes"] > 0
    observations = instance.fetch_observations(AssetKey("hidden_states"), limit=100).records
    assert observations, "progress observations were recorded"


def test_vocab_map_rematerializes_alone(pipeline):
    project, defs, instance = pipeline
    before = project.store.read_bytes(VOCAB_MAP_FILE)
    assert run(defs, instance, ["vocab_map"]).success
    assert project.store.read_bytes(VOCAB_MAP_FILE) == before


def test_bad_prompt_file_fails_naming_the_line_and_keeps_the_earlier_copy(pipeline, tmp_path):
    project, _, instance = pipeline
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": ""}\n')
    broken = Project(project.settings.model_copy(update={"prompts": str(bad)}), project.store)
    before = project.store.read_text(PROMPTS_FILE)
    result = run(build_definitions(broken), instance, ["prompts"])
    assert not result.success
    failure = result.failure_data_for_node("prompts")
    assert f"{bad}:2 (id b): empty prompt" in failure.error.message
    assert project.store.read_text(PROMPTS_FILE) == before


def test_held_out_prompts_that_are_training_prompts_are_refused_naming_them(pipeline, tmp_path):
    """A drafter judged on rows it trained on is judged too kindly (issue 44, item 5): refused where the prompts load."""
    project, _, instance = pipeline
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    held.write_text('{"id": "h1", "prompt": "new"}\n{"id": "h2", "prompt": "two"}\n')
    before = project.store.read_text(PROMPTS_FILE)
    settings = project.settings.model_copy(update={"prompts": str(train), "eval_prompts": str(held)})
    result = run(build_definitions(Project(settings, project.store)), instance, ["prompts"])
    assert not result.success
    assert (
        f"eval_prompts: 1 held-out prompt(s) are training prompts too (the same id or the same messages): h2 ({held}:2); "
        "drafter_eval would judge the drafter on rows it trained on. Remove them from one of the two files"
    ) in result.failure_data_for_node("prompts").error.message
    assert project.store.read_text(PROMPTS_FILE) == before


def test_the_demo_prompts_are_judged_on_held_out_prompts_of_ones_own(pipeline, tmp_path):
    """`eval_prompts` beside the demo's training prompts is what drafter_eval serves, not the demo's held-out set."""
    project, _, instance = pipeline
    held = tmp_path / "held.jsonl"
    held.write_text('{"id": "h1", "prompt": "What is 2 + 3?"}\n')
    assert project.settings.prompts is None
    store = ArtifactStore(tmp_path / "store")
    settings = project.settings.model_copy(update={"eval_prompts": str(held)})
    assert run(build_definitions(Project(settings, store)), instance, ["prompts"]).success
    assert [p.id for p in parse_prompts(store.read_text(EVAL_PROMPTS_FILE), EVAL_PROMPTS_FILE)] == ["h1"]
    assert store.read_text(PROMPTS_FILE) == project.store.read_text(PROMPTS_FILE)


def test_unreadable_model_path_fails_naming_it(pipeline, tmp_path):
    project, _, instance = pipeline
    broken = Project(project.settings.model_copy(update={"target_model": str(tmp_path / "no-model")}), project.store)
    result = run(build_definitions(broken), instance, ["target_model"])
    assert not result.success
    assert f"target model path {tmp_path / 'no-model'} is not a readable directory" in (
        result.failure_data_for_node("target_model").error.message
    )


def test_definitions_load_from_the_environment_and_bad_settings_fail_at_load(tmp_path):
    env = {**os.environ, "EAGLE3_ROOT": str(tmp_path / "root"), "DAGSTER_HOME": str(tmp_path)}
    env.pop("EAGLE3_CONFIG", None)
    code = "from eagle3_assets.definitions import defs; print(sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == sorted(
        DATA_ASSETS + ["hidden_states", "drafter", "drafter_eval", "drafter_dflash", "drafter_eval_dflash", "drafter_release"]
    )  # the demo trains both drafter families

    (tmp_path / "bad.yaml").write_text("draft_vocab_size: 0\naux_layer_ids: [3, 3, 4]\n")
    env["EAGLE3_CONFIG"] = str(tmp_path / "bad.yaml")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "draft_vocab_size: Input should be greater than or equal to 1" in proc.stderr
    assert "aux_layer_ids: Value error, layer id 3 appears twice in [3, 3, 4]" in proc.stderr


def test_verify_shards_rechecks_without_extracting_and_the_drafter_refuses_bad_shards(pipeline):
    project, defs, instance = pipeline
    assert run(defs, instance, ["hidden_states"], "rows_40-45").success
    path = project.store.local_path("hidden_states/rows_40-45/42.safetensors")
    path.write_bytes(path.read_bytes()[:-100])  # truncated after the fact

    result = defs.resolve_job_def("verify_shards").execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    evaluations = {
        e.event_specific_data.partition: e.event_specific_data.passed
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
    # rows_0-20 and rows_20-40 were never extracted; rows_40-45 now has a truncated file
    assert evaluations == {"rows_0-20": False, "rows_20-40": False, "rows_40-45": False}
    message = result.failure_data_for_node("verify_all_shards").error.message
    assert "3 of 3 shards failed the integrity check" in message

    refused = run(defs, instance, ["drafter"])
    assert not refused.success
    message = refused.failure_data_for_node("drafter").error.message
    assert "drafter refuses to train: 3 of 3 shards are not usable" in message
    assert "rows_0-20: missing or incomplete (no _SUCCESS.json)" in message
    assert "rows_40-45: integrity check failed" in message

    # rematerializing repairs the truncated file (one row recomputed) and the check passes again
    assert run(defs, instance, ["hidden_states"], "rows_40-45").success
    assert latest_metadata(instance, "hidden_states")["rows_computed"] == 1

    # With every shard sound, the job succeeds (a green run, no failure alert) and says so.
    for key in ("rows_0-20", "rows_20-40"):
        assert run(defs, instance, ["hidden_states"], key).success
    healthy = defs.resolve_job_def("verify_shards").execute_in_process(instance=instance, raise_on_error=False)
    assert healthy.success
    assert {e.event_specific_data.partition: e.event_specific_data.passed
            for e in healthy.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"} == dict.fromkeys(
        ["rows_0-20", "rows_20-40", "rows_40-45"], True)  # fmt: skip
    output = next(e for e in healthy.all_events if e.event_type_value == "STEP_OUTPUT")
    assert {k: v.value for k, v in output.event_specific_data.metadata.items()} == {"shards": 3, "rows": 45, "released": 0}


def test_a_target_without_a_chat_template_fails_naming_it(pipeline, tmp_path):
    project, _, instance = pipeline
    model = tmp_path / "no-template"
    shutil.copytree(project.store.local_path(DEMO_MODEL_DIR), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    broken = Project(project.settings.model_copy(update={"target_model": str(model)}), project.store)
    result = run(build_definitions(broken), instance, ["target_model"])
    assert not result.success
    assert f"{model}: the tokenizer has no chat template" in result.failure_data_for_node("target_model").error.message


def test_rolling_mode_trains_shards_as_they_land_in_any_order_a_person_tries(pipeline, tmp_path):
    """Rolling mode by hand, W = 2 over three shards: a shard past the window is refused, the drafter
    trains what has landed and fails retryably waiting for the rest, released shards read as released."""
    project, _, _ = pipeline
    root = tmp_path / "store"
    shutil.copytree(project.store.local_path(""), root, ignore=shutil.ignore_patterns("hidden_states", "drafter"))
    training = TrainingSettings(
        mode="rolling", window_shards=2, shard_wait_s=1, batch_tokens=512, warmup_steps=2, checkpoint_every=5,
        heldout_rows=4,
    )  # fmt: skip
    rolling = Project(tiny_settings(shard_size=15, training=training), ArtifactStore(root))
    defs = build_definitions(rolling)
    with instance_for_test() as instance:
        assert run(defs, instance, ["tokenized", "token_freq", "vocab_map"]).success
        keys = registered_shard_keys(instance)
        assert keys == ["rows_0-15", "rows_15-30", "rows_30-45"]
        assert latest_metadata(instance, "tokenized")["row_order"] == "shuffled (seed 0)"
        for key in keys[:2]:
            assert run(defs, instance, ["hidden_states"], key).success

        ahead = run(defs, instance, ["hidden_states"], keys[2])
        assert not ahead.success
        assert (
            "Failure: shard rows_30-45 is outside the rolling window: training.window_shards=2 shards may be on disk ahead "
            "of training, and the window now holds ['rows_0-15', 'rows_15-30']"
        ) in ahead.failure_data_for_node("hidden_states").error.message

        waited = run(defs, instance, ["drafter"])
        assert not waited.success
        assert "shard rows_30-45 (#3 of 3) has not passed its integrity check" in (
            waited.failure_data_for_node("drafter").error.message
        )
        consumed = read_consumed(rolling.store)
        assert sorted(consumed) == keys[:2] and all(c.released for c in consumed.values())
        assert not list((root / "hidden_states" / keys[0]).glob("*.safetensors"))
        observed = instance.fetch_observations(AssetKey("hidden_states"), limit=100, ascending=True).records
        states = [(r.partition_key, o.metadata["state"].value) for r in observed if "state" in (o := r.asset_observation).metadata]
        # As the run starts, then as it ends (between, every `WindowReporter.every_s` while training runs).
        assert states[:3] == [("rows_0-15", "training"), ("rows_15-30", "checked"), ("rows_30-45", "missing")]
        assert dict(states) == {"rows_0-15": "released", "rows_15-30": "released", "rows_30-45": "missing"}
        # A shard extraction has not reached yet is not a bad one: no verdict recorded, the job green.
        pending = defs.resolve_job_def("verify_shards").execute_in_process(instance=instance, raise_on_error=False)
        assert pending.success
        judged = {e.event_specific_data.partition for e in pending.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
        assert judged == {keys[0], keys[1]}
        output = next(e for e in pending.all_events if e.event_type_value == "STEP_OUTPUT")
        assert {k: v.value for k, v in output.event_specific_data.metadata.items()} == {
            "shards": 0, "rows": 0, "released": 2, "not_extracted_yet": "rows_30-45",
        }  # fmt: skip

        # A consumed shard is never extracted again; verify_shards reports it released, not bad.
        again = run(defs, instance, ["hidden_states"], keys[0])
        assert "shard rows_0-15 was trained (consumed at step" in again.failure_data_for_node("hidden_states").error.message
        assert run(defs, instance, ["hidden_states"], keys[2]).success  # the window has room now
        sample = next((root / "hidden_states" / keys[2]).glob("*.safetensors"))
        sample.write_bytes(sample.read_bytes()[:-100])  # damaged after its check passed
        verified = defs.resolve_job_def("verify_shards").execute_in_process(instance=instance, raise_on_error=False)
        assert not verified.success
        checks = {
            e.event_specific_data.partition: e.event_specific_data.metadata["state"].value
            for e in verified.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION" and "state" in e.event_specific_data.metadata
        }
        assert checks == {keys[0]: "released", keys[1]: "released"}
        assert "1 of 1 shards failed the integrity check" in verified.failure_data_for_node("verify_all_shards").error.message

        refused = run(defs, instance, ["drafter"])  # never skips the bad shard: refuses before training
        assert "shard rows_30-45, the next in training order, failed its integrity check" in (
            refused.failure_data_for_node("drafter").error.message
        )
        assert run(defs, instance, ["hidden_states"], keys[2]).success  # repaired: one row recomputed

        done = run(defs, instance, ["drafter"])
        assert done.success
        meta = latest_metadata(instance, "drafter")
        assert meta["step"] == meta["total_steps"] and meta["resumed_from"] > 0
        progress = instance.fetch_observations(AssetKey("drafter"), limit=1).records[0].asset_observation.metadata
        assert {k: progress[k].value for k in ("shards_total", "shards_consumed", "shards_on_disk")} == {
            "shards_total": 3, "shards_consumed": 3, "shards_on_disk": 0,
        }  # fmt: skip
        assert read_consumed(rolling.store)[keys[2]].step == meta["step"]
        assert rolling.store.exists("drafter/export/config.json")


def test_drafter_trains_on_two_ranks_and_a_killed_rank_fails_the_run_which_resumes(pipeline, monkeypatch):
    """The asset launches torchrun with 2 gloo ranks; rank 1 SIGKILLed at step 3 fails the run naming it;
    the gpu slot is free again and the rerun continues from the step-2 checkpoint to an export, with rank 0's
    logs, progress observations and figures in Dagster."""
    project, _, instance = pipeline
    for key in ("rows_0-20", "rows_20-40", "rows_40-45"):
        assert run(build_definitions(project), instance, ["hidden_states"], key).success
    store = project.store
    store.remove("drafter", recursive=True)
    training = project.settings.training.model_copy(
        update={"device": "cpu", "steps": 10, "checkpoint_every": 2, "launch": LaunchSettings(nproc_per_node=2)}
    )
    defs = build_definitions(Project(project.settings.model_copy(update={"training": training}), store))
    instance.event_log_storage.set_concurrency_slots("gpu", 1)

    monkeypatch.setenv("EAGLE3_CRASH_AT", "rank1:step:3")
    killed = run(defs, instance, ["drafter"])
    assert not killed.success
    error = killed.failure_data_for_node("drafter").error
    assert "training rank 1 (local rank 1 on " in error.message
    assert "was killed by SIGKILL; its last log line: drafter: rank 1 of 2 (local rank 1) started" in error.message
    assert list_checkpoints(store) == [2]
    assert instance.event_log_storage.get_concurrency_run_ids() == set()  # the gpu slot went with the run

    monkeypatch.delenv("EAGLE3_CRASH_AT")
    resumed = run(defs, instance, ["drafter"])
    assert resumed.success
    meta = latest_metadata(instance, "drafter")
    assert (meta["step"], meta["total_steps"], meta["resumed_from"]) == (10, 10, 2)
    assert meta["aux_layer_ids"] == [1, 2, 3]
    assert meta["export"] == store.url_of("drafter/export")
    assert store.read_json("drafter/checkpoints/step_10/state.json")["run"]["world_size"] == 2
    logs = [e.message for e in instance.all_logs(resumed.run_id) if e.user_message]
    assert any("drafter: resuming from drafter/checkpoints/step_2 (step 2 of 10" in m for m in logs)
    observed = [o.asset_observation.metadata for o in instance.fetch_observations(AssetKey("drafter"), limit=10).records]
    progress = [m for m in observed if "loss" in m]
    assert [m["step"].value for m in progress] == [10]  # one every 10 steps, from rank 0
    assert progress[0]["loss"].value > 0
    # And one per held-out evaluation (at the last step here): the acceptance estimate the UI plots.
    evaluations = [m for m in observed if "heldout_accept_len_k3" in m]
    assert [m["step"].value for m in evaluations] == [10] and evaluations[0]["heldout_accept_len_k3"].value >= 1.0


def test_release_baseline_serves_nothing_where_the_release_was_made_here(pipeline, tmp_path):
    """The asset as Dagster runs it (its serving with vLLM: test_drafter_eval_beside.py): with a release this store
    promoted, `start_from` installs nothing and no vLLM engine starts; each reason is said."""
    from eagle3_assets.drafter.release import RELEASE_DIR
    from eagle3_assets.release_record import ReleaseRecord, read_release_record

    from .helpers import gpu_instance

    project, _, _ = pipeline
    root = tmp_path / "store"
    shutil.copytree(project.store.local_path(""), root, ignore=shutil.ignore_patterns("hidden_states", "drafter"))
    (root / RELEASE_DIR).mkdir(parents=True)
    ReleaseRecord(reason="first release: k=3 2.000, k=7 2.400").write(root / RELEASE_DIR)
    started = Project(tiny_settings(start_from={"drafter": str(tmp_path / "published")}), ArtifactStore(root))
    with gpu_instance() as instance:
        result = run(build_definitions(started), instance, ["release_baseline"])
        assert result.success
        meta = latest_metadata(instance, "release_baseline")
        logs = [e.message for e in instance.all_logs(result.run_id) if e.user_message]
    assert (meta["served"], meta["outputs_match_greedy"]) == (False, True)
    assert meta["reason"] == (
        "the release is no import (first release: k=3 2.000, k=7 2.400): every drafter_eval serves it beside its own "
        "export"
    )
    assert any(m.startswith(f"start_from: a drafter is released at file://{root / RELEASE_DIR} already (first release")
               for m in logs), logs  # fmt: skip
    assert read_release_record(ArtifactStore(root)).released_on.acceptance == {}  # untouched


def test_start_from_makes_the_first_drafter_a_continuation_of_the_published_one(pipeline, tmp_path):
    """Issue 53: with `start_from` set and nothing released, `vocab_map` installs the published drafter as the
    release and adopts its own map (48 draft ids, not draft_vocab_size's 64; its invariant check holds it to that
    size), and the drafter asset's plan continues it on every shard (the training itself:
    test_drafter_import_continue.py)."""
    import torch

    from eagle3_assets.drafter.export import export_drafter
    from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_assets.release_record import IMPORTED, RELEASE_RECORD
    from eagle3_assets.drafter.run import run_plan
    from eagle3_assets.families import EAGLE3
    from eagle3_assets.vocab_map import VocabMap
    from eagle3_assets_tests.helpers import random_vocab_map

    project, _, _ = pipeline
    target = project.target()
    norms = dict.fromkeys(("norm_before_fc", "norm_before_residual", "norm_output"), True)  # the settings' defaults
    published = random_vocab_map(vocab=target.vocab_size, draft=48, seed=3)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=48, **norms)
    drafter = Eagle3Drafter(cfg, published.d2t, published.t2d)
    url = export_drafter(ArtifactStore(tmp_path / "published"), drafter.trainable_state_dict(), cfg, aux_layer_ids=[1, 2, 3])
    root = tmp_path / "store"
    shutil.copytree(project.store.local_path(""), root, ignore=shutil.ignore_patterns("hidden_states", "drafter"))
    started = Project(tiny_settings(start_from={"drafter": url}), ArtifactStore(root))
    with instance_for_test() as instance:
        assert run(build_definitions(started), instance, ["vocab_map"]).success
        assert latest_metadata(instance, "vocab_map")["map"].startswith(
            f"adopted the imported release's own map ({url}): its 48 draft ids cover "
        )
    release = started.store.read_json(RELEASE_RECORD)
    assert release[IMPORTED]["source"] == url
    vmap = VocabMap.load(started.store)
    assert np.array_equal(vmap.d2t, published.d2t) and np.array_equal(vmap.t2d, published.t2d)
    keys = ["rows_0-20", "rows_20-40", "rows_40-45"]
    plan = run_plan(started.store, target, started.settings, keys, EAGLE3)[2]
    assert (plan.continues, plan.release_sha256, plan.old_shards, plan.new_shards) == (
        True, release["export_sha256"], [], keys
    )  # fmt: skip
    assert plan.imported == {k: release[IMPORTED][k] for k in ("source", "format", "sha256")}
