"""Issue 45: under the daemon, a change whose plan (`--plan`) is over `approval.limit_s` waits for a person, and runs
once a person approved it (`python -m eagle3_assets.start --approve`, or the `approve_plan` job in the UI).

Daemon ticks over stand-ins with the product's keys and conditions, each recording its provenance in a real store
(as test_automation.py does) and the seconds its plan cost is measured from."""

import datetime
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetSelection,
    AutomationResult,
    DagsterInstance,
    Definitions,
    MaterializeResult,
    asset,
    evaluate_automation_conditions,
)
from dagster._core.test_utils import instance_for_test

from eagle3_assets.defs.data.automation import data_condition
from eagle3_assets.defs.drafter.automation import drafter_condition
from eagle3_assets.defs.ops.approval import approve_plan_job
from eagle3_assets.defs.plan import approve
from eagle3_assets.defs.provenance import Staleness, StartDoor, materialized
from eagle3_assets.plan import APPROVAL_FILE, Approval
from eagle3_assets.project import Project
from eagle3_assets.settings import ApprovalSettings, SettingsError, parse_settings
from eagle3_assets.start import main
from eagle3_assets.storage import ArtifactStore
from eagle3_assets_tests.conftest import tiny_settings
from eagle3_assets_tests.helpers import REPO

HOUR = ApprovalSettings(limit_s=3600.0)
VOCAB_MAP_S = 5000.0  # what a vocab map took: over the hour alone


def graph(project: Project) -> Definitions:
    """`tokenized` → `vocab_map` → `drafter`, under the daemon's conditions. The vocab map records the seconds it
    took; the drafter records no step count, so its cost has no past run to be measured from."""

    def stand_in(name: str, seconds: float | None = None, **kwargs):
        @asset(name=name, **kwargs)
        def body(context: AssetExecutionContext) -> MaterializeResult:
            made = materialized(project, Staleness(project).expected(name))
            timed = {"seconds": seconds} if seconds else {}
            return MaterializeResult(**{**made, "metadata": {**made["metadata"], **timed}})

        return body

    tokenized = stand_in("tokenized")
    vocab_map = stand_in("vocab_map", VOCAB_MAP_S, deps=[tokenized], automation_condition=data_condition(project))
    drafter = stand_in("drafter", deps=[vocab_map], automation_condition=drafter_condition(project))
    approving = approve_plan_job(lambda: defs.resolve_asset_graph())
    defs = Definitions(assets=[tokenized, vocab_map, drafter], jobs=[approving], resources={"project": project})
    return defs


class Daemon:
    """One sensor tick at a time over the definitions of the current settings (rebuilt as a code location reloads)."""

    def __init__(self, instance, store: ArtifactStore):
        self.instance, self.store = instance, store
        self.clock = datetime.datetime(2026, 12, 1, 12, 1, tzinfo=datetime.UTC)
        self.cursor = None
        self.said: dict[str, str] = {}

    def settings(self, **settings) -> Project:
        self.project = Project(tiny_settings(approval=HOUR, **settings), self.store)
        self.defs = graph(self.project)
        return self.project

    def run(self, *keys: str) -> None:
        job = self.defs.resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=self.instance, asset_selection=[AssetKey(k) for k in keys]).success

    def tick(self) -> list[str]:
        self.clock += datetime.timedelta(minutes=1)
        result = evaluate_automation_conditions(
            self.defs, self.instance, evaluation_time=self.clock, cursor=self.cursor
        )
        self.cursor = result.cursor
        # What the UI shows each asset for the gate: its node in the condition's evaluation, when it was evaluated.
        self.said = {
            r.key.to_user_string(): node.serializable_evaluation.condition_snapshot.description
            for r in result.results
            for node in walk(r)
            if node.condition.name == "plan_approved" and not node.condition.description.startswith("the plan of")
        }
        return sorted(k.to_user_string() for k in self.defs.resolve_all_asset_keys() if result.get_num_requested(k))

    def approve(self) -> list[str]:
        return approve(self.instance, self.project, self.defs.resolve_asset_graph(), by="a test")


def walk(result: AutomationResult) -> Iterator[AutomationResult]:
    yield result
    for child in result.child_results:
        yield from walk(child)


WAITS = (
    "waits for approval: plan ~1h 23m (2 to run) over the limit of 1h 00m (approval.limit_s); approve with "
    "`python -m eagle3_assets.start --approve`"
)


