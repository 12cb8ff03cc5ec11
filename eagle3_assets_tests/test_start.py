"""`python -m eagle3_assets.start`: one command through the graph, killed mid-shard and started again."""

import os
import subprocess
import sys

import pytest
from dagster import AssetKey, AssetRecordsFilter

from .helpers import REPO, Operator

pytestmark = pytest.mark.slow  # the tiny data graph, three shards and a short drafter, in subprocesses

SHARDS = ["rows_0-20", "rows_20-40", "rows_40-45"]


def started(out: str) -> list[str]:
    """The `[start]` lines of a run, without the run ids and timings."""
    return [line.split(" in ")[0].removeprefix("[start] ") for line in out.splitlines() if line.startswith("[start]")]


def test_killed_mid_shard_the_same_command_resumes_and_redoes_nothing(tmp_path, tiny_target_dir):
    op = Operator(tmp_path, tiny_target_dir)
    killed = op.start("--through", "drafter", crash_at="extracted:rows_20-40:3")
    assert killed.returncode == -9
    assert started(killed.stdout)[-3:] == [
        "hidden_states[rows_0-20]: starting", "hidden_states[rows_0-20]: ok", "hidden_states[rows_20-40]: starting",
    ]  # fmt: skip

    listed = op.start("--list-shards")
    assert listed.stdout.splitlines() == ["rows_0-20\tdone", "rows_20-40\tnever materialized", "rows_40-45\tnever materialized"]
    wrong = op.start("--shard", "rows_40-50")
    assert wrong.returncode == 2
    assert "error: unknown shard key(s) rows_40-50; the registered shard keys are: rows_0-20, rows_20-40, rows_40-45" in wrong.stderr

    resumed = op.start("--through", "drafter")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # The daemon's conditions, ticked: the shards the kill left, vocab_map (its inputs are made), then the drafter.
    assert started(resumed.stdout) == [
        "1 run(s) of dead processes failed and their slots freed",
        "hidden_states[rows_20-40]: to run (never materialized)", "hidden_states[rows_40-45]: to run (never materialized)",
        "vocab_map: to run (never materialized)", "vocab_map: starting", "vocab_map: ok",
        "hidden_states[rows_20-40]: starting", "hidden_states[rows_20-40]: ok",
        "hidden_states[rows_40-45]: starting", "hidden_states[rows_40-45]: ok",
        "drafter: to run (never materialized)", "drafter: starting", "drafter: ok",
        "finished",
    ]  # fmt: skip
    # The log carries the figures (the tiny settings report progress every 0.01 s).
    log = resumed.stdout + resumed.stderr
    assert "shard rows_20-40: 20/20 samples (3 kept), " in log
    # Dagster's beta and preview features the project uses on purpose are said once (docs/DESIGN.md §7), not in the
    # output of every command and training run.
    assert "BetaWarning" not in log and "PreviewWarning" not in log
    assert "responses: 45/45 rows, 0 failed" not in log  # responses were finished: not run again
    assert "responses: 45/45 rows, 0 failed, " in killed.stdout + killed.stderr
    with op.instance() as instance:
        computed = {
            r.event_log_entry.asset_materialization.partition: r.event_log_entry.asset_materialization.metadata[
                "rows_computed"
            ].value
            for r in instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("hidden_states")), limit=10).records
        }
        # The killed shard kept the 3 samples written before the kill; each shard had a run of its own.
        assert computed == {"rows_0-20": 20, "rows_20-40": 17, "rows_40-45": 5}
        shard_runs = [r.tags.get("dagster/partition") for r in instance.get_runs() if "dagster/partition" in r.tags]
        assert sorted(shard_runs) == sorted(SHARDS + ["rows_20-40"])

    again = op.start("--through", "drafter")
    assert again.returncode == 0
    assert started(again.stdout) == ["0 run(s) of dead processes failed and their slots freed", "finished"]
    redo = op.start("--through", "drafter", "--from", "vocab_map")
    assert started(redo.stdout) == [
        "0 run(s) of dead processes failed and their slots freed",
        "vocab_map: to run (redo asked (--from))", "vocab_map: starting", "vocab_map: ok",
        "drafter: to run (redo asked (--from))", "drafter: starting", "drafter: ok",
        "finished",
    ]  # fmt: skip


