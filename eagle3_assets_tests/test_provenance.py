"""Provenance through both doors (issue 32): each kind of change, made through the one start command and under
the daemon's conditions, redoes exactly what it made stale and keeps the rest.

Both start from the same graph, made once by the start command (the tiny data graph, three shards and a short
drafter, ~1 min) and copied back into place before each test: every path the records hold stays the same."""

import datetime
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from dagster import AssetKey, Definitions, evaluate_automation_conditions

from eagle3_assets.project import Project
from eagle3_assets.settings import GenerationSettings, TrainingSettings

from .conftest import TINY_DEMO, tiny_settings
from .helpers import Operator, prompt_file_operator
from .test_start import started

pytestmark = pytest.mark.slow  # the tiny data graph, three shards and a short drafter, in subprocesses


class Graph(NamedTuple):
    op: Operator
    prompts: Path  # the prompt file the settings name, for appending to
    base: dict  # the settings that name it
    train: list[dict]  # every demo prompt
    first: str  # the first start command's output


@pytest.fixture(scope="module")
def made_graph(tmp_path_factory, tiny_target_dir) -> Callable[[], Graph]:
    """The graph made once; each call puts that first state back in place and returns it."""
    base_dir = tmp_path_factory.mktemp("provenance")
    work, snapshot = base_dir / "graph", base_dir / "snapshot"
    work.mkdir()
    op, prompts, base, train = prompt_file_operator(work, tiny_target_dir)
    made = op.start("--through", "drafter")  # the graph made once, as a person would start it
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    shutil.copytree(work, snapshot, symlinks=True)

    def fresh() -> Graph:
        shutil.rmtree(work)
        shutil.copytree(snapshot, work, symlinks=True)
        return Graph(op, prompts, base, train, made.stdout)

    return fresh


def ran(out: str) -> list[str]:
    """The assets and shards a start command ran, in order."""
    return [line.removesuffix(": starting") for line in started(out) if line.endswith(": starting")]


def test_a_changed_setting_or_input_redoes_exactly_what_it_made_and_keeps_the_rest(made_graph):
    """Each change through the one command: what runs, what it regenerates, what it keeps."""
    from eagle3_assets.responses import PARTS_DIR

    op, prompts, base, train, first_output = made_graph()
    store = op.project.store

    def run_with(**changes) -> tuple[list[str], str]:
        settings = tiny_settings(**{**base, **changes})
        Path(op.env["EAGLE3_CONFIG"]).write_text(settings.model_dump_json())
        done = op.start("--through", "drafter")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return ran(done.stdout), done.stdout + done.stderr

    def sample_mtimes() -> dict[str, float]:
        root = op.root / "hidden_states"
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.glob("rows_*/*.safetensors")}

    assert ran(first_output) == ["prompts,target_model,responses,tokenized,token_freq,vocab_map", "hidden_states[rows_0-20]",
                     "hidden_states[rows_20-40]", "drafter"]  # fmt: skip
    files = sample_mtimes()

    def responses_made() -> tuple[int, int]:
        with op.instance() as instance:
            meta = instance.get_latest_materialization_event(AssetKey("responses")).asset_materialization.metadata
            return meta["rows_generated"].value, meta["rows_reused"].value

    assert run_with()[0] == []  # nothing changed: nothing runs

    done, log = run_with(draft_vocab_size=32)
    assert done == ["vocab_map", "drafter"]
    assert "vocab_map: to run (made from other inputs: setting draft_vocab_size: 64 -> 32)" in log
    assert sample_mtimes() == files

    done, log = run_with(draft_vocab_size=32, training=TrainingSettings(
        lr=3e-4, batch_tokens=512, warmup_steps=2, epochs=1.0, checkpoint_every=5, heldout_rows=4))  # fmt: skip
    assert done == ["drafter"]
    assert "made from other inputs: setting training.lr: 0.0001 -> 0.0003" in log
    assert "drafter: not resuming" in log and "settings.lr: checkpoint 0.0001, now 0.0003" in log
    assert sample_mtimes() == files

    tuned = dict(draft_vocab_size=32, generation=GenerationSettings(max_new_tokens=6, batch_size=16, rows_per_part=16))
    done, log = run_with(**tuned)
    assert done == ["responses,tokenized,token_freq,vocab_map", "hidden_states[rows_0-20]", "hidden_states[rows_20-40]",
                    "drafter"]  # fmt: skip
    assert "setting generation.max_new_tokens: 8 -> 6" in log
    assert responses_made() == (40, 0)
    files = sample_mtimes()

    with prompts.open("a") as f:  # five prompts appended
        f.write("".join(json.dumps(p) + "\n" for p in train[40:45]))
    done, log = run_with(**tuned)
    assert done == ["prompts,responses,tokenized,token_freq,vocab_map", "hidden_states[rows_40-45]", "drafter"]
    assert responses_made() == (5, 40)
    appended = sample_mtimes()
    assert {k: v for k, v in appended.items() if not k.startswith("rows_40-45/")} == files

    done, log = run_with(**tuned, demo=TINY_DEMO.model_copy(update={"seed": 1}))  # another target
    assert done == ["target_model,responses,tokenized,token_freq,vocab_map", "hidden_states[rows_0-20]",
                    "hidden_states[rows_20-40]", "hidden_states[rows_40-45]", "drafter"]  # fmt: skip
    assert responses_made() == (45, 0)  # 0 of the old target's rows kept
    again = sample_mtimes()
    assert sorted(again) == sorted(appended) and not any(again[k] == appended[k] for k in again)  # 0 files kept
    wiped = [line for line in log.splitlines() if "removed files made from other inputs" in line]
    assert len(wiped) == 3 and all("input target_model: " in line for line in wiped), wiped
    parts = [json.loads(line) for name in store.listdir(PARTS_DIR) if name.startswith("part-")
             for line in store.read_text(f"{PARTS_DIR}/{name}").splitlines()]  # fmt: skip
    assert len(parts) == 45 and len({r["made_by"] for r in parts}) == 45