def test_a_plan_over_the_limit_waits_under_the_daemon_until_a_person_approves_it_and_a_new_change_waits_again(tmp_path):
    with instance_for_test() as instance:
        daemon = Daemon(instance, ArtifactStore(tmp_path / "store"))
        daemon.settings()
        daemon.run("tokenized", "vocab_map", "drafter")
        assert daemon.tick() == []  # the sensor's first look starts nothing
        assert daemon.approve() == [
            "nothing to approve: nothing is due; everything is made as the current settings and inputs make it"
        ]
        assert not daemon.store.exists(APPROVAL_FILE)

        # A change whose plan (the vocab map ~1h 23m, the drafter unmeasured) is over the hour: nothing starts, and
        # the vocab map's condition says why, with the cost and the limit.
        daemon.settings(draft_vocab_size=32)
        assert daemon.tick() == []
        assert daemon.said["vocab_map"] == WAITS
        assert daemon.tick() == []  # still waiting: nothing requested while no one approved

        # One click in the UI (the `approve_plan` job) records the approval in the store; the next tick starts it.
        run = daemon.defs.resolve_job_def("approve_plan").execute_in_process(instance=instance)
        assert run.success
        approval = Approval.read(daemon.store)
        assert approval is not None and approval.labels == ("vocab_map", "drafter")
        assert approval.by == f"the approve_plan job (run {run.run_id})"
        assert daemon.tick() == ["vocab_map"]
        assert daemon.said["vocab_map"].endswith(f"; approved by the approve_plan job (run {run.run_id})")
        # As the plan runs, its steps leave it and the reasons of the rest change: the same plan, still approved
        # (the drafter alone has no past run to measure it by: it would wait otherwise).
        daemon.run("vocab_map")
        assert daemon.tick() == ["drafter"]
        daemon.run("drafter")
        assert daemon.tick() == []

        # Another change with the same steps is another plan: it waits again, and runs once approved with the
        # command's function (`--approve`), which says what it approved and at what cost.
        daemon.settings(draft_vocab_size=48)
        assert daemon.tick() == []
        assert daemon.said["vocab_map"] == WAITS
        lines = daemon.approve()
        assert lines[0] == (
            f"approved plan {Approval.read(daemon.store).digest} (plan ~1h 23m (2 to run) over the limit of 1h 00m "
            "(approval.limit_s)); the daemon starts it at its next tick. This command starts nothing"
        )
        assert lines[1].startswith(
            "  vocab_map: redo (made from other inputs: setting draft_vocab_size: 32 -> 48); ~1h 23m"
        )
        assert lines[2].startswith("  drafter: redo (input vocab_map is made again); time unknown")
        assert lines[3].startswith("total: 0 rows to generate, 0 shards (~0 B) to extract, ~0 optimizer steps; ~1h 23m")
        assert daemon.tick() == ["vocab_map"]


@pytest.mark.parametrize(("body", "why"), [
    ("", "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"), ('{"digest": "0123"}', "KeyError: 'labels'"),
])  # fmt: skip
def test_a_malformed_approval_file_makes_the_plan_wait_naming_it_and_never_fails_the_tick(tmp_path, body, why):
    """Issue 52, item 11: a malformed `approval/plan.json` failed the whole sensor tick."""
    with instance_for_test() as instance:
        daemon = Daemon(instance, ArtifactStore(tmp_path / "store"))
        daemon.settings()
        daemon.run("tokenized", "vocab_map", "drafter")
        daemon.settings(draft_vocab_size=32)
        daemon.store.write_text(APPROVAL_FILE, body)
        assert daemon.tick() == []
        assert daemon.said["vocab_map"] == (
            f"{WAITS.removesuffix('; approve with `python -m eagle3_assets.start --approve`')}; "
            f"{daemon.store.url_of(APPROVAL_FILE)} is not an approval ({why}): approve again with "
            "`python -m eagle3_assets.start --approve`, which replaces it"
        )
        daemon.approve()
        assert daemon.tick() == ["vocab_map"]


