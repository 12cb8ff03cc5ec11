"""Progress of long assets as observations: the UI plots numeric observation metadata over time."""


from collections.abc import Mapping
from typing import Any

from dagster import AssetExecutionContext, AssetObservation, MetadataValue


def to_metadata(values: Mapping[str, Any]) -> dict[str, Any]:
    """Plain values to Dagster metadata: numbers stay numbers (plotted), None becomes a note."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is None:
            out[k] = MetadataValue.text("unknown")
        elif isinstance(v, bool | int | float | str):
            out[k] = v
        else:
            out[k] = MetadataValue.json(v)
    return out


def observe(context: AssetExecutionContext, values: Mapping[str, Any]) -> None:
    partition = context.partition_key if context.has_partition_key else None
    context.log_event(AssetObservation(asset_key=context.asset_key, partition=partition, metadata=to_metadata(values)))
