"""`drafter` (training + export) and `drafter_eval` (served in vLLM, acceptance measured)."""

import json

from dagster import (
    AssetCheckKey,
    AssetExecutionContext,
    DagsterInstance,
    Failure,
    MaterializeResult,
    MetadataValue,
    ResourceParam,
    asset,
)

from eagle3_assets.defs.data.assets import target_model, vocab_map
from eagle3_assets.defs.failures import failures, refusal
from eagle3_assets.defs.observe import observe, to_metadata
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.defs.shards.checks import CHECK_NAME
from eagle3_assets.drafter.evaluate import evaluate_drafter
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.run import train_and_export
from eagle3_assets.drafter.tensorboard import TENSORBOARD_DIR
from eagle3_assets.project import Project
from eagle3_assets.sample_file import manifest_path

GROUP = "drafter"
SHARD_CHECK = AssetCheckKey(HIDDEN_STATES, CHECK_NAME)


def unusable_shards(instance: DagsterInstance, project: Project, keys: list[str]) -> dict[str, str]:
    """Shards the drafter must not train on, with the reason: incomplete, or their check did not pass."""
    infos = instance.event_log_storage.get_asset_check_partition_info([SHARD_CHECK], partition_keys=keys)
    status = {i.partition_key: i.latest_execution_status.value for i in infos}
    bad: dict[str, str] = {}
    for key in keys:
        if not project.store.exists(manifest_path(key)):
            bad[key] = "missing or incomplete (no _SUCCESS.json)"
        elif status.get(key) != "SUCCEEDED":
            bad[key] = f"integrity check {status.get(key, 'never run').lower().replace('_', ' ')}"
    return bad


@asset(group_name=GROUP, deps=[vocab_map, HIDDEN_STATES, target_model], pool="gpu", kinds={"pytorch"})
def drafter(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The EAGLE-3 draft model, trained on every shard (resumes from its last checkpoint), then exported."""
    store = project.store
    keys = registered_shard_keys(context.instance)
    if not keys:
        raise refusal("no hidden-state shards are registered: materialize `tokenized` first")
    bad = unusable_shards(context.instance, project, keys)
    if bad:
        listing = "; ".join(f"{k}: {why}" for k, why in bad.items())
        raise refusal(f"drafter refuses to train: {len(bad)} of {len(keys)} shards are not usable ({listing})")
    with failures():
        run = train_and_export(
            store, project.target(), project.settings, keys,
            on_metrics=lambda step, m: observe(context, {"step": step, **m}) if step % 10 == 0 else None,
            log=context.log.info,
        )  # fmt: skip
    return MaterializeResult(
        metadata={
            **to_metadata(run.summary),
            "aux_layer_ids": MetadataValue.json(run.result.aux_layer_ids),
            "export": run.export_url or "",
            "checkpoint": store.url_of(run.result.checkpoint),
            "tensorboard": store.url_of(TENSORBOARD_DIR),
        }
    )


@asset(group_name=GROUP, deps=[drafter], pool="gpu", kinds={"vllm"})
def drafter_eval(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The export served with the target in vLLM on held-out prompts: acceptance, and the features' share of it."""
    with failures():
        report = evaluate_drafter(project.store, project.target(), project.settings, log=context.log.info)
    if not report.outputs_match:
        raise Failure(
            "speculative decoding changed the greedy output (it must not): " + json.dumps(report.mismatches[:3])
        )
    return MaterializeResult(metadata=to_metadata(report.as_metadata()) | {"export": project.store.url_of(EXPORT_DIR)})
