"""The code location: `dagster dev -w workspace.yaml` or `-m eagle3_assets.definitions`.

Settings come from $EAGLE3_CONFIG (the embedded demo without it) and artifacts live
under $EAGLE3_ROOT; bad settings fail here, at load, with the field named.
"""

import warnings

from dagster import (
    AssetSelection,
    AssetsDefinition,
    AutomationConditionSensorDefinition,
    DagsterInstance,
    DefaultSensorStatus,
    Definitions,
    SensorDefinition,
    multi_or_in_process_executor,
)

from eagle3_assets.defs.data import assets as data
from eagle3_assets.defs.data import checks as data_checks
from eagle3_assets.defs.data.automation import data_condition
from eagle3_assets.defs.data.traffic import traffic_prompts
from eagle3_assets.defs.drafter import assets as drafter
from eagle3_assets.defs.drafter.baseline import release_baseline_asset
from eagle3_assets.defs.drafter.automation import drafter_condition, drafter_eval_condition, drafter_release_condition
from eagle3_assets.defs.due import root_condition
from eagle3_assets.defs.ops.approval import approve_plan_job
from eagle3_assets.defs.ops.executor import with_run_start_sweep
from eagle3_assets.defs.ops.k8s import k8s_executor_from_environment
from eagle3_assets.defs.ops.runs import pool_limit
from eagle3_assets.defs.ops.sensors import dead_runs_sensor, run_failure_alert_sensor, shard_stall_sensor
from eagle3_assets.defs.provenance import StartDoor, with_provenance
from eagle3_assets.defs.shards import checks as shard_checks
from eagle3_assets.defs.shards.assets import hidden_states_asset
from eagle3_assets.defs.shards.automation import shard_backfill_condition
from eagle3_assets.families import family_spec
from eagle3_assets.project import Project


def build_definitions(project: Project, door: StartDoor | None = None) -> Definitions:
    """The code location's definitions; with `door`, the start command's (its conditions make what is missing)."""
    settings = project.settings
    rolling = settings.training.rolling
    cron = settings.extraction.backfill_cron
    hidden_states = hidden_states_asset(settings.extraction).with_attributes(
        automation_condition=shard_backfill_condition(cron, project, door)
    )
    # With `traffic` set, `responses` generates from the set `traffic_prompts` writes; unset, neither changes.
    traffic = [traffic_prompts] if settings.traffic is not None else []
    responses = data.responses_asset(*(a.key for a in traffic)) if traffic else data.responses
    # With `start_from` set, the published drafter is served alone first; every eval follows and reads its passes.
    baseline = [release_baseline_asset(*(a.key for a in traffic))] if settings.start_from is not None else []
    # Everything after the roots follows its inputs under the daemon's `pipeline` sensor.
    followers = [
        a.with_attributes(automation_condition=data_condition(project, door))
        for a in (*traffic, responses, data.tokenized, data.token_freq, data.vocab_map, *baseline)
    ] + [
        asset
        for family in map(family_spec, settings.drafters)
        for asset in (
            drafter.drafter_asset(settings.training, family, settings.drafters).with_attributes(
                automation_condition=drafter_condition(project, door)
            ),
            # With `traffic` set, each eval serves the traffic's held-out split too: after `traffic_prompts`.
            drafter.drafter_eval_asset(family, *(a.key for a in (*traffic, *baseline))).with_attributes(
                automation_condition=drafter_eval_condition(project, door)
            ),
        )
    ] + [
        drafter.drafter_release_asset(settings.drafters).with_attributes(
            automation_condition=drafter_release_condition(project, door)
        ),
    ]
    # A changed setting is a new code version of the assets that read it: the UI shows them stale.
    # The roots are made again when what they read changed (a new prompt file, another target).
    roots = [a.with_attributes(automation_condition=root_condition(project, door)) for a in (data.prompts, data.target_model)]
    assets = [a.map_asset_specs(lambda spec: with_provenance(spec, project)) for a in (*roots, hidden_states, *followers)]
    checks = [data_checks.reasoning_coverage_check, data_checks.vocab_map_invariant, shard_checks.shard_integrity]
    jobs = [shard_checks.verify_shards]
    # A plan over approval.limit_s waits under the daemon (`defs/due.py: stale`): one click approves it.
    approving = [approve_plan_job(lambda: defs.resolve_asset_graph())] if settings.approval.limit_s is not None else []
    # What a per-step Kubernetes config may name: every op these definitions run.
    ops = [a.op.name for a in assets] + [c.node_def.name for c in checks] + [shard_checks.verify_all_shards.name]
    ops += [n.name for j in approving for n in j.nodes]
    executor = k8s_executor_from_environment(ops) or multi_or_in_process_executor
    defs = Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs + approving,
        sensors=_sensors(hidden_states, roots, followers, rolling),
        executor=with_run_start_sweep(executor, settings),
        resources={"project": project},
    )
    return defs


def _sensors(
    hidden_states: AssetsDefinition, roots: list[AssetsDefinition], followers: list[AssetsDefinition], rolling: bool
) -> list[SensorDefinition]:
    """The daemon's sensors: the shard backfill, the pipeline that carries the graph forward, and the watchers."""
    return [
        AutomationConditionSensorDefinition(
            "shard_backfill",
            target=AssetSelection.assets(hidden_states),
            default_status=DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=60,
            description="Requests missing or failed hidden-state shards on the extraction.backfill_cron schedule, "
            "and shards made from other inputs at once" + (", within the rolling window." if rolling else "."),
            # Provenance and the window are read from the store: conditions the daemon alone cannot evaluate.
            use_user_code_server=True,
        ),
        AutomationConditionSensorDefinition(
            "pipeline",
            target=AssetSelection.assets(*roots, *followers),
            default_status=DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=30,
            description="Carries the graph forward once a person materialized `prompts` and `target_model`: each asset "
            "after its inputs and their blocking checks, `drafter` after "
            + ("the first checked shard" if rolling else "every shard passed its check")
            + ", `drafter_release` after each drafter_eval. Each again when it is made from other settings or "
            "inputs than the current ones.",
            use_user_code_server=True,
        ),
        dead_runs_sensor,
        shard_stall_sensor,
        run_failure_alert_sensor,
    ]


def _warn_without_gpu_pool_limit() -> None:
    """A $DAGSTER_HOME without the repo's dagster.yaml lets two runs extract one shard at once; runs refuse
    GPU steps there (`executor.py`), and the code location says so as it loads."""
    try:
        instance = DagsterInstance.get()
    except Exception:  # noqa: BLE001 - no $DAGSTER_HOME: CLI runs go to a temporary instance, said elsewhere
        return
    if pool_limit(instance) is None:
        warnings.warn(
            "this Dagster instance has no limit for the `gpu` pool: GPU runs will be refused. Copy the repo's "
            "dagster.yaml into $DAGSTER_HOME (`make install` does), or run `dagster instance concurrency set gpu 1`",
            stacklevel=1,
        )


defs = build_definitions(Project.from_environment())
_warn_without_gpu_pool_limit()
