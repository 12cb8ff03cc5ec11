"""The scheduled backfill condition, evaluated against real runs in a test instance."""

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
    RunsFilter,
    asset,
    asset_check,
    evaluate_automation_conditions,
)
from dagster._core.test_utils import instance_for_test

from eagle3_assets.defs.data.automation import data_condition
from eagle3_assets.defs.drafter.automation import drafter_condition, drafter_eval_condition, drafter_release_condition
from eagle3_assets.defs.shards.automation import shard_backfill_condition

shards = DynamicPartitionsDefinition(name="hidden_state_shards")
release = threading.Event()
failing: set[str] = set()


@asset
def tokenized() -> None:
    return None


@asset(partitions_def=shards, deps=[tokenized], automation_condition=shard_backfill_condition("*/15 * * * *"))
def hidden_states(context: AssetExecutionContext) -> None:
    # The same condition as the product's asset; the body only fails or waits where the test needs it.
    if context.partition_key in failing:
        raise RuntimeError("extraction failed")
    if context.partition_key == "rows_60-80":
        release.wait(timeout=120)


DEFS = Definitions(assets=[tokenized, hidden_states])


def run(instance, keys, partition=None):
    job = DEFS.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition, raise_on_error=False
    )


def test_each_cron_tick_requests_exactly_the_missing_and_failed_shards():
    keys = ["rows_0-20", "rows_20-40", "rows_40-60", "rows_60-80", "rows_80-100"]
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("hidden_state_shards", keys)
        assert run(instance, ["tokenized"]).success
        assert run(instance, ["hidden_states"], "rows_0-20").success
        assert run(instance, ["hidden_states"], "rows_20-40").success
        # rows_40-60 materialized once, then its rerun failed: not "missing", but failed
        assert run(instance, ["hidden_states"], "rows_40-60").success
        failing.add("rows_40-60")
        assert not run(instance, ["hidden_states"], "rows_40-60").success
        release.clear()
        in_flight = threading.Thread(target=run, args=(instance, ["hidden_states"], "rows_60-80"))
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
            requested = after_tick.get_requested_partitions(hidden_states.key)
            assert sorted(requested) == ["rows_40-60", "rows_80-100"]  # failed + missing; not done, not running
            # A shard `tokenized` registers between ticks is requested at once, alone.
            instance.add_dynamic_partitions("hidden_state_shards", ["rows_100-120"])
            registered = evaluate_automation_conditions(
                DEFS, instance, evaluation_time=start + datetime.timedelta(minutes=16), cursor=after_tick.cursor
            )
            assert sorted(registered.get_requested_partitions(hidden_states.key)) == ["rows_100-120"]
        finally:
            release.set()
            in_flight.join(timeout=60)


# --- the rest of the graph: data assets, drafter, drafter_eval ----------------------------------

bad_shards: set[str] = set()


@asset(deps=[tokenized], automation_condition=data_condition())
def vocab_map() -> None:
    return None


@asset_check(asset=hidden_states, name="shard_integrity", partitions_def=shards, blocking=True)
def shard_integrity(context: AssetCheckExecutionContext) -> AssetCheckResult:
    return AssetCheckResult(passed=context.partition_key not in bad_shards)


def graph_defs(rolling: bool) -> Definitions:
    """The product's conditions on stand-ins with the product's keys, deps and blocking shard check."""

    @asset(deps=[vocab_map, hidden_states], automation_condition=drafter_condition(rolling))
    def drafter() -> None:
        return None

    @asset(deps=[drafter], automation_condition=drafter_eval_condition())
    def drafter_eval() -> None:
        return None

    @asset(deps=[drafter_eval], automation_condition=drafter_release_condition())
    def drafter_release() -> None:
        return None

    return Definitions(
        assets=[tokenized, vocab_map, hidden_states, drafter, drafter_eval, drafter_release], asset_checks=[shard_integrity]
    )


