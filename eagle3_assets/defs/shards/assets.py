"""`hidden_states`: one partition per shard of tokenized rows, extracted on the GPU node."""

from dagster import (
    AssetExecutionContext,
    Backoff,
    Failure,
    MaterializeResult,
    ResourceParam,
    RetryPolicy,
    asset,
)

from eagle3_assets.defs.data.assets import target_model, tokenized
from eagle3_assets.defs.observe import observe, to_metadata
from eagle3_assets.defs.partitions import shard_partitions
from eagle3_assets.hidden_states import ExtractorConfigError, ShardExtractionError, extract_shard
from eagle3_assets.hidden_states.extractor import open_extractor
from eagle3_assets.hidden_states.vllm_extractor import VllmExtractionError
from eagle3_assets.project import Project
from eagle3_assets.shards import Shard
from eagle3_assets.vllm_server import VllmServerError
from eagle3_assets.tokenized import TokenizedSet


@asset(
    group_name="shards",
    partitions_def=shard_partitions,
    deps=[tokenized, target_model],
    pool="gpu",
    kinds={"safetensors"},
    # No backfill_policy: the default launches one run per shard, so shards succeed,
    # fail and retry independently.
    retry_policy=RetryPolicy(max_retries=2, delay=10, backoff=Backoff.EXPONENTIAL),
)
def hidden_states(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """Aux-layer and final hidden states of every row of one shard, one safetensors file per row."""
    shard = Shard.parse(context.partition_key)
    tset = TokenizedSet.load(project.store)
    try:
        extractor = open_extractor(project.settings, project.target_dir())
    except ExtractorConfigError as e:
        raise Failure(f"shard {shard.key}: {e}") from None
    final: dict[str, float | int] = {}

    def on_progress(progress) -> None:
        final.update(progress.as_metadata())
        observe(context, final)

    try:
        result = extract_shard(
            project.store,
            tset,
            shard,
            extractor,
            project.settings.extraction,
            model_name=project.model_name,
            on_progress=on_progress,
        )
    except (ShardExtractionError, VllmServerError, VllmExtractionError) as e:
        raise Failure(f"shard {shard.key}: {e}" if shard.key not in str(e) else str(e)) from None
    finally:
        extractor.close()
    for note in result.notes:
        context.log.info(note)
    return MaterializeResult(
        metadata=to_metadata(
            {
                **final,
                **result.as_metadata(),
                "backend": extractor.backend,
                "path": project.store.url_of(f"hidden_states/{shard.key}"),
            }
        )
    )
