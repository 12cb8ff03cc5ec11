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
from dagster import AssetKey, AssetSelection, Definitions, evaluate_automation_conditions

from eagle3_assets.project import Project
from eagle3_assets.settings import GenerationSettings

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


def requested(out: str) -> list[str]:
    """What a start command's ticks requested, in order."""
    return [line.split(": to run (")[0] for line in started(out) if ": to run (" in line]


SHARDS = ["hidden_states[rows_0-20]", "hidden_states[rows_20-40]"]
DATA = ["responses", "tokenized", *SHARDS, "token_freq", "vocab_map", "drafter"]
TUNED = dict(draft_vocab_size=32, generation=GenerationSettings(max_new_tokens=6, batch_size=16, rows_per_part=16))
SEEDED = dict(TUNED, generation=TUNED["generation"].model_copy(update={"seed": 1}))
LR = dict(training=tiny_settings().training.model_copy(update={"lr": 3e-4}))
# Each change, made after the ones above it: the settings then, whether five prompts are appended to the prompt file,
# and what the conditions request, in order (the start command and the daemon alike).
CHANGES = [
    ("nothing", {}, False, []),
    ("draft_vocab_size", dict(draft_vocab_size=32), False, ["vocab_map", "drafter"]),
    ("training.lr", dict(draft_vocab_size=32, **LR), False, ["drafter"]),
    ("generation.max_new_tokens", dict(TUNED, **LR), False, DATA),
    ("five prompts appended", dict(TUNED, **LR), True,
     ["prompts", "responses", "tokenized", "hidden_states[rows_40-45]", "token_freq", "vocab_map", "drafter"]),
    ("another target", dict(TUNED, **LR, demo=TINY_DEMO.model_copy(update={"seed": 1})), False,
     ["target_model", "responses", "tokenized", *SHARDS, "hidden_states[rows_40-45]", "token_freq", "vocab_map", "drafter"]),
    # Regenerated under another seed, greedy decoding makes the same text (each row stamped with what made it, so
    # `tokenized` runs); the rows tokenize to the same ids: a content-equal `tokenized` stops the cascade.
    ("generation.seed, greedy", dict(SEEDED, **LR, demo=TINY_DEMO.model_copy(update={"seed": 1})), False,
     ["responses", "tokenized"]),
    # Its own blocking check failed on its latest materialization: not made again for it; its children wait.
    ("vocab_map's check fails", dict(SEEDED, **LR, demo=TINY_DEMO.model_copy(update={"seed": 1})), False, []),
]  # fmt: skip


def fail_vocab_map_check(instance, project: Project) -> None:
    """The vocab map's file broken in place (t2d all false) and its check run on it, as `dagster asset check` would."""
    from dagster import define_asset_job

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.vocab_map import VocabMap

    broken = VocabMap.load(project.store)
    broken.t2d[:] = False
    broken.save(project.store)
    check = define_asset_job("check_vocab_map", selection=AssetSelection.checks_for_assets("vocab_map"))
    defs = Definitions.merge(build_definitions(project), Definitions(jobs=[check]))
    assert not defs.resolve_job_def("check_vocab_map").execute_in_process(instance=instance, raise_on_error=False).success