@pytest.mark.parametrize("rolling", [False, True], ids=["offline", "rolling"])
def test_drafter_starts_when_its_shards_passed_their_checks_and_drafter_eval_and_release_follow(rolling):
    defs = graph_defs(rolling)
    job = defs.resolve_implicit_global_asset_job_def()
    clock = [datetime.datetime(2026, 12, 1, 12, 1, tzinfo=datetime.UTC)]
    cursor = [None]

    def after(keys: list[str], partition: str | None = None, bad: str | None = None) -> list[str]:
        """Materialize `keys` (the shard check fails on `bad`), then one sensor tick: what it requests."""
        bad_shards.clear()
        bad_shards.update([bad] if bad else [])
        if keys:
            job.execute_in_process(
                instance=instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition,
                raise_on_error=False,
            )  # fmt: skip
        clock[0] += datetime.timedelta(minutes=1)  # no cron tick: only these conditions fire
        result = evaluate_automation_conditions(defs, instance, evaluation_time=clock[0], cursor=cursor[0])
        cursor[0] = result.cursor
        return sorted(k.to_user_string() for k in defs.resolve_all_asset_keys() if result.get_num_requested(k))

    with instance_for_test() as instance:
        instance.add_dynamic_partitions("hidden_state_shards", ["rows_0-20", "rows_20-40", "rows_40-45"])
        assert after([]) == []  # the sensor's first look starts nothing
        assert after(["tokenized"]) == ["vocab_map"]
        assert after(["vocab_map"]) == []
        assert after(["hidden_states"], "rows_0-20", bad="rows_0-20") == []  # materialized, check failed
        first_checked = after(["hidden_states"], "rows_0-20")
        assert after(["hidden_states"], "rows_20-40") == []
        if rolling:
            # Training rolls from the first shard that passed its check; the rest land while it trains.
            assert first_checked == ["drafter", "drafter_eval", "drafter_release"]
            return
        assert first_checked == []
        assert after(["hidden_states"], "rows_40-45", bad="rows_40-45") == []  # every shard in, one failed its check
        assert after(["hidden_states"], "rows_40-45") == ["drafter", "drafter_eval", "drafter_release"]
        assert after([]) == []  # requested once
        # A retrain is evaluated and released by itself, in one run (when it is no worse: `drafter_release`'s check).
        assert after(["drafter"]) == ["drafter_eval", "drafter_release"]
        assert after(["drafter_eval", "drafter_release"]) == []


def test_in_rolling_mode_a_tick_requests_only_the_shards_the_window_admits(tmp_path):
    from eagle3_assets.defs.shards.automation import rolling_shard_backfill_condition
    from eagle3_assets.project import Project
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.shard_window import record_consumed
    from eagle3_assets.storage import ArtifactStore
    from eagle3_assets_tests.conftest import tiny_settings

    project = Project(
        tiny_settings(training=TrainingSettings(mode="rolling", window_shards=2)), ArtifactStore(tmp_path / "store")
    )

    @asset(
        name="hidden_states", partitions_def=shards, deps=[tokenized],
        automation_condition=rolling_shard_backfill_condition("*/15 * * * *", project),
    )  # fmt: skip
    def rolling() -> None:
        return None

    defs = Definitions(assets=[tokenized, rolling])
    keys = ["rows_0-20", "rows_20-40", "rows_40-60", "rows_60-80", "rows_80-100"]
    start = datetime.datetime(2026, 11, 30, 12, 1, tzinfo=datetime.UTC)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("hidden_state_shards", keys)
        assert run(instance, ["tokenized"]).success
        first = evaluate_automation_conditions(defs, instance, evaluation_time=start)
        tick = evaluate_automation_conditions(defs, instance, evaluation_time=start + datetime.timedelta(minutes=15), cursor=first.cursor)
        assert sorted(tick.get_requested_partitions(rolling.key)) == ["rows_0-20", "rows_20-40"]

        # Training consumed the first shard (its files since released): the window moves on by one.
        record_consumed(project.store, "rows_0-20", step=7, checkpoint="drafter/checkpoints/step_7")
        later = evaluate_automation_conditions(
            defs, instance, evaluation_time=start + datetime.timedelta(minutes=30), cursor=tick.cursor
        )
        assert sorted(later.get_requested_partitions(rolling.key)) == ["rows_20-40", "rows_40-60"]
