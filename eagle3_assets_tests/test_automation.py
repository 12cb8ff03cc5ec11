"""The automation conditions, evaluated against real runs in a test instance.

The stand-in assets carry the product's conditions, keys and deps; each records its provenance in a real
store as the product's assets do, so the provenance rule (`defs/provenance.py`) sees what it would."""

import datetime
import threading
import time

import pytest
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetExecutionContext,
    AssetKey,
    DagsterRunStatus,
    Definitions,
    DynamicPartitionsDefinition,
    MaterializeResult,
    RunsFilter,
    asset,
    asset_check,
    evaluate_automation_conditions,
)
from dagster._core.test_utils import instance_for_test

from eagle3_assets.defs.data.automation import data_condition
from eagle3_assets.defs.drafter.automation import drafter_condition, drafter_eval_condition, drafter_release_condition
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.defs.shards.automation import shard_backfill_condition
from eagle3_assets.project import Project
from eagle3_assets.sample_file import manifest_path
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets_tests.conftest import tiny_settings

shards = DynamicPartitionsDefinition(name="hidden_state_shards")
release = threading.Event()
failing: set[str] = set()


def project_at(tmp_path, **settings) -> Project:
    return Project(tiny_settings(**settings), ArtifactStore(tmp_path / "store"))


def record(project: Project, context: AssetExecutionContext) -> MaterializeResult:
    """What the product's asset writes beside its artifact, and on its materialization: its provenance under the
    current settings."""
    partition = context.partition_key if context.has_partition_key else None
    want = Staleness(project).expected(context.asset_key.to_user_string(), partition)
    return MaterializeResult(**materialized(project, want, partition=partition))


def stand_in(project: Project, name: str, **kwargs):
    @asset(name=name, **kwargs)
    def body(context: AssetExecutionContext) -> MaterializeResult:
        return record(project, context)

    return body


def shard_defs(project: Project) -> Definitions:
    tokenized = stand_in(project, "tokenized")

    @asset(partitions_def=shards, deps=[tokenized], automation_condition=shard_backfill_condition("*/15 * * * *", project))
    def hidden_states(context: AssetExecutionContext) -> MaterializeResult:
        # The same condition as the product's asset; the body only fails or waits where the test needs it.
        if context.partition_key in failing:
            raise RuntimeError("extraction failed")
        if context.partition_key == "rows_60-80":
            release.wait(timeout=120)
        return record(project, context)

    return Definitions(assets=[tokenized, hidden_states])


class RollingBackfill:
    """`tokenized` and the rolling `hidden_states` under the backfill sensor's condition (each recording its
    provenance), and the sensor's ticks: `tick(minutes)` evaluates at 12:01 plus `minutes`, after the tick before,
    and returns the shards it requests."""

    START = datetime.datetime(2026, 11, 30, 12, 1, tzinfo=datetime.UTC)

    def __init__(self, project: Project, instance, keys: list[str]):
        tokenized = stand_in(project, "tokenized")

        condition = shard_backfill_condition("*/15 * * * *", project)

        @asset(partitions_def=shards, deps=[tokenized], automation_condition=condition)
        def hidden_states(context: AssetExecutionContext) -> MaterializeResult:
            return record(project, context)

        self.defs = Definitions(assets=[tokenized, hidden_states])
        self.key, self.instance, self.cursor = hidden_states.key, instance, None
        instance.add_dynamic_partitions("hidden_state_shards", keys)
        assert run(self.defs, instance, ["tokenized"]).success

    def tick(self, minutes: int) -> list[str]:
        result = evaluate_automation_conditions(
            self.defs, self.instance, evaluation_time=self.START + datetime.timedelta(minutes=minutes), cursor=self.cursor
        )
        self.cursor = result.cursor
        return sorted(result.get_requested_partitions(self.key))


def run(defs, instance, keys, partition=None):
    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition, raise_on_error=False
    )


