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
from safetensors.numpy import load as st_load

from eagle3_assets.defs.data.assets import target_model, vocab_map
from eagle3_assets.defs.observe import observe, to_metadata
from eagle3_assets.defs.partitions import shard_partitions
from eagle3_assets.defs.shards.assets import hidden_states
from eagle3_assets.drafter.evaluate import DRAFTER_METRICS_FILE, evaluate_drafter
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.train import TrainingError, train_drafter
from eagle3_assets.hidden_states import manifest_path
from eagle3_assets.project import Project
from eagle3_assets.shards import Shard
from eagle3_assets.vocab_map import VOCAB_MAP_FILE

GROUP = "drafter"
SHARD_CHECK = AssetCheckKey(hidden_states.key, "shard_integrity")


def unusable_shards(instance: DagsterInstance, project: Project, keys: list[str]) -> dict[str, str]:
    """Shards the drafter must not train on, with the reason: incomplete, or their check did not pass."""
    infos = instance.event_log_storage.get_asset_check_partition_info([SHARD_CHECK], partition_keys=keys)
    status = {i.partition_key: i.latest_execution_status.value for i in infos}
    bad: dict[str, str] = {}
    for key in keys:
        if not project.store.exists(manifest_path(Shard.parse(key))):
            bad[key] = "missing or incomplete (no _SUCCESS.json)"
        elif status.get(key) != "SUCCEEDED":
            bad[key] = f"integrity check {status.get(key, 'never run').lower().replace('_', ' ')}"
    return bad


@asset(group_name=GROUP, deps=[vocab_map, hidden_states, target_model], pool="gpu", kinds={"pytorch"})
def drafter(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The EAGLE-3 draft model, trained on every shard (resumes from its last checkpoint), then exported."""
    store, settings = project.store, project.settings
    keys = sorted(context.instance.get_dynamic_partitions(shard_partitions.name), key=Shard.parse)
    if not keys:
        raise Failure("no hidden-state shards are registered: materialize `tokenized` first")
    bad = unusable_shards(context.instance, project, keys)
    if bad:
        listing = "; ".join(f"{k}: {why}" for k, why in bad.items())
        raise Failure(f"drafter refuses to train: {len(bad)} of {len(keys)} shards are not usable ({listing})")
    vmap = st_load(store.read_bytes(VOCAB_MAP_FILE))
    try:
        result = train_drafter(
            store,
            keys,
            d2t=vmap["d2t"],
            t2d=vmap["t2d"],
            target_dir=project.target_dir(),
            settings=settings.training,
            on_metrics=lambda step, m: observe(context, {"step": step, **m}) if step % 10 == 0 else None,
            log=context.log.info,
        )
    except TrainingError as e:
        raise Failure(str(e)) from None
    url = export_drafter(
        store,
        result.model.trainable_state_dict(),
        result.config,
        aux_layer_ids=result.aux_layer_ids,
        max_position_embeddings=project.target_shape().max_context or None,
    )
    summary = {
        "step": result.step,
        "resumed_from": result.resumed_from if result.resumed_from is not None else -1,
        **{f"train_{k}": round(v, 5) for k, v in result.metrics.items()},
        **{f"heldout_{k}": round(v, 5) for k, v in result.heldout.items()},
    }
    store.write_json(DRAFTER_METRICS_FILE, summary)
    return MaterializeResult(
        metadata={
            **to_metadata(summary),
            "aux_layer_ids": MetadataValue.json(result.aux_layer_ids),
            "export": url,
            "checkpoint": store.url_of(result.checkpoint),
            "tensorboard": store.url_of("drafter/tensorboard"),
        }
    )


@asset(group_name=GROUP, deps=[drafter], pool="gpu", kinds={"vllm"})
def drafter_eval(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The export served with the target in vLLM on held-out prompts: acceptance, and the features' share of it."""
    report = evaluate_drafter(project, log=context.log.info)
    if not report.outputs_match:
        raise Failure(
            "speculative decoding changed the greedy output (it must not): "
            + json.dumps(report.mismatches[:3])
        )
    return MaterializeResult(metadata=to_metadata(report.as_metadata()) | {"export": project.store.url_of(EXPORT_DIR)})
