"""Integrity of hidden-state shards: every row has a file that loads, with the right keys, shapes,
dtypes and tokens, finite and not all zero."""

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    MetadataValue,
    ResourceParam,
    asset_check,
)

from eagle3_assets.defs.partitions import shard_partitions
from eagle3_assets.defs.shards.assets import hidden_states
from eagle3_assets.hidden_states import ShardCheckReport, check_shards
from eagle3_assets.project import Project
from eagle3_assets.shards import Shard
from eagle3_assets.tokenized import TokenizedSet


def check_registered_shards(project: Project, keys: list[str]) -> list[ShardCheckReport]:
    """Check shards against the tokenized set and the target's shape; nothing is re-extracted."""
    shape = project.target_shape()
    return check_shards(
        project.store,
        TokenizedSet.load(project.store),
        [Shard.parse(k) for k in keys],
        hidden_size=shape.hidden_size,
        aux_layer_ids=project.settings.resolved_aux_layer_ids(shape.num_layers),
        dtype=project.settings.extraction.storage_dtype,
        model=project.model_name,
    )


def _problems_md(reports: list[ShardCheckReport], limit: int = 50) -> str:
    lines = [f"- `{name}`: {why}" for r in reports for name, why in sorted(r.problems.items())]
    more = f"\n- … and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more or "none"


@asset_check(
    asset=hidden_states,
    partitions_def=shard_partitions,
    blocking=True,
    description="Every row of the shard has a sound file; blocks the drafter on a bad shard.",
)
def shard_integrity(context: AssetCheckExecutionContext, project: ResourceParam[Project]) -> AssetCheckResult:
    (report,) = check_registered_shards(project, [context.partition_key])
    return AssetCheckResult(
        passed=report.ok,
        severity=AssetCheckSeverity.ERROR,
        metadata={**report.as_metadata(), "bad_files": MetadataValue.md(_problems_md([report]))},
    )


@asset_check(
    asset=hidden_states,
    description="The integrity check over every registered shard, without re-extracting (job `verify_shards`).",
)
def all_shards_integrity(context: AssetCheckExecutionContext, project: ResourceParam[Project]) -> AssetCheckResult:
    keys = sorted(context.instance.get_dynamic_partitions(shard_partitions.name), key=lambda k: Shard.parse(k))
    reports = check_registered_shards(project, keys)
    bad = [r.shard for r in reports if not r.ok]
    return AssetCheckResult(
        passed=not bad,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "shards": len(reports),
            "shards_bad": len(bad),
            "bad_shards": MetadataValue.json(bad),
            "rows_checked": sum(r.rows_checked for r in reports),
            "bad_files": MetadataValue.md(_problems_md(reports)),
        },
    )
