"""The run-start sweep: every run of this code location, whoever launched it, looks after the `gpu` pool first.

Wrapped around the executor the definitions use (Dagster's default, or the Kubernetes
one), so it runs in the process that orchestrates the run, before any step waits for a
pool slot, whether the run came from the CLI, the UI or the daemon. It
1. records the run's process (`runs.record_run_process`), so a later sweep can tell
   when it died;
2. fails runs of this machine whose process is gone and frees their slots
   (`runs.sweep_dead_runs`): a killed run can no longer wedge the pool;
3. refuses a run with GPU steps when the instance has no `gpu` pool limit (a
   `$DAGSTER_HOME` without the repo's `dagster.yaml`: two runs would extract one
   shard at once), and sets the limit to the number of vLLM extraction servers when
   several are configured;
4. names the runs holding the pool when its slots are all taken, so a blocked step
   says whom it waits for;
5. tags a run `dagster/max_retries: 0` when a step is refused (`failures.refusal`) or the run
   is stopped by Ctrl-C or SIGTERM (a person, or the cluster, stopped it on purpose): the
   instance's `run_retries` must not start it again. Dagster decides when it stores the run's
   failure, from the run's tags, so the tag goes on first.
6. runs the steps of a run that can only run one after another (one asset and its checks: a shard, the drafter, an
   eval, as the daemon, a backfill and the UI launch them) in the run's own process, where Dagster's multiprocess
   executor would start an interpreter per step, importing the code location, torch and transformers again (~5 CPU-s
   each) beside a run process with nothing else to do.
`execute_in_process` (tests, `make demo`) does not use the job's executor: `make demo`
sweeps itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

from dagster import (
    DagsterEvent,
    DagsterExecutionInterruptedError,
    Executor,
    ExecutorDefinition,
)
from dagster._core.events import EngineEventData  # DagsterEvent.engine_event requires one; it is not public
from dagster._core.executor.in_process import InProcessExecutor  # what `multi_or_in_process_executor` makes
from dagster._core.executor.multiprocess import MultiprocessExecutor

from eagle3_assets.defs.failures import REFUSAL, refusal
from eagle3_assets.defs.ops.runs import (
    GPU_POOL,
    MAX_RETRIES_TAG,
    pool_holders,
    pool_limit,
    record_run_process,
    sweep_dead_runs,
)
from eagle3_assets.settings import Settings


class RunStartSweep(Executor):
    def __init__(self, inner: Executor, settings: Settings):
        self.inner = inner
        self.settings = settings

    @property
    def retries(self):  # noqa: ANN201 - Dagster's RetryMode
        return self.inner.retries

    @property
    def step_dependency_config(self):  # noqa: ANN201
        return self.inner.step_dependency_config

    def execute(self, plan_context, execution_plan) -> Iterator[DagsterEvent]:  # noqa: ANN001 - Dagster's types
        instance = plan_context.instance
        record_run_process(instance, plan_context.run_id)
        for line in sweep_dead_runs(instance):
            yield DagsterEvent.engine_event(plan_context, line, EngineEventData())
        gpu_steps = [s.key for s in execution_plan.get_all_steps_in_topo_order() if s.pool == GPU_POOL]
        if gpu_steps:
            yield from self._check_gpu_pool(plan_context, instance, gpu_steps)
        inner = self.inner
        if isinstance(inner, MultiprocessExecutor) and _one_after_another(execution_plan):
            inner = InProcessExecutor(inner.retries, inner.step_dependency_config)
        try:
            for event in inner.execute(plan_context, execution_plan):
                if _is_refusal(event):
                    _never_relaunch(instance, plan_context.run_id)
                yield event
        except (KeyboardInterrupt, DagsterExecutionInterruptedError):
            _never_relaunch(instance, plan_context.run_id)
            raise

    def _check_gpu_pool(self, plan_context, instance, gpu_steps: list[str]) -> Iterator[DagsterEvent]:  # noqa: ANN001
        servers = self.settings.vllm.server_urls
        if len(servers) > 1 and self.settings.extraction.backend == "vllm" and pool_limit(instance) != len(servers):
            instance.event_log_storage.set_concurrency_slots(GPU_POOL, len(servers))
            line = f"{GPU_POOL} pool limit set to {len(servers)}: one shard run per vLLM server"
            yield DagsterEvent.engine_event(plan_context, line, EngineEventData())
        limit = pool_limit(instance)
        if limit is None:
            _never_relaunch(instance, plan_context.run_id)
            raise refusal(
                f"steps {gpu_steps} use the {GPU_POOL} pool, but this instance has no limit for it, so two runs could "
                "extract one shard at once: copy the repo's dagster.yaml into $DAGSTER_HOME (`make install` does), "
                f"or run `dagster instance concurrency set {GPU_POOL} 1`"
            )
        holders = pool_holders(instance)
        if len(holders) >= limit:
            yield DagsterEvent.engine_event(
                plan_context,
                f"the {GPU_POOL} pool ({limit} slot(s)) is held by " + "; ".join(h.describe() for h in holders)
                + ": this run's GPU steps wait until a slot is free",
                EngineEventData(),
            )


def _one_after_another(execution_plan) -> bool:  # noqa: ANN001 - Dagster's ExecutionPlan
    """Each step to execute depends on the one before it: no two could ever run at once."""
    steps = execution_plan.get_steps_to_execute_in_topo_order()
    return all(before.key in step.get_execution_dependency_keys() for before, step in pairwise(steps))


def _is_refusal(event: DagsterEvent) -> bool:
    failure = event.step_failure_data.user_failure_data if event.is_step_failure else None
    marker = failure.metadata.get(REFUSAL) if failure is not None else None
    return marker is not None and marker.value is True


def _never_relaunch(instance, run_id: str) -> None:  # noqa: ANN001 - DagsterInstance
    instance.add_run_tags(run_id, {MAX_RETRIES_TAG: "0"})


def with_run_start_sweep(inner: ExecutorDefinition, settings: Settings) -> ExecutorDefinition:
    """`inner` with the sweep run first; same name, config and requirements."""
    create = inner.executor_creation_fn
    assert create is not None
    return ExecutorDefinition(
        name=inner.name,
        config_schema=inner.config_schema,
        requirements=inner.get_requirements,
        executor_creation_fn=lambda init_context: RunStartSweep(create(init_context), settings),
        description=inner.description,
    )
