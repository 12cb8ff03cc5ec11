"""When the daemon starts `drafter` and `drafter_eval` (the `pipeline` sensor).

Offline (`training.mode: offline`) the drafter trains on every shard at once, so it starts
only when every registered shard has materialized and its blocking `shard_integrity`
check passed against that materialization: a shard missing, running, or failed its check
holds it back, as the drafter would refuse to train (`unusable_shards`). Rolling
(`training.mode: rolling`) training consumes shards one by one as they pass their check,
so it starts as soon as one shard has: the rest land while it trains.
`drafter_eval` follows the drafter it evaluates, and `drafter_release` follows each `drafter_eval`
whose blocking check passed: an improving retrain is released by itself, a worse one fails the
release's blocking check. Each runs again when it is due: made from other settings or inputs than
the current ones (`defs/provenance.py`), once every input is current.
"""

from __future__ import annotations

from dagster import AssetSelection, AutomationCondition

from eagle3_assets.defs.due import follows, inputs_current, stale, with_redo
from eagle3_assets.defs.provenance import StartDoor
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.project import Project

SHARDS = AssetSelection.assets(HIDDEN_STATES)


def _check_not_passed() -> AutomationCondition:
    """A dependency partition with a blocking check that has not passed on its latest materialization."""
    return AutomationCondition.any_checks_match(~AutomationCondition.check_passed(), blocking_only=True)


def _inputs_checked() -> AutomationCondition:
    """Every input's blocking checks passed on its latest materialization: what failed one waits, and so do its
    children (Dagster stops them only inside the run that failed it)."""
    return ~AutomationCondition.any_deps_match(_check_not_passed()).with_label("any_deps_blocking_checks_not_passed")


def drafter_condition(project: Project, door: StartDoor | None = None) -> AutomationCondition:
    if project.settings.training.rolling:
        return _rolling_drafter_condition(project, door)
    return follows(project, inputs_current(project) & _inputs_checked(), door).with_label(
        "due, with every shard current and checked, the vocab map too"
    )


def _rolling_drafter_condition(project: Project, door: StartDoor | None) -> AutomationCondition:
    one_shard_checked = AutomationCondition.any_deps_match(
        AutomationCondition.all_checks_match(AutomationCondition.check_passed(), blocking_only=True)
    ).allow(SHARDS)
    others_ready = ~AutomationCondition.any_deps_match(
        AutomationCondition.missing() | AutomationCondition.in_progress() | _check_not_passed()
    ).ignore(SHARDS)
    ready = one_shard_checked.with_label("a shard materialized and passed its check") & others_ready.with_label(
        "vocab map and target ready"
    )
    # Once per absence: a failed or killed rolling run is started again when the next shard lands. The start
    # command starts it whenever it is missing (some shards are missing while it trains: no `never_made`'s deps).
    first = (
        AutomationCondition.missing() & ready & ~AutomationCondition.in_progress()
        if door is not None
        else AutomationCondition.missing()
        & (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
        & ready
        & ~AutomationCondition.in_progress()
    )
    # Shards aside (they land while it trains), only once what it reads upstream is current.
    again = stale(project, ready & inputs_current(project, frozenset({HIDDEN_STATES})), door)
    condition = (first | again).with_label("rolling: the first checked shard starts training")
    return condition if door is None else with_redo(condition, door, ready)


def drafter_eval_condition(project: Project, door: StartDoor | None = None) -> AutomationCondition:
    return follows(project, inputs_current(project), door).with_label("after each new drafter")


def drafter_release_condition(project: Project, door: StartDoor | None = None) -> AutomationCondition:
    # An eval whose `served_is_trained` failed measured another drafter than the one trained: nothing is released on
    # its figures.
    return follows(project, inputs_current(project) & _inputs_checked(), door).with_label(
        "after each drafter_eval whose checks passed"
    )
