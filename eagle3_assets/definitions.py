"""The Dagster code location: `dagster dev -w workspace.yaml` or `-m eagle3_assets.definitions`.

Settings come from $EAGLE3_CONFIG (the embedded demo without it) and artifacts live
under $EAGLE3_ROOT; bad settings fail here, at load, with the field named.
"""

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus, Definitions

from eagle3_assets.defs.data import assets as data
from eagle3_assets.defs.data import checks as data_checks
from eagle3_assets.defs.drafter import assets as drafter
from eagle3_assets.defs.ops.k8s import k8s_executor_from_environment
from eagle3_assets.defs.ops.sensors import run_failure_alert_sensor, shard_stall_sensor
from eagle3_assets.defs.shards import assets as shards
from eagle3_assets.defs.shards import checks as shard_checks
from eagle3_assets.defs.shards.automation import shard_backfill_condition
from eagle3_assets.project import Project


def build_definitions(project: Project) -> Definitions:
    hidden_states = shards.hidden_states.with_attributes(
        automation_condition=shard_backfill_condition(project.settings.extraction.backfill_cron)
    )
    return Definitions(
        assets=[
            data.prompts,
            data.target_model,
            data.responses,
            data.tokenized,
            data.token_freq,
            data.vocab_map,
            hidden_states,
            drafter.drafter,
            drafter.drafter_eval,
        ],
        asset_checks=[data_checks.vocab_map_invariant, shard_checks.shard_integrity],
        jobs=[shard_checks.verify_shards],
        sensors=[
            AutomationConditionSensorDefinition(
                "shard_backfill",
                target=AssetSelection.assets(hidden_states),
                default_status=DefaultSensorStatus.RUNNING,
                minimum_interval_seconds=60,
                description="Requests missing or failed hidden-state shards on the extraction.backfill_cron schedule.",
            ),
            shard_stall_sensor,
            run_failure_alert_sensor,
        ],
        # Dagster's default executor unless $EAGLE3_K8S_EXECUTOR names a dagster-k8s config (docs/KUBERNETES.md).
        executor=k8s_executor_from_environment(),
        resources={"project": project},
    )


defs = build_definitions(Project.from_environment())
