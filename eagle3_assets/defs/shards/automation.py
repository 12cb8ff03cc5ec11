"""Scheduled backfill of missing shards.

`on_missing()`/`eager()` never retry a shard that failed or was never requested, so
at each cron tick request every shard that is missing or whose last run failed,
unless it is running or its inputs are missing (docs/DESIGN.md §7).
"""

from dagster import AutomationCondition


def shard_backfill_condition(cron: str) -> AutomationCondition:
    return (
        AutomationCondition.cron_tick_passed(cron)
        & (AutomationCondition.missing() | AutomationCondition.execution_failed())
        & ~AutomationCondition.in_progress()
        & ~AutomationCondition.any_deps_missing()
    ).with_label(f"missing or failed shards, every tick of {cron}")
