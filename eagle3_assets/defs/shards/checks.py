"""Integrity of hidden-state shards: every row has a file that loads, with the right keys, shapes,
dtypes and tokens, finite and not all zero.

Each verdict is also recorded in the store beside the manifest it judged (`shard_window.py`):
rolling training, wherever it runs, trains a shard only on a passed record. A shard that rolling
training consumed (every drafter family of `settings.drafters`) and released has no files left to
check: it is reported as released, at the step that learnt it, never as bad; one some family has
not consumed yet keeps its files and is checked; one it has not extracted yet as not extracted
yet, with no verdict.
"""

from collections.abc import Iterator

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    DagsterInstance,
    MetadataValue,
    OpExecutionContext,
    Output,
    ResourceParam,
    asset_check,
    job,
    op,
)

from eagle3_assets.defs.failures import failures, refusal
from eagle3_assets.defs.provenance import Staleness
from eagle3_assets.defs.partitions import registered_shard_keys, shard_partitions
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.hidden_states.integrity import ShardCheckReport, check_shards
from eagle3_assets.project import Project
from eagle3_assets.sample_file import manifest_path
from eagle3_assets.shard_window import Consumption, consumed_by_all, write_check_record
from eagle3_assets.shards import Shard
from eagle3_assets.tokenized import TokenizedSet

CHECK_NAME = "shard_integrity"


def not_extracted_yet(project: Project, keys: list[str], consumed: dict[str, Consumption]) -> list[str]:
    """Rolling mode: the shards extraction has not finished yet (no manifest), which the window admits in turn:
    nothing to judge, and no reason to record a failed check. Offline every shard is due, and a missing one fails."""
    if not project.settings.training.rolling:
        return []
    return [k for k in keys if k not in consumed and not project.store.exists(manifest_path(k))]


def check_registered_shards(
    project: Project, keys: list[str]
) -> tuple[list[ShardCheckReport], dict[str, Consumption], list[str]]:
    """Check shards against the tokenized set and the target's shape, recording each verdict; nothing is
    re-extracted. Returns the reports, the shards skipped because training (every family) consumed them, and those
    skipped because rolling extraction has not reached them yet."""
    store = project.store
    consumed = {k: c for k, c in consumed_by_all(store, project.settings.drafters).items() if k in keys}
    pending = not_extracted_yet(project, keys, consumed)
    with failures():
        target = project.target()
        reports = check_shards(
            store,
            TokenizedSet.load(store),
            [Shard.parse(k) for k in keys if k not in consumed and k not in pending],
            hidden_size=target.hidden_size,
            aux_layer_ids=target.aux_layer_ids,
            dtype=project.settings.extraction.storage_dtype,
            model=project.model_name,
        )
    for report in reports:
        write_check_record(store, report.shard, passed=report.ok, problems=len(report.problems))
    return reports, consumed, pending


def released_check_result(record: Consumption) -> AssetCheckResult:
    steps = {"consumed_at_step": record.step} | (
        {f"consumed_at_step_{f}": r.step for f, r in record.records.items()} if len(record.families) > 1 else {}
    )
    return AssetCheckResult(
        passed=True,
        severity=AssetCheckSeverity.ERROR,
        metadata={"state": "released" if record.released else "consumed", **steps},
        description=(
            f"trained through step {record.step} ({record.records[record.families[0]].checkpoint})"
            if len(record.families) == 1
            else f"trained, {record.describe()}"
        )
        + "; its sample files are deleted",
    )


def _problems_md(reports: list[ShardCheckReport], limit: int = 50) -> str:
    lines = [f"- `{line}`" for r in reports for line in r.problem_lines()]
    more = f"\n- … and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more or "none"


@asset_check(
    asset=HIDDEN_STATES,
    name=CHECK_NAME,
    partitions_def=shard_partitions,
    blocking=True,
    description="Every row of the shard has a sound file; blocks the drafter on a bad shard.",
)
def shard_integrity(context: AssetCheckExecutionContext, project: ResourceParam[Project]) -> AssetCheckResult:
    reports, consumed, _ = check_registered_shards(project, [context.partition_key])
    if consumed:
        return released_check_result(consumed[context.partition_key])
    return shard_check_result(reports[0])


def shard_check_result(report: ShardCheckReport) -> AssetCheckResult:
    return AssetCheckResult(
        passed=report.ok,
        severity=AssetCheckSeverity.ERROR,
        metadata={**report.as_metadata(), "bad_files": MetadataValue.md(_problems_md([report]))},
    )


@op(description="Re-check every registered shard (nothing is re-extracted); each shard's check status is updated.")
def verify_all_shards(context: OpExecutionContext, project: ResourceParam[Project]) -> Iterator[AssetCheckEvaluation | Output]:
    keys = registered_shard_keys(context.instance)
    reports, consumed, pending = check_registered_shards(project, keys)
    for key, record in consumed.items():
        result = released_check_result(record)
        yield AssetCheckEvaluation(
            asset_key=HIDDEN_STATES, check_name=CHECK_NAME, passed=True, metadata=result.metadata,
            severity=AssetCheckSeverity.ERROR, partition=key, description=result.description,
        )  # fmt: skip
    for report in reports:
        result = shard_check_result(report)
        # Yielded, not logged: logged events of an op are dropped when it then fails.
        yield AssetCheckEvaluation(
            asset_key=HIDDEN_STATES,
            check_name=CHECK_NAME,
            passed=result.passed,
            metadata=result.metadata,
            severity=AssetCheckSeverity.ERROR,
            partition=report.shard,
        )
    bad = [r for r in reports if not r.ok]
    rows = sum(r.rows_checked for r in reports)
    context.log.info(
        f"verified {len(reports)} shards, {rows} rows; {len(bad)} bad; {len(consumed)} released by training "
        f"(files deleted, not checked); {len(pending)} not extracted yet"
        + (f" ({', '.join(pending)}: the rolling window admits them in turn, not checked)" if pending else "")
    )
    for report in bad:
        context.log.error(report.summary())
    if bad:
        raise refusal(
            f"{len(bad)} of {len(reports)} shards failed the integrity check: {[r.shard for r in bad]}",
            metadata={"bad_files": MetadataValue.md(_problems_md(bad))},
        )
    yield Output(
        None,
        metadata={
            "shards": len(reports), "rows": rows, "released": len(consumed),
            **({"not_extracted_yet": ", ".join(pending)} if pending else {}),
        },  # fmt: skip
    )


@job(description="Run the shard integrity check over every shard without re-extracting anything.")
def verify_shards() -> None:
    verify_all_shards()


SHARD_CHECK = AssetCheckKey(HIDDEN_STATES, CHECK_NAME)


def unusable_shards(instance: DagsterInstance, project: Project, keys: list[str]) -> dict[str, str]:
    """Shards the drafter must not train on, with the reason: incomplete, or their check did not pass."""
    infos = instance.event_log_storage.get_asset_check_partition_info([SHARD_CHECK], partition_keys=keys)
    status = {i.partition_key: i.latest_execution_status.value for i in infos}
    staleness = Staleness(project)
    bad: dict[str, str] = {}
    for key in keys:
        if not project.store.exists(manifest_path(key)):
            bad[key] = "missing or incomplete (no _SUCCESS.json)"
        elif status.get(key) != "SUCCEEDED":
            bad[key] = f"integrity check {status.get(key, 'never run').lower().replace('_', ' ')}"
        elif problem := staleness.problem("hidden_states", key):  # extracted from another target or other rows
            bad[key] = problem
    return bad
