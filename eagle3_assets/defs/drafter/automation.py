"""When the daemon starts `drafter` and `drafter_eval` (the `pipeline` sensor).

Offline (`training.mode: offline`) the drafter trains on every shard at once, so it starts
only when every registered shard has materialized and its blocking `shard_integrity`
check passed against that materialization: a shard missing, running, or failed its check
holds it back, as the drafter would refuse to train (`unusable_shards`). Rolling
(`training.mode: rolling`) training consumes shards one by one as they pass their check,
so it starts as soon as one shard has: the rest land while it trains.
`drafter_eval` follows the drafter it evaluates, and `drafter_release` follows `drafter_eval`:
an improving retrain is released by itself, a worse one fails the release's blocking check.
"""

from __future__ import annotations

from dagster import AssetSelection, AutomationCondition

from eagle3_assets.defs.shards.assets import HIDDEN_STATES

SHARDS = AssetSelection.assets(HIDDEN_STATES)


def _check_not_passed() -> AutomationCondition:
    """A dependency partition with a blocking check that has not passed on its latest materialization."""
    return AutomationCondition.any_checks_match(~AutomationCondition.check_passed(), blocking_only=True)


def drafter_condition(rolling: bool) -> AutomationCondition:
    if rolling:
        return _rolling_drafter_condition()
    return (
        AutomationCondition.eager()
        & ~AutomationCondition.any_deps_match(_check_not_passed()).with_label("any_deps_blocking_checks_not_passed")
    ).with_label("every shard materialized and checked, the vocab map too")


def _rolling_drafter_condition() -> AutomationCondition:
    one_shard_checked = AutomationCondition.any_deps_match(
        AutomationCondition.all_checks_match(AutomationCondition.check_passed(), blocking_only=True)
    ).allow(SHARDS)
    others_ready = ~AutomationCondition.any_deps_match(
        AutomationCondition.missing() | AutomationCondition.in_progress() | _check_not_passed()
    ).ignore(SHARDS)
    # Once per absence: a failed or killed rolling run is started again when the next shard lands.
    return (
        AutomationCondition.missing()
        & (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
        & one_shard_checked.with_label("a shard materialized and passed its check")
        & others_ready.with_label("vocab map and target ready")
        & ~AutomationCondition.in_progress()
    ).with_label("rolling: the first checked shard starts training")


def drafter_eval_condition() -> AutomationCondition:
    return AutomationCondition.eager().with_label("after each new drafter")


def drafter_release_condition() -> AutomationCondition:
    return AutomationCondition.eager().with_label("after each drafter_eval")
