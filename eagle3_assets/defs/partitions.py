"""Hidden-state shards are dynamic partitions: their keys are known once `tokenized` counts the rows."""

from dagster import DynamicPartitionsDefinition

shard_partitions = DynamicPartitionsDefinition(name="hidden_state_shards")