def test_each_cron_tick_requests_exactly_the_missing_and_failed_shards(tmp_path):
    DEFS = shard_defs(project_at(tmp_path))
    hidden_states = AssetKey("hidden_states")
    keys = ["rows_0-20", "rows_20-40", "rows_40-60", "rows_60-80", "rows_80-100"]
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("hidden_state_shards", keys)
        assert run(DEFS, instance, ["tokenized"]).success
        assert run(DEFS, instance, ["hidden_states"], "rows_0-20").success
        assert run(DEFS, instance, ["hidden_states"], "rows_20-40").success
        # rows_40-60 materialized once, then its rerun failed: not "missing", but failed
        assert run(DEFS, instance, ["hidden_states"], "rows_40-60").success
        failing.add("rows_40-60")
        assert not run(DEFS, instance, ["hidden_states"], "rows_40-60").success
        release.clear()
        in_flight = threading.Thread(target=run, args=(DEFS, instance, ["hidden_states"], "rows_60-80"))
        in_flight.start()
        try:
            deadline = time.monotonic() + 60
            while not instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
                assert time.monotonic() < deadline, "the in-progress run never started"
                time.sleep(0.1)

            start = datetime.datetime(2026, 11, 30, 12, 1, tzinfo=datetime.UTC)
            first = evaluate_automation_conditions(DEFS, instance, evaluation_time=start)
            # no cron tick has passed since the first evaluation: nothing requested
            assert first.total_requested == 0
            after_tick = evaluate_automation_conditions(
                DEFS, instance, evaluation_time=start + datetime.timedelta(minutes=15), cursor=first.cursor
            )
            requested = after_tick.get_requested_partitions(hidden_states)
            assert sorted(requested) == ["rows_40-60", "rows_80-100"]  # failed + missing; not done, not running
            # A shard `tokenized` registers between ticks is requested at once, alone.
            instance.add_dynamic_partitions("hidden_state_shards", ["rows_100-120"])
            registered = evaluate_automation_conditions(
                DEFS, instance, evaluation_time=start + datetime.timedelta(minutes=16), cursor=after_tick.cursor
            )
            assert sorted(registered.get_requested_partitions(hidden_states)) == ["rows_100-120"]
        finally:
            release.set()
            in_flight.join(timeout=60)


# --- the rest of the graph: data assets, drafter, drafter_eval ----------------------------------

bad_shards: set[str] = set()  # the shards, and assets, whose blocking check fails


def graph_defs(project: Project) -> Definitions:
    """The product's conditions on stand-ins with the product's keys, deps and blocking shard check."""
    tokenized = stand_in(project, "tokenized")
    vocab_map = stand_in(project, "vocab_map", deps=[tokenized], automation_condition=data_condition(project))

    @asset(
        partitions_def=shards, deps=[tokenized], automation_condition=shard_backfill_condition("*/15 * * * *", project)
    )
    def hidden_states(context: AssetExecutionContext) -> MaterializeResult:
        # As the product's asset does: an extracted shard has its manifest (a rolling backfill requests a shard
        # materialized without one again: `ManifestGone`).
        project.store.write_json(manifest_path(context.partition_key), {})
        return record(project, context)

    @asset_check(asset=hidden_states, name="shard_integrity", partitions_def=shards, blocking=True)
    def shard_integrity(context: AssetCheckExecutionContext) -> AssetCheckResult:
        return AssetCheckResult(passed=context.partition_key not in bad_shards)

    drafter = stand_in(project, "drafter", deps=[vocab_map, hidden_states], automation_condition=drafter_condition(project))
    drafter_eval = stand_in(project, "drafter_eval", deps=[drafter], automation_condition=drafter_eval_condition(project))

    @asset_check(asset=drafter_eval, name="served_is_trained", blocking=True)
    def served_is_trained() -> AssetCheckResult:
        return AssetCheckResult(passed="drafter_eval" not in bad_shards)

    drafter_release = stand_in(
        project, "drafter_release", deps=[drafter_eval], automation_condition=drafter_release_condition(project)
    )
    return Definitions(
        assets=[tokenized, vocab_map, hidden_states, drafter, drafter_eval, drafter_release],
        asset_checks=[shard_integrity, served_is_trained],
    )


