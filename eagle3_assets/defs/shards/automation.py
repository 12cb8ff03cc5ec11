"""Scheduled backfill of missing shards, within the rolling window when training rolls.

`on_missing()`/`eager()` never retry a shard that failed or was never requested, so
at each cron tick request every shard that is missing or whose last run failed,
unless it is running or its inputs are missing (docs/DESIGN.md §7). Shards that
`tokenized` registers are requested at once, not at the next tick: a started graph
carries on to its shards without waiting for the cron. In rolling mode
(`training.mode: rolling`) only the shards the window admits are requested: extraction
never runs more than `training.window_shards` shards ahead of training. The window is
read from the store, so that condition runs in the code location (`InRollingWindow`); a shard an earlier rolling
run released, cleared from the window when a new pass started, is requested again once the window admits it
(`ManifestGone`). A shard made from
other inputs (another target, other rows, other extraction settings: `defs/provenance.py`) is requested
as soon as its inputs are current.
"""

from __future__ import annotations

from dagster import AutomationCondition, AutomationContext, AutomationResult
from dagster._utils.schedules import is_valid_cron_string

from eagle3_assets.defs.due import inputs_current, stale, with_redo
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.provenance import StartDoor
from eagle3_assets.defs.shards.checks import unusable_shards
from eagle3_assets.project import Project
from eagle3_assets.sample_file import manifest_path
from eagle3_assets.settings import SettingsError, cron_problem
from eagle3_assets.shard_window import Window


class InRollingWindow(AutomationCondition):
    """True for the shards the rolling window admits now (`shard_window.Window.admitted`)."""

    def __init__(self, project: Project):
        self.project = project
        super().__init__()

    @property
    def description(self) -> str:
        return f"admitted by the rolling window ({self.project.settings.training.window_shards} shards ahead of training)"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        keys = registered_shard_keys(context.asset_graph_view.instance)
        settings = self.project.settings
        window = Window.read(self.project.store, keys, settings.training.window_shards, settings.drafters)
        return AutomationResult(context, context.candidate_subset.compute_intersection_with_partition_keys(set(window.admitted())))


class ManifestGone(AutomationCondition):
    """True for the shards with no manifest in the store: a shard a rolling run released, then cleared from the
    window when a new pass started (`shard_window.start_over`), is materialized as far as Dagster knows, yet must be
    extracted again."""

    def __init__(self, project: Project):
        self.project = project
        super().__init__()

    @property
    def description(self) -> str:
        return "no manifest in the store (released by an earlier rolling run)"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        keys = [p.partition_key for p in context.candidate_subset.expensively_compute_asset_partitions()]
        gone = {k for k in keys if not self.project.store.exists(manifest_path(k))}
        return AutomationResult(context, context.candidate_subset.compute_intersection_with_partition_keys(gone))


class ShardUnusable(AutomationCondition):
    """True for the shards the drafter could not train on (`unusable_shards`): files missing or incomplete, a check
    that did not pass, made from other inputs."""

    def __init__(self, project: Project):
        self.project = project
        super().__init__()

    @property
    def description(self) -> str:
        return "missing, incomplete, not checked sound, or made from other inputs"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        keys = [p.partition_key for p in context.candidate_subset.expensively_compute_asset_partitions()]
        bad = unusable_shards(context.asset_graph_view.instance, self.project, keys)
        return AutomationResult(context, context.candidate_subset.compute_intersection_with_partition_keys(set(bad)))


def shard_backfill_condition(cron: str, project: Project, door: StartDoor | None = None) -> AutomationCondition:
    """New or stale shards at once; missing or failed ones at each tick of `cron` (the start command: at once)."""
    # Dagster's own parser, the one `cron_tick_passed` runs it through (it has no public name): a schedule it refuses
    # fails the code location as it loads, named, not the daemon's first tick.
    if not is_valid_cron_string(cron):
        raise SettingsError(f"extraction.backfill_cron: {cron_problem(cron)}")
    triggers = _missing_or_failed(cron, project, door) | _newly_registered() | stale(project, inputs_current(project), door)
    if door is not None:
        triggers = with_redo(triggers, door, inputs_current(project))
    if not project.settings.training.rolling:
        return triggers.with_label(f"new or stale shards at once; missing or failed shards every tick of {cron}")
    # Evaluated on the window's shards only (a store read per shard): a released shard a new pass cleared from the
    # window is requested again once the window admits it. Failed runs wait for the cron, as any failed shard does.
    again = (
        InRollingWindow(project)
        & ManifestGone(project)
        & ~AutomationCondition.missing()
        & ~AutomationCondition.execution_failed()
        & ~AutomationCondition.in_progress()
    ).with_label("released by an earlier pass, admitted again")
    return ((triggers & InRollingWindow(project)) | again).with_label(
        f"new or stale shards at once, missing or failed shards every tick of {cron}; within the rolling window"
    )


def _newly_registered() -> AutomationCondition:
    # Never on the sensor's first evaluation (`since_last_handled` resets there): starting the
    # daemon does not start every missing shard.
    return (
        AutomationCondition.on_missing() & ~AutomationCondition.any_deps_in_progress() & ~AutomationCondition.in_progress()
    ).with_label("newly registered")


def _missing_or_failed(cron: str, project: Project, door: StartDoor | None) -> AutomationCondition:
    not_running = ~AutomationCondition.in_progress() & ~AutomationCondition.any_deps_missing()
    if door is not None:  # the start command: at once, once the rows they read are current
        return (ShardUnusable(project) & not_running & inputs_current(project)).with_label("unusable, at once")
    return AutomationCondition.cron_tick_passed(cron) & (AutomationCondition.missing() | AutomationCondition.execution_failed()) & not_running
