"""The `approve_plan` job: a person's approval of the plan of what is due, one click in the UI (Launchpad), the same
as `python -m eagle3_assets.start --approve` (`defs/plan.py: approve`). Here, not beside it: Dagster reads an op's
`context` annotation, which `from __future__ import annotations` would turn into a string."""

from collections.abc import Callable

from dagster import JobDefinition, OpExecutionContext, ResourceParam, job, op
from dagster._core.definitions.assets.graph.base_asset_graph import BaseAssetGraph

from eagle3_assets.defs.plan import approve
from eagle3_assets.plan import APPROVE
from eagle3_assets.project import Project


def approve_plan_job(graph: Callable[[], BaseAssetGraph]) -> JobDefinition:
    """The job over `graph()`, the asset graph of the definitions that hold it (a run launched in process has no
    repository on its context to read it from)."""

    @op(description=f"The same approval as `{APPROVE}`, of the plan of what is due as this run starts.")
    def approve_current_plan(context: OpExecutionContext, project: ResourceParam[Project]) -> None:
        for line in approve(context.instance, project, graph(), by=f"the approve_plan job (run {context.run_id})"):
            context.log.info(line)

    @job(name="approve_plan", description=f"Approve the plan of what is due (as `{APPROVE}`): the daemon starts it.")
    def approve_plan() -> None:
        approve_current_plan()

    return approve_plan