class Ticks:
    """Materialize stand-ins, then one sensor tick (no cron tick passes): what it requests."""

    def __init__(self, instance, defs: Definitions):
        self.instance, self.defs = instance, defs
        self.clock = datetime.datetime(2026, 12, 1, 12, 1, tzinfo=datetime.UTC)
        self.cursor = None

    def after(self, keys: list[str], partition: str | None = None, bad: str | None = None) -> list[str]:
        bad_shards.clear()
        bad_shards.update([bad] if bad else [])
        if keys:
            self.defs.resolve_implicit_global_asset_job_def().execute_in_process(
                instance=self.instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition,
                raise_on_error=False,
            )  # fmt: skip
        self.clock += datetime.timedelta(minutes=1)
        result = evaluate_automation_conditions(self.defs, self.instance, evaluation_time=self.clock, cursor=self.cursor)
        self.cursor = result.cursor
        return sorted(k.to_user_string() for k in self.defs.resolve_all_asset_keys() if result.get_num_requested(k))


@pytest.mark.parametrize("rolling", [False, True], ids=["offline", "rolling"])
def test_drafter_starts_when_its_shards_passed_their_checks_and_drafter_eval_and_release_follow(rolling, tmp_path):
    project = project_at(tmp_path, training=TrainingSettings(mode="rolling" if rolling else "offline"))
    with instance_for_test() as instance:
        after = Ticks(instance, graph_defs(project)).after
        instance.add_dynamic_partitions("hidden_state_shards", ["rows_0-20", "rows_20-40", "rows_40-45"])
        assert after([]) == []  # the sensor's first look starts nothing
        assert after(["tokenized"]) == ["vocab_map"]
        assert after(["vocab_map"]) == []
        assert after(["hidden_states"], "rows_0-20", bad="rows_0-20") == []  # materialized, check failed
        first_checked = after(["hidden_states"], "rows_0-20")
        assert after(["hidden_states"], "rows_20-40") == []
        if rolling:
            # Training rolls from the first shard that passed its check; the rest land while it trains.
            assert first_checked == ["drafter"]
            return
        assert first_checked == []
        assert after(["hidden_states"], "rows_40-45", bad="rows_40-45") == []  # every shard in, one failed its check
        assert after(["hidden_states"], "rows_40-45") == ["drafter"]
        assert after([]) == []  # requested once
        # A retrain is evaluated, then released by itself (when it is no worse: `drafter_release`'s check).
        assert after(["drafter"]) == ["drafter_eval"]
        # Served otherwise than it trained (its blocking check failed): nothing is released on its figures.
        assert after(["drafter_eval"], bad="drafter_eval") == []
        assert after(["drafter_eval"]) == ["drafter_release"]
        assert after(["drafter_release"]) == []


def test_in_rolling_mode_a_tick_requests_only_the_shards_the_window_admits(tmp_path):
    from eagle3_assets.shard_window import record_consumed, start_over

    project = project_at(tmp_path, training=TrainingSettings(mode="rolling", window_shards=2))
    keys = ["rows_0-20", "rows_20-40", "rows_40-60", "rows_60-80", "rows_80-100"]
    with instance_for_test() as instance:
        backfill = RollingBackfill(project, instance, keys)
        backfill.tick(0)
        assert backfill.tick(15) == ["rows_0-20", "rows_20-40"]

        # Training consumed the first shard (its files since released): the window moves on by one.
        record_consumed(project.store, "rows_0-20", step=7, checkpoint="drafter/checkpoints/step_7")
        assert backfill.tick(30) == ["rows_20-40", "rows_40-60"]

        # Issue 45: the three are extracted (rows_0-20's files since released); a new pass (a retrain from scratch)
        # clears the window's records as it starts, and the released shard is requested again, with no hand work.
        for key in keys[:3]:
            assert run(backfill.defs, instance, ["hidden_states"], partition=key).success
            project.store.write_json(manifest_path(key), {})
        assert backfill.tick(31) == []
        assert start_over(project.store, keys, "eagle3") == ["rows_0-20"]
        assert not project.store.exists(manifest_path("rows_0-20"))
        assert project.store.exists(manifest_path("rows_20-40"))
        assert backfill.tick(32) == ["rows_0-20"]