def test_in_rolling_mode_the_one_command_trains_while_the_window_admits_each_shard(tmp_path, tiny_target_dir):
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.shard_window import read_consumed

    training = TrainingSettings(
        mode="rolling", window_shards=1, batch_tokens=512, warmup_steps=2, checkpoint_every=5, heldout_rows=4
    )
    op = Operator(tmp_path, tiny_target_dir, training=training)
    done = op.start("--through", "drafter")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = started(done.stdout)
    # One shard on disk at a time: each is extracted once the drafter has consumed the one before.
    assert [line for line in lines if line.startswith("hidden_states") and "to run" not in line] == [
        f"hidden_states[{k}]: {s}" for k in SHARDS for s in ("starting", "ok")
    ]
    assert lines[-2:] == ["drafter: ok", "finished"]
    consumed = read_consumed(op.project.store)
    assert sorted(consumed) == sorted(SHARDS) and all(c.released for c in consumed.values())
    assert "drafter: shard rows_40-45 consumed at step" in done.stdout + done.stderr


@pytest.mark.vllm
def test_each_phase_shares_one_vllm_server_started_and_stopped_with_the_phase(tmp_path, tiny_target_dir):
    from eagle3_assets.settings import ExtractionSettings, GenerationSettings
    from eagle3_assets.vllm_server.client import port_in_use

    from .helpers import vllm_test_settings

    vllm = vllm_test_settings()
    op = Operator(
        tmp_path, tiny_target_dir, vllm=vllm,
        generation=GenerationSettings(backend="vllm", max_new_tokens=8, rows_per_part=16),
        extraction=ExtractionSettings(backend="vllm", progress_interval_s=0.01),
    )  # fmt: skip
    done = op.start("--through", "hidden_states")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    url = f"http://127.0.0.1:{vllm.port}"
    lines = started(done.stdout)
    # No server in the YAML: one per phase, not one per run, and none left running.
    assert [line for line in lines if line.startswith("vLLM")] == [
        "vLLM (generate): starting one server for this phase",
        f"vLLM (generate): ready at {url}; every run of this phase uses it",
        "vLLM (generate): stopped",
        "vLLM (extract): starting one server for this phase",
        f"vLLM (extract): ready at {url}; every run of this phase uses it",
        "vLLM (extract): stopped",
    ]
    assert lines.index("vLLM (generate): stopped") < lines.index("hidden_states[rows_0-20]: to run (never materialized)")
    assert not port_in_use("127.0.0.1", vllm.port)
    with op.instance() as instance:
        shards = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("hidden_states")), limit=10)
        assert sorted(
            (r.event_log_entry.asset_materialization.partition, r.event_log_entry.asset_materialization.metadata["server"].value)
            for r in shards.records
        ) == [(key, url) for key in SHARDS]
        responses = instance.get_latest_materialization_event(AssetKey("responses")).asset_materialization
        assert (responses.metadata["backend"].value, responses.metadata["rows_failed"].value) == ("vllm", 0)


def test_settings_refused_at_load_are_one_error_line_and_exit_2(tmp_path):
    config = tmp_path / "eagle3.yaml"
    config.write_text("shard_size: 0\n")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "EAGLE3_CONFIG": str(config), "EAGLE3_ROOT": str(tmp_path / "r")}
    cmd = [sys.executable, "-m", "eagle3_assets.start"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.endswith(f"error: invalid settings in {config}:\n  shard_size: Input should be greater than or equal to 1\n")


def test_a_prompt_file_without_held_out_prompts_is_refused_before_anything_runs(tmp_path):
    """drafter_eval refuses without held-out prompts; the command that would reach it refuses at once, not after
    training (issue 44, item 8). `--through drafter` and earlier stop before it, and are not refused for it."""
    config = tmp_path / "eagle3.yaml"
    config.write_text(f"prompts: {tmp_path / 'prompts.jsonl'}\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_CONFIG": str(config), "EAGLE3_ROOT": str(tmp_path / "r")}
    cmd = [sys.executable, "-m", "eagle3_assets.start"]
    for through in ([], ["--through", "drafter_eval"]):
        done = subprocess.run(cmd + through, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr.endswith(
            "error: eval_prompts: not set, but `prompts` is: drafter_eval serves the trained drafter on held-out "
            "prompts and would refuse after the drafter trained; name a JSONL of prompts never used in training (same "
            "format as `prompts`), or stop before it (python -m eagle3_assets.start --through drafter)\n"
        )
    assert list(home.iterdir()) == [] and not (tmp_path / "r").exists()  # nothing opened, nothing written
