"""Hidden-state shards are dynamic partitions: their keys are known once `tokenized` counts the rows."""

from dagster import DagsterInstance, DynamicPartitionsDefinition

from eagle3_assets.errors import Refusal
from eagle3_assets.shards import Shard

shard_partitions = DynamicPartitionsDefinition(name="hidden_state_shards")


def registered_shard_keys(instance: DagsterInstance) -> list[str]:
    """The registered shard keys in row order (`rows_2000-4000` after `rows_400-800`, not before)."""
    return sorted(instance.get_dynamic_partitions(shard_partitions.name), key=Shard.parse)


def sync_shard_partitions(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """Register exactly `keys`; returns the keys removed (they no longer match the row count)."""
    registered = set(instance.get_dynamic_partitions(shard_partitions.name))
    stale = sorted(registered - set(keys), key=Shard.parse)
    for key in stale:
        instance.delete_dynamic_partition(shard_partitions.name, key)
    instance.add_dynamic_partitions(shard_partitions.name, [k for k in keys if k not in registered])
    return stale


class UnknownShardKey(Refusal):
    """A shard key a person typed that is not registered; the message lists the ones that are."""


def require_shard_keys(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """`keys`, each checked against the registered ones."""
    registered = registered_shard_keys(instance)
    unknown = [k for k in keys if k not in registered]
    if unknown:
        valid = ", ".join(registered) if registered else "none: materialize `tokenized` first"
        raise UnknownShardKey(f"unknown shard key(s) {', '.join(unknown)}; the registered shard keys are: {valid}")
    return keys