def test_without_a_limit_the_daemon_never_waits_and_the_start_command_never_does(tmp_path):
    from eagle3_assets.definitions import build_definitions

    def gated(defs: Definitions, key: str) -> bool:
        condition = defs.resolve_asset_graph().get(AssetKey(key)).automation_condition

        def names(c) -> Iterator[str]:
            yield c.name
            for child in c.children:
                yield from names(child)

        return "plan_approved" in set(names(condition))

    store = ArtifactStore(tmp_path / "store")
    limited = Project(tiny_settings(approval=HOUR), store)
    daemon, start = build_definitions(limited), build_definitions(limited, StartDoor())
    assert all(gated(daemon, k) for k in ("prompts", "responses", "vocab_map", "hidden_states", "drafter"))
    assert not any(gated(start, k) for k in ("prompts", "responses", "vocab_map", "hidden_states", "drafter"))
    assert "approve_plan" in {j.name for j in daemon.resolve_all_job_defs()}
    unlimited = build_definitions(Project(tiny_settings(), store))
    assert not any(gated(unlimited, k) for k in ("prompts", "responses", "vocab_map", "hidden_states", "drafter"))
    assert "approve_plan" not in {j.name for j in unlimited.resolve_all_job_defs()}


def test_the_limit_is_validated_naming_the_field_and_approve_is_refused_beside_what_it_cannot_mean(
    tmp_path, monkeypatch, capsys
):
    try:
        parse_settings({"approval": {"limit_s": 0}}, "eagle3.yaml")
        raise AssertionError("a limit of 0 seconds was accepted")
    except SettingsError as e:
        assert str(e) == "invalid settings in eagle3.yaml:\n  approval.limit_s: Input should be greater than 0"
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    assert main(["--approve", "--from", "vocab_map"]) == 2
    assert capsys.readouterr().err == (
        "--approve approves what is due for the daemon: not with --plan, --shard, --list-shards, --from\n"
    )


def test_the_approve_command_records_the_plan_of_what_is_due_says_its_cost_and_starts_nothing(tmp_path):
    """`python -m eagle3_assets.start --approve` on a fresh store: every step is a first make with no past run to
    measure it, so the plan is not known to be under the limit; approved, it is recorded, and nothing runs."""
    config, home, root = tmp_path / "eagle3.yaml", tmp_path / "home", tmp_path / "root"
    config.write_text(tiny_settings(approval=HOUR).model_dump_json())  # JSON is YAML
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_CONFIG": str(config), "EAGLE3_ROOT": str(root)}
    cmd = [sys.executable, "-m", "eagle3_assets.start", "--approve"]
    done = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    store = ArtifactStore(root)
    approval = Approval.read(store)
    user = os.environ.get("USER", "unknown")
    assert approval is not None and approval.by == f"`python -m eagle3_assets.start --approve` (user {user})"
    steps = ["prompts", "target_model", "responses", "tokenized", "token_freq", "hidden_states[…]", "vocab_map",
             "drafter", "drafter_eval", "drafter_release"]  # fmt: skip
    assert approval.labels == tuple(steps)
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"approved plan {approval.digest} (plan ~0m 00s (10 to run) and 10 step(s) with no past run to measure from: "
        "not known to be under the limit of 1h 00m (approval.limit_s)); the daemon starts it at its next tick. This "
        "command starts nothing"
    )
    assert [line.split(": ")[0].strip() for line in lines[1:11]] == steps
    assert lines[11] == "total: " + approval.total
    # Nothing ran: no run in the instance, and the store holds the approval alone.
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_runs() == []
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [APPROVAL_FILE]


def test_in_rolling_mode_the_plan_names_the_shards_a_retrained_drafter_extracts_again(tmp_path):
    """Rolling: a drafter that trains from scratch clears its window records and extracts again the shards its earlier
    pass released (`shard_window.start_over`); the plan says so before it runs."""
    from eagle3_assets.defs.plan import next_start
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.shard_window import record_consumed, release

    with instance_for_test() as instance:
        daemon = Daemon(instance, ArtifactStore(tmp_path / "store"))
        rolling = TrainingSettings(mode="rolling")
        daemon.settings(training=rolling)
        daemon.run("tokenized", "vocab_map", "drafter")
        for key in ("rows_20-40", "rows_0-20"):
            release(daemon.store, record_consumed(daemon.store, key, step=3, checkpoint="drafter/checkpoints/step_3"))
        record_consumed(daemon.store, "rows_40-60", step=5, checkpoint="drafter/checkpoints/step_5")  # not released

        project = daemon.settings(training=rolling.model_copy(update={"lr": 1e-3}))
        plan = next_start(instance, project, daemon.defs, StartDoor(), AssetSelection.all())
        assert [s.label for s in plan.steps] == ["drafter"]
        assert plan.notes[1:] == [
            (
                "rolling: 2 shard(s) an earlier pass of drafter released (rows_0-20, rows_20-40) are extracted again, "
                "as the window admits them, if drafter trains from scratch; a continuation of the release trains the "
                "new shards only. Its log says which as it starts"
            )
        ]