def test_with_two_drafter_families_the_window_moves_on_only_once_both_consumed_a_shard(tmp_path):
    """Issue 43: eagle3 and dflash train from one window; a shard leaves it (and may be released) only once every
    family in `drafters` recorded it."""
    from eagle3_assets.shard_window import Window, record_consumed, window_status

    project = project_at(
        tmp_path, training=TrainingSettings(mode="rolling", window_shards=2), drafters=["eagle3", "dflash"]
    )
    keys = ["rows_0-20", "rows_20-40", "rows_40-60", "rows_60-80"]
    store = project.store
    with instance_for_test() as instance:
        backfill = RollingBackfill(project, instance, keys)
        backfill.tick(0)
        assert backfill.tick(15) == ["rows_0-20", "rows_20-40"]

        # EAGLE-3 alone consumed the first shard: dflash still needs it, so it stays in the window.
        record_consumed(store, "rows_0-20", step=7, checkpoint="drafter/checkpoints/step_7")
        window = Window.read(store, keys, 2, ["eagle3", "dflash"])
        assert window.admitted() == ["rows_0-20", "rows_20-40"] and window.refusal("rows_0-20") is None
        status = window_status(store, keys, 2, ["eagle3", "dflash"])
        assert status.states["rows_0-20"] == "partly consumed" and status.consumed_at == {"rows_0-20": {"eagle3": 7}}
        shown = status.as_metadata()
        assert (shown["shards_consumed"], shown["shards_consumed_eagle3"], shown["shards_consumed_dflash"]) == (0, 1, 0)
        assert window.refusal("rows_40-60") == (
            "shard rows_40-60 is outside the rolling window: training.window_shards=2 shards may be on disk ahead of "
            "training, and the window now holds ['rows_0-20', 'rows_20-40']. It is admitted once every drafter family "
            "(eagle3, dflash) has consumed the shards before it (materialize `drafter`, `drafter_dflash`)"
        )
        assert backfill.tick(30) == ["rows_0-20", "rows_20-40"]

        # DFlash consumed it too: the window moves on by one, and extracting it again is refused naming both.
        record_consumed(
            store, "rows_0-20", step=5, checkpoint="families/dflash/drafter/checkpoints/step_5", family="dflash"
        )
        assert store.exists("families/dflash/drafter/window/rows_0-20.json")
        window = Window.read(store, keys, 2, ["eagle3", "dflash"])
        assert window.admitted() == ["rows_20-40", "rows_40-60"]
        assert window_status(store, keys, 2, ["eagle3", "dflash"]).states["rows_0-20"] == "consumed"
        assert window.refusal("rows_0-20") == (
            "shard rows_0-20 was trained (consumed by eagle3 at step 7 (drafter/checkpoints/step_7), dflash at step 5 "
            "(families/dflash/drafter/checkpoints/step_5)) and being released: extracting it again would train "
            "nothing. A run that trains from scratch clears its window records as it starts, and the window then "
            "admits the shard again"
        )
        assert backfill.tick(45) == ["rows_20-40", "rows_40-60"]


def test_in_rolling_mode_each_familys_trainer_takes_a_pool_of_its_own(tmp_path):
    """Issue 43: both families train from one window at once; in one `trainer` pool of one slot the second would
    wait for the first, which waits for the second to consume the window's shards."""
    from eagle3_assets.definitions import build_definitions

    project = project_at(tmp_path, training=TrainingSettings(mode="rolling"), drafters=["eagle3", "dflash"])
    graph = build_definitions(project).resolve_asset_graph()
    pools = {k: graph.get(AssetKey(k)).pools for k in ("drafter", "drafter_dflash", "drafter_eval_dflash")}
    assert pools == {"drafter": {"trainer"}, "drafter_dflash": {"trainer_dflash"}, "drafter_eval_dflash": {"gpu"}}
