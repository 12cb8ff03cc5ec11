"""`make demo`: materialize the whole graph into $DAGSTER_HOME, phase by phase, one run per shard.

Every run is recorded in the instance, so the UI (`make ui`) shows the demo's history,
and a second `make demo` resumes: finished artifacts are rebuilt cheaply from the store
(the demo target is cached, responses and shards resume at part/sample level).
"""

from __future__ import annotations

import os
import sys
import time

from dagster import AssetKey, DagsterInstance, DagsterRunStatus, Definitions, RunsFilter

from eagle3_assets.defs.partitions import shard_partitions
from eagle3_assets.shards import Shard

DEMO_TAG = "eagle3/launched_by"
UNPARTITIONED = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]
AFTER_SHARDS = ["drafter", "drafter_eval"]


def fail_abandoned_runs(instance: DagsterInstance) -> int:
    """Runs of an earlier demo process that was killed stay STARTED and keep their `gpu` pool slot."""
    runs = instance.get_runs(
        RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.STARTING], tags={DEMO_TAG: "demo"})
    )
    for run in runs:
        instance.report_run_failed(run, "the demo process that ran it is gone (killed or crashed)")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
    return len(runs)


def run_selection(
    defs: Definitions, instance: DagsterInstance, keys: list[str], partition_key: str | None = None
) -> bool:
    job = defs.resolve_implicit_global_asset_job_def()
    label = ",".join(keys) + (f"[{partition_key}]" if partition_key else "")
    started = time.monotonic()
    result = job.execute_in_process(
        instance=instance,
        asset_selection=[AssetKey(k) for k in keys],
        partition_key=partition_key,
        tags={DEMO_TAG: "demo"},
        raise_on_error=False,
    )
    status = "ok" if result.success else "FAILED"
    print(f"[demo] {label}: {status} in {time.monotonic() - started:.1f}s (run {result.run_id})", flush=True)
    return result.success


def run_graph(defs: Definitions, instance: DagsterInstance) -> bool:
    """Data assets, then one run per shard, then the drafter and its evaluation; False at the first failure."""
    if not run_selection(defs, instance, UNPARTITIONED):
        return False
    shard_keys = sorted(instance.get_dynamic_partitions(shard_partitions.name), key=Shard.parse)
    failed = [k for k in shard_keys if not run_selection(defs, instance, ["hidden_states"], k)]
    if failed:
        print(f"[demo] shards failed: {failed}; rerun `make demo` to resume them", file=sys.stderr)
        return False
    return run_selection(defs, instance, AFTER_SHARDS)


def main() -> int:
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: completed work would be forgotten. Run `make demo`.", file=sys.stderr)
        return 2
    from eagle3_assets.definitions import defs

    instance = DagsterInstance.get()
    abandoned = fail_abandoned_runs(instance)
    if abandoned:
        print(f"[demo] marked {abandoned} run(s) of a killed demo as failed", flush=True)
    started = time.monotonic()
    if not run_graph(defs, instance):
        return 1
    print(f"[demo] graph complete in {time.monotonic() - started:.0f}s; artifacts in $EAGLE3_ROOT, runs in $DAGSTER_HOME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
