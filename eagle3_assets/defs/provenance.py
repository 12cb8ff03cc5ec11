"""Provenance in Dagster's terms, and the one rule for what is due, shared by the start command and the daemon.

Each asset's `code_version` is a digest of the settings fields it reads (and its code revision), so a
changed setting shows in the UI as a new code version; each materialization carries the artifact's data
version (`DataVersion`) and its provenance as metadata, and the same record is written beside the artifact
in the store (`eagle3_assets/provenance.py`). Dagster then marks an asset stale when its code version or
an input's data version moved, and names the cause.

`Due` is the rule both doors follow: an asset (or a shard) is due when it was never materialized, or when
what the current settings and inputs would make differs from its record (`why_due`). The start command
calls `why_due` for every asset in graph order; the automation conditions hold `ProvenanceChanged`, the
same function as an `AutomationCondition`, evaluated in the code location.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    AssetSpec,
    AutomationCondition,
    AutomationContext,
    AutomationResult,
    DagsterInstance,
    DataVersion,
    EventLogRecord,
    MetadataValue,
)

from eagle3_assets.artifacts import ARTIFACTS
from eagle3_assets.crash_points import crash_point
from eagle3_assets.project import Project
from eagle3_assets.provenance import (
    Inputs,
    Provenance,
    ProvenanceError,
    Record,
    current_problem,
    data_version,
    digest,
    expected,
    read_record,
    settings_read,
    write_record,
)
from eagle3_assets.settings import Settings

MADE_FROM = "eagle3/made_from"


def code_version(asset: str, settings: Settings) -> str:
    """What Dagster compares to call an asset's code changed: the settings it reads and its code revision."""
    return f"r{ARTIFACTS[asset].code}-{digest(settings_read(asset, settings))}"


def materialized(
    project: Project, want: Provenance, version: str | None = None, *, partition: str | None = None, extra: dict | None = None
) -> dict[str, Any]:
    """Write the artifact's record (after the artifact itself is complete) and return the `MaterializeResult`
    fields that carry it: `data_version` and the provenance in the metadata. `version` is a digest of the
    artifact's content where that is cheap; else its content identity where it has one (the target's,
    `provenance.data_version`), else the provenance stands for it."""
    record = Record(want, version or data_version(want) or want.made_from, extra or {})
    crash_point(f"record:{want.asset}")
    write_record(project.store, record, partition)
    return {
        "data_version": DataVersion(record.version),
        "metadata": {
            MADE_FROM: want.made_from,
            "provenance": MetadataValue.json({"settings": want.settings, "inputs": want.inputs, "code": want.code}),
        },
    }


class Staleness:
    """One look at what the store holds against what the current settings would make (outside files read once)."""

    _shared: dict[int, tuple[object, Staleness]] = {}

    def __init__(self, project: Project):
        self.project = project
        self.inputs = Inputs(project.settings, project.store)

    @classmethod
    def shared(cls, project: Project, tick: object) -> Staleness:
        """The look the conditions of one sensor tick (its evaluation time) share; the start command takes a new
        look before each decision instead."""
        seen, look = cls._shared.get(id(project), (None, None))
        if look is None or look.project is not project or seen != tick:
            look = cls(project)
            cls._shared[id(project)] = (tick, look)
        return look

    def expected(self, asset: str, partition: str | None = None) -> Provenance:
        return expected(asset, self.inputs, partition)

    def problem(self, asset: str, partition: str | None = None) -> str | None:
        """Why the artifact is not what the settings would make now, or None."""
        return current_problem(self.project.store, self.expected(asset, partition), partition)


def latest_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None = None) -> EventLogRecord | None:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None), limit=1
    ).records
    return records[0] if records else None


def partitions_where(context: AutomationContext, holds: Callable[[str | None], bool]) -> AutomationResult:
    """The candidate asset partitions for whose partition key (None: unpartitioned) `holds` is true."""
    true = {p for p in context.candidate_subset.expensively_compute_asset_partitions() if holds(p.partition_key)}
    return AutomationResult(context, context.asset_graph_view.get_asset_subset_from_asset_partitions(context.key, true))


def why_due(instance: DagsterInstance, staleness: Staleness, key: AssetKey, partition: str | None = None) -> str | None:
    """The rule: None when `key` (or its `partition`) is materialized and its record is what the settings and
    inputs would make now; else why it must run."""
    latest = latest_materialization(instance, key, partition)
    if latest is None:
        return "never materialized"
    try:
        want = staleness.expected(key.to_user_string(), partition)
    except ProvenanceError as e:  # an outside file gone: due, and the reason says which
        return str(e)
    made_from = latest.asset_materialization.metadata.get(MADE_FROM)
    if made_from is None or made_from.value != want.made_from:
        # The store's record may be ahead of the last materialization: a shard run that failed after claiming
        # its directory; a materialization made before provenance was recorded.
        problem = current_problem(staleness.project.store, want, partition)
        return problem or "its last materialization was made from other inputs (a later run failed or was stopped)"
    return current_problem(staleness.project.store, want, partition)


class ProvenanceChanged(AutomationCondition):
    """True for the asset partitions that `why_due` finds due: never materialized, or made from other inputs."""

    def __init__(self, project: Project):
        self.project = project
        super().__init__()

    @property
    def description(self) -> str:
        return "made from other settings or inputs than the current ones (or never materialized)"

    @property
    def name(self) -> str:
        return "provenance_changed"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        staleness = Staleness.shared(self.project, context.evaluation_time)
        instance = context.asset_graph_view.instance
        return partitions_where(context, lambda p: why_due(instance, staleness, context.key, p) is not None)


@dataclass(frozen=True)
class StartDoor:
    """What the start command asks beyond the daemon's conditions (docs/DESIGN.md §9). The daemon leaves what was
    never materialized to a person, and retries a failed shard at its cron tick; the command a person runs makes
    what is missing and retries failed shards at once. `redo` (`--from`) is made again though current: each asset
    (or shard) whose latest materialization is older than `since`, the command's start."""

    redo: frozenset[AssetKey] = frozenset()
    since: float = 0.0


STALE_BECAUSE = "eagle3/stale_because"


def settings_changed(project: Project, asset: str) -> str | None:
    """Which settings the artifact in the store was made with differ from the current ones, named one by one;
    None when none do or nothing is recorded. Read as the code location loads: records only, no outside file."""
    record = read_record(project.store, asset)
    if record is None:
        return None
    now = Provenance(asset, settings_read(asset, project.settings), record.provenance.inputs, ARTIFACTS[asset].code)
    return "; ".join(record.provenance.changes(now)) or None


def with_provenance(spec: AssetSpec, project: Project) -> AssetSpec:
    """The asset as the UI shows it: its code version from the settings it reads and, when the store holds an
    artifact made with other settings, which ones (the UI's stale badge says that the code version changed)."""
    name = spec.key.to_user_string()
    changed = None if spec.partitions_def is not None else settings_changed(project, name)
    metadata = {**spec.metadata, **({STALE_BECAUSE: changed} if changed else {})}
    return spec.replace_attributes(code_version=code_version(name, project.settings), metadata=metadata)