# --- the product's own definitions: each kind of change, under the daemon's conditions (issue 32) ---------------


class Daemon:
    """The `pipeline` and `shard_backfill` sensors' conditions ticking over the product's definitions (rebuilt when
    the settings change, as a code location reloads), each tick's requests run in this process as the daemon would
    launch them: what was requested, and in which order, is what the test reads."""

    def __init__(self, instance, store):
        self.instance, self.store = instance, store
        self.clock = datetime.datetime(2026, 12, 1, 12, 1, tzinfo=datetime.UTC)
        self.cursor = None
        self.defs: Definitions | None = None

    def settings(self, **settings) -> None:
        from eagle3_assets.definitions import build_definitions

        self.defs = build_definitions(Project(tiny_settings(**settings), self.store))

    def tick(self) -> dict[str, list[str]]:
        self.clock += datetime.timedelta(minutes=1)  # no cron tick passes: the backfill's schedule stays out
        result = evaluate_automation_conditions(self.defs, self.instance, evaluation_time=self.clock, cursor=self.cursor)
        self.cursor = result.cursor
        requested = {}
        for key in self.defs.resolve_all_asset_keys():
            if result.get_num_requested(key):
                partitions = sorted(result.get_requested_partitions(key) - {None})
                requested[key.to_user_string()] = partitions
        return requested

    def settle(self) -> list[str]:
        """Tick and run what is requested until nothing more is: every request, in order (`drafter_eval` and
        `drafter_release`, which serve in vLLM, are noted, not run)."""
        job = self.defs.resolve_implicit_global_asset_job_def()
        seen: list[str] = []
        for _ in range(12):
            requested = self.tick()
            runnable = {k: v for k, v in requested.items() if k not in ("drafter_eval", "drafter_release")}
            seen += sorted([f"{k}[{p}]" for k, parts in requested.items() for p in parts] + [k for k, p in requested.items() if not p])
            if not runnable:
                return seen
            unpartitioned = [AssetKey(k) for k, parts in runnable.items() if not parts]
            if unpartitioned:
                assert job.execute_in_process(instance=self.instance, asset_selection=unpartitioned).success
            for key, parts in runnable.items():
                for partition in parts:
                    assert job.execute_in_process(
                        instance=self.instance, asset_selection=[AssetKey(key)], partition_key=partition
                    ).success
        raise AssertionError(f"the sensors never settled: {seen}")


def test_under_the_daemon_each_change_redoes_exactly_what_it_made_stale(made_graph):
    op, prompts, base, train, _ = made_graph()

    def responses_made() -> tuple[int, int]:
        meta = instance.get_latest_materialization_event(AssetKey("responses")).asset_materialization.metadata
        return meta["rows_generated"].value, meta["rows_reused"].value

    with op.instance() as instance:
        daemon = Daemon(instance, op.project.store)
        daemon.settings(**base)
        assert daemon.settle() == []  # the first look, and nothing changed: nothing runs
        assert daemon.settle() == []

        daemon.settings(**base, draft_vocab_size=32)
        assert daemon.settle() == ["vocab_map", "drafter", "drafter_eval"]

        daemon.settings(**base, draft_vocab_size=32, training=tiny_settings().training.model_copy(update={"lr": 3e-4}))
        assert daemon.settle() == ["drafter", "drafter_eval"]

        tuned = dict(base, draft_vocab_size=32, training=tiny_settings().training.model_copy(update={"lr": 3e-4}))
        daemon.settings(**tuned, generation=GenerationSettings(max_new_tokens=6, batch_size=16, rows_per_part=16))
        assert daemon.settle() == [
            "responses", "tokenized", "hidden_states[rows_0-20]", "hidden_states[rows_20-40]", "token_freq", "vocab_map",
            "drafter", "drafter_eval",
        ]  # fmt: skip
        assert responses_made() == (40, 0)
        tuned["generation"] = GenerationSettings(max_new_tokens=6, batch_size=16, rows_per_part=16)

        with prompts.open("a") as f:  # five prompts appended: the same settings, another prompt file
            f.write("".join(json.dumps(p) + "\n" for p in train[40:45]))
        assert daemon.settle() == [
            "prompts", "responses", "tokenized", "hidden_states[rows_40-45]", "token_freq", "vocab_map", "drafter",
            "drafter_eval",
        ]  # fmt: skip
        assert responses_made() == (5, 40)

        daemon.settings(**tuned, demo=TINY_DEMO.model_copy(update={"seed": 1}))  # another target
        assert daemon.settle() == [
            "target_model", "responses", "tokenized", "hidden_states[rows_0-20]", "hidden_states[rows_20-40]",
            "hidden_states[rows_40-45]", "token_freq", "vocab_map", "drafter", "drafter_eval",
        ]  # fmt: skip
        assert responses_made() == (45, 0)
        assert daemon.settle() == []