@pytest.mark.parametrize("door", ["start", "daemon"])
def test_each_change_redoes_exactly_what_it_made_stale_through_either_door(made_graph, door):
    """One table of changes, one policy: the start command ticks the daemon's own conditions (issue 42), so both
    request the same assets in the same order. A content-equal parent stops the cascade under both."""
    from eagle3_assets.responses import PARTS_DIR

    op, prompts, base, train, first_output = made_graph()
    store = op.project.store
    assert requested(first_output) == [
        "prompts", "target_model", "responses", "tokenized", *SHARDS, "token_freq", "vocab_map", "drafter",
    ]  # fmt: skip

    def sample_mtimes() -> dict[str, float]:
        root = op.root / "hidden_states"
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.glob("rows_*/*.safetensors")}

    def responses_made() -> tuple[int, int]:
        with op.instance() as instance:
            meta = instance.get_latest_materialization_event(AssetKey("responses")).asset_materialization.metadata
            return meta["rows_generated"].value, meta["rows_reused"].value

    def through_start(settings) -> tuple[list[str], str]:
        Path(op.env["EAGLE3_CONFIG"]).write_text(settings.model_dump_json())
        done = op.start("--through", "drafter")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return requested(done.stdout), done.stdout + done.stderr

    logs, files = {}, sample_mtimes()
    with op.instance() as instance:
        daemon = Daemon(instance, store)
        for name, changes, append, want in CHANGES:
            if append:
                with prompts.open("a") as f:
                    f.write("".join(json.dumps(p) + "\n" for p in train[40:45]))
            settings = {**base, **changes}
            if name == "vocab_map's check fails":
                fail_vocab_map_check(instance, Project(tiny_settings(**settings), store))
            if door == "start":
                got, logs[name] = through_start(tiny_settings(**settings))
            else:
                daemon.settings(**settings)
                got = daemon.settle()
            assert got == want, name
            if name == "training.lr":
                assert sample_mtimes() == files
            elif name == "generation.max_new_tokens":
                assert responses_made() == (40, 0)
                files = sample_mtimes()
            elif name == "five prompts appended":
                assert responses_made() == (5, 40)
                appended = sample_mtimes()
                assert {k: v for k, v in appended.items() if not k.startswith("rows_40-45/")} == files
        assert responses_made() == (45, 0)  # 0 of the old target's rows kept
        again = sample_mtimes()
        assert sorted(again) == sorted(appended) and not any(again[k] == appended[k] for k in again)  # 0 files kept
        parts = [json.loads(line) for name in store.listdir(PARTS_DIR) if name.startswith("part-")
                 for line in store.read_text(f"{PARTS_DIR}/{name}").splitlines()]  # fmt: skip
        assert len(parts) == 45 and len({r["made_by"] for r in parts}) == 45
        if door == "daemon":
            assert daemon.settle() == []
            return
    # The start command says why each ran, and what it wiped.
    assert "vocab_map: to run (made from other inputs: setting draft_vocab_size: 64 -> 32)" in logs["draft_vocab_size"]
    lr = logs["training.lr"]
    assert "made from other inputs: setting training.lr: 0.0001 -> 0.0003" in lr
    assert "drafter: not resuming" in lr and "settings.lr: checkpoint 0.0001, now 0.0003" in lr
    assert "setting generation.max_new_tokens: 8 -> 6" in logs["generation.max_new_tokens"]
    wiped = [line for line in logs["another target"].splitlines() if "its files are not reused, it is extracted again" in line]
    assert len(wiped) == 3 and all("input target_model: " in line for line in wiped), wiped
    assert "[start] not made again for its own check, what follows it waits: vocab_map: its check vocab_map_invariant " \
        "failed" in logs["vocab_map's check fails"]


# --- the product's own definitions, ticked as the daemon's sensors tick them ------------------------------------


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
        """One tick's requests up to `drafter` (as `--through drafter`), in graph order."""
        self.clock += datetime.timedelta(minutes=1)  # no cron tick passes: the backfill's schedule stays out
        result = evaluate_automation_conditions(
            self.defs, self.instance, asset_selection=AssetSelection.assets("drafter").upstream(),
            evaluation_time=self.clock, cursor=self.cursor,
        )  # fmt: skip
        self.cursor = result.cursor
        return {
            key.to_user_string(): sorted(result.get_requested_partitions(key) - {None})
            for key in self.defs.resolve_asset_graph().toposorted_asset_keys
            if result.get_num_requested(key)
        }

    def settle(self) -> list[str]:
        """Tick and run what is requested until nothing more is: every request, in order."""
        job = self.defs.resolve_implicit_global_asset_job_def()
        seen: list[str] = []
        for _ in range(12):
            requested = self.tick()
            seen += [f"{k}[{p}]" if p else k for k, parts in requested.items() for p in (parts or [None])]
            if not requested:
                return seen
            unpartitioned = [AssetKey(k) for k, parts in requested.items() if not parts]
            if unpartitioned:
                assert job.execute_in_process(instance=self.instance, asset_selection=unpartitioned).success
            for key, parts in requested.items():
                for partition in parts:
                    assert job.execute_in_process(
                        instance=self.instance, asset_selection=[AssetKey(key)], partition_key=partition
                    ).success
        raise AssertionError(f"the sensors never settled: {seen}")


# --- `--plan`: what the next start runs, said before it runs ---------------------------------------------------


