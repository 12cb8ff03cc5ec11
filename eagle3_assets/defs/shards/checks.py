"""Integrity of hidden-state shards: every row has a file that loads, with the right keys, shapes,
dtypes and tokens, finite and not all zero."""

from collections.abc import Iterator

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    Failure,
    MetadataValue,
    OpExecutionContext,
    ResourceParam,
    asset_check,
    job,
    op,
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
    return shard_check_result(report)


def shard_check_result(report: ShardCheckReport) -> AssetCheckResult:
    return AssetCheckResult(
        passed=report.ok,
        severity=AssetCheckSeverity.ERROR,
        metadata={**report.as_metadata(), "bad_files": MetadataValue.md(_problems_md([report]))},
    )


@op(description="Re-check every registered shard (nothing is re-extracted); each shard's check status is updated.")
def verify_all_shards(context: OpExecutionContext, project: ResourceParam[Project]) -> Iterator[AssetCheckEvaluation]:
    keys = sorted(context.instance.get_dynamic_partitions(shard_partitions.name), key=Shard.parse)
    reports = check_registered_shards(project, keys)
    for report in reports:
        result = shard_check_result(report)
        # Yielded, not logged: logged events of an op are dropped when it then fails.
        yield AssetCheckEvaluation(
            asset_key=hidden_states.key,
            check_name=shard_integrity.check_key.name,
            passed=result.passed,
            metadata=result.metadata,
            severity=AssetCheckSeverity.ERROR,
            partition=report.shard,
        )
    bad = [r for r in reports if not r.ok]
    context.log.info(f"verified {len(reports)} shards, {sum(r.rows_checked for r in reports)} rows; {len(bad)} bad")
    if bad:
        raise Failure(
            f"{len(bad)} of {len(reports)} shards failed the integrity check: {[r.shard for r in bad]}",
            metadata={"bad_files": MetadataValue.md(_problems_md(bad))},
        )


@job(description="Run the shard integrity check over every shard without re-extracting anything.")
def verify_shards() -> None:
    verify_all_shards()
