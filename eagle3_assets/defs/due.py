"""When an asset is started: the conditions the daemon and the start command share (docs/DESIGN.md §9).

An asset is made the first time once its inputs are (`follows`, `never_made`; roots: `root_condition`), made again
when it is `stale` (`defs/provenance.py: why_due`) and every input is current (`inputs_current`), and redone when the
start command's `--from` asks (`with_redo`). Under the daemon a change whose plan is over `approval.limit_s` waits
for a person (`defs/plan.py: PlanApproved`, inside `stale`).
"""

from __future__ import annotations

from dagster import AssetKey, AutomationCondition, AutomationContext, AutomationResult

from eagle3_assets.defs.plan import PlanApproved
from eagle3_assets.defs.provenance import (
    ProvenanceChanged,
    Staleness,
    StartDoor,
    latest_materialization,
    partitions_where,
    why_due,
)
from eagle3_assets.project import Project


class AncestorDue(AutomationCondition):
    """True when anything upstream of the asset is due (`why_due`, any shard of a partitioned one): its inputs
    are about to change, so making it now would be made again. Upstream, not only its direct inputs: after a
    target change the shards must wait for `responses` and `tokenized`, not run at once on the old rows."""

    def __init__(self, project: Project, ignore: frozenset[AssetKey] = frozenset()):
        self.project, self.ignore = project, ignore
        super().__init__()

    @property
    def description(self) -> str:
        return "an upstream asset is due" + (f" ({', '.join(k.to_user_string() for k in self.ignore)} aside)" if self.ignore else "")

    @property
    def name(self) -> str:
        return "ancestor_due"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        graph, instance = context.asset_graph, context.asset_graph_view.instance
        staleness = Staleness.shared(self.project, context.evaluation_time)
        todo, seen = list(graph.get(context.key).parent_keys), set()
        while todo:
            key = todo.pop()
            if key in seen or key in self.ignore:
                continue
            seen.add(key)
            node = graph.get(key)
            partitions = (
                instance.get_dynamic_partitions(node.partitions_def.name) if node.partitions_def is not None else [None]
            )
            if any(why_due(instance, staleness, key, p) is not None for p in partitions):
                return AutomationResult(context, context.candidate_subset)
            todo.extend(node.parent_keys)
        return AutomationResult(context, context.get_empty_subset())


def inputs_current(project: Project, ignore: frozenset[AssetKey] = frozenset()) -> AutomationCondition:
    """Nothing upstream is due (but `ignore`), and no input is running: what the asset would read is what the
    settings make now."""
    return (~AncestorDue(project, ignore) & ~AutomationCondition.any_deps_in_progress()).with_label("every input current")


def root_condition(project: Project, door: StartDoor | None = None) -> AutomationCondition:
    """A root (`prompts`, `target_model`) made from other settings or outside files (an appended prompt file, another
    target) is made again. One never materialized is left to a person under the daemon; the start command makes it."""
    not_running = ~AutomationCondition.in_progress()
    condition = stale(project, not_running, door)
    if door is None:
        return condition
    return with_redo(condition | (AutomationCondition.missing() & not_running).with_label("never materialized"), door, not_running)


def stale(project: Project, ready: AutomationCondition, door: StartDoor | None) -> AutomationCondition:
    """Requested when a materialized asset becomes due (`why_due`: made from other settings or inputs) while
    `ready` holds, or when its settings changed (a new code version) and it is due: once, so a refusal is not
    requested again until something changes. What was never materialized is left to the other conditions
    (the sensor's first look starts nothing).

    Under the daemon (no `door`) with `approval.limit_s` set, `ready` holds only while the plan of what is due is
    under the limit or a person approved it (`defs/plan.py: PlanApproved`): the one place every change passes. Inside
    `newly_true`, so the approval itself starts what waited. The start command is a person's approval: it never waits."""
    if door is None and project.settings.approval.limit_s is not None:
        ready = ready & PlanApproved(project)
    due = ProvenanceChanged(project) & ~AutomationCondition.missing()
    return (
        ((due & ready).newly_true() | (AutomationCondition.code_version_changed() & due & ready))
        & ~AutomationCondition.in_progress()
    ).with_label("made from other settings or inputs")


def follows(project: Project, ready: AutomationCondition, door: StartDoor | None = None) -> AutomationCondition:
    """Made the first time once its inputs are (the daemon: once an input is updated, Dagster's `eager`; the start
    command: whenever it is missing), made again when it is `stale`, and when the start command's `--from` asks."""
    if door is None:
        first = AutomationCondition.missing() & AutomationCondition.eager() & ready
        return first.with_label("never materialized, an input updated") | stale(project, ready, door)
    return with_redo(never_made(ready) | stale(project, ready, door), door, ready)


def never_made(ready: AutomationCondition) -> AutomationCondition:
    """The start command's: missing while every input is made and none is running, and `ready` holds."""
    return (
        AutomationCondition.missing()
        & ~AutomationCondition.any_deps_missing()
        & ~AutomationCondition.any_deps_in_progress()
        & ~AutomationCondition.in_progress()
        & ready
    ).with_label("never materialized, its inputs made")


class RedoAsked(AutomationCondition):
    """True for the asset partitions `--from` asks redone that were not materialized since the command started."""

    def __init__(self, door: StartDoor):
        self.door = door
        super().__init__()

    @property
    def description(self) -> str:
        return "asked redone (--from) and not made since the command started"

    @property
    def name(self) -> str:
        return "redo_asked"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        if context.key not in self.door.redo:
            return AutomationResult(context, context.get_empty_subset())
        instance = context.asset_graph_view.instance

        def not_made_since(partition: str | None) -> bool:
            latest = latest_materialization(instance, context.key, partition)
            return latest is None or latest.timestamp < self.door.since

        return partitions_where(context, not_made_since)


def with_redo(condition: AutomationCondition, door: StartDoor, ready: AutomationCondition) -> AutomationCondition:
    """`condition`, or asked redone once every input asked redone is made again and `ready` holds."""
    if not door.redo:
        return condition
    asked = RedoAsked(door)
    again = (
        asked & ~AutomationCondition.any_deps_match(asked) & ~AutomationCondition.any_deps_in_progress()
        & ~AutomationCondition.in_progress() & ready
    )  # fmt: skip
    return condition | again.with_label("redo asked (--from)")