def files(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under `roots`, with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for r in roots for p in sorted(r.rglob("*")) if p.is_file()}


def plan_steps(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("  ")]


def launched(out: str) -> list[str]:
    """What a start command launched, in order: each `: starting` line's assets (one run may hold several)."""
    lines = [line.removeprefix("[start] ") for line in out.splitlines() if line.startswith("[start] ")]
    return [label for line in lines if ": starting" in line for label in line.split(": starting")[0].split(",")]


def test_the_plan_lists_what_the_next_start_then_runs_with_its_cost_and_changes_nothing(made_graph):
    """`--plan` after a change: each asset and shard the next start runs, in its order, with the change that makes it
    run and its cost measured from the graph's own past runs; the store and the instance are left as they were. The
    start that follows launches exactly that, and the figures hold."""
    from eagle3_assets.figures import size
    from eagle3_assets.settings import ExtractionSettings

    op, prompts, base, train, _ = made_graph()
    plan = ["--plan", "--through", "drafter"]
    assert op.start(*plan).stdout.splitlines() == [
        "plan: nothing to run: everything is made as the current settings and inputs would make it"
    ]
    with op.instance() as instance:
        shards = [r.asset_materialization.metadata for r in instance.fetch_materializations(AssetKey("hidden_states"), limit=9).records]
    per_row = sum(m["bytes"].value for m in shards) / sum(m["rows_total"].value for m in shards)

    dtype = ExtractionSettings(batch_tokens=2048, progress_interval_s=0.01, storage_dtype="float16")
    Path(op.env["EAGLE3_CONFIG"]).write_text(tiny_settings(**base, draft_vocab_size=32, extraction=dtype).model_dump_json())
    before = files(op.root, op.home)
    planned = op.start(*plan)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert files(op.root, op.home) == before  # no run, no record, no lease, no log
    steps = plan_steps(planned.stdout)
    dtype_changed = 'made from other inputs: setting extraction.storage_dtype: "bfloat16" -> "float16"'
    want = [
        "  vocab_map: redo (made from other inputs: setting draft_vocab_size: 64 -> 32); ",
        f"  hidden_states[rows_0-20]: redo ({dtype_changed}); ~{size(per_row * 20)} to write, ",
        f"  hidden_states[rows_20-40]: redo ({dtype_changed}); ~{size(per_row * 20)} to write, ",
        f"  drafter: redo ({dtype_changed}); ~3 optimizer steps, ",
    ]
    assert len(steps) == len(want) and all(s.startswith(w) for s, w in zip(steps, want, strict=True)), steps
    assert all("no past run" not in s for s in steps)  # every cost measured from the graph's first build
    assert "20 rows; 15.5 KiB per row over 40 past rows" in steps[1]
    assert "its last run's 3 steps; " in steps[3]
    assert planned.stdout.splitlines()[-1].startswith(
        f"total: 0 rows to generate, 2 shards (~{size(per_row * 40)}) to extract, ~3 optimizer steps; ~"
    )

    done = op.start("--through", "drafter")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert launched(done.stdout) == [s.split(": ")[0].strip() for s in steps]
    with op.instance() as instance:
        made = instance.fetch_materializations(AssetKey("hidden_states"), limit=2).records
        assert all(abs(r.asset_materialization.metadata["bytes"].value - per_row * 20) < 0.01 * per_row * 20 for r in made)
        drafter = instance.get_latest_materialization_event(AssetKey("drafter")).asset_materialization.metadata
        assert drafter["total_steps"].value == 3

    # Five prompts appended: the rows to generate are the new prompts' alone, counted from the rows' own stamps.
    with prompts.open("a") as f:
        f.write("".join(json.dumps(p) + "\n" for p in train[40:45]))
    steps = plan_steps(op.start(*plan).stdout)
    assert [s.split(": ")[0].strip() for s in steps] == [
        "prompts", "responses", "tokenized", "token_freq", "hidden_states[…]", "vocab_map", "drafter",
    ]  # fmt: skip
    assert steps[0].startswith("  prompts: redo (made from other inputs: input prompts file: ")
    assert steps[1].startswith("  responses: redo (input prompts is made again); 5 rows to generate, ~")
    assert "(of 45 prompts; " in steps[1]
    assert steps[4].startswith("  hidden_states[…]: redo (the shards tokenized cuts with other rows, and new ones: ")
