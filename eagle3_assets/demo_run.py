"""`make demo`: materialize the whole graph into $DAGSTER_HOME, phase by phase, one run per shard.

Every run is recorded in the instance, so the UI (`make ui`) shows the demo's history,
and a second `make demo` resumes: finished artifacts are rebuilt cheaply from the store
(the demo target is cached, responses and shards resume at part/sample level).
"""

from __future__ import annotations

import os
import sys
import time

from dagster import AssetKey, DagsterInstance, Definitions
from dagster._core.utils import make_new_run_id

from eagle3_assets.defs.ops.runs import process_tags, sweep_dead_runs
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.shards.assets import HIDDEN_STATES

DEMO_TAG = "eagle3/launched_by"
AFTER_SHARDS = ["drafter", "drafter_eval"]


def run_selection(
    defs: Definitions, instance: DagsterInstance, keys: list[AssetKey], partition_key: str | None = None
) -> bool:
    job = defs.resolve_implicit_global_asset_job_def()
    label = ",".join(k.to_user_string() for k in keys) + (f"[{partition_key}]" if partition_key else "")
    started = time.monotonic()
    run_id = make_new_run_id()
    # execute_in_process does not use the job's executor: the run names its process itself,
    # so a later sweep (`make demo` again, the daemon) can fail it if this process is killed.
    result = job.execute_in_process(
        instance=instance,
        asset_selection=keys,
        partition_key=partition_key,
        run_id=run_id,
        tags={DEMO_TAG: "demo", **process_tags(run_id)},
        raise_on_error=False,
    )
    status = "ok" if result.success else "FAILED"
    print(f"[demo] {label}: {status} in {time.monotonic() - started:.1f}s (run {result.run_id})", flush=True)
    return result.success


def run_graph(defs: Definitions, instance: DagsterInstance, *, through: str = "drafter_eval") -> bool:
    """Data assets, then one run per shard, then the drafter and its evaluation; False at the first failure.

    `through="hidden_states"` stops after the shards (benchmarks that train drafters of their own)."""
    graph = defs.resolve_asset_graph()
    after = [AssetKey(k) for k in AFTER_SHARDS]
    unpartitioned = [k for k in graph.get_all_asset_keys() if k != HIDDEN_STATES and k not in after]
    if not run_selection(defs, instance, unpartitioned):
        return False
    failed = [k for k in registered_shard_keys(instance) if not run_selection(defs, instance, [HIDDEN_STATES], k)]
    if failed:
        print(f"[demo] shards failed: {failed}; rerun `make demo` to resume them", file=sys.stderr)
        return False
    return through == "hidden_states" or run_selection(defs, instance, after)


def main() -> int:
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: completed work would be forgotten. Run `make demo`.", file=sys.stderr)
        return 2
    from eagle3_assets.definitions import defs

    instance = DagsterInstance.get()
    for line in sweep_dead_runs(instance):
        print(f"[demo] {line}", flush=True)
    started = time.monotonic()
    if not run_graph(defs, instance):
        return 1
    print(f"[demo] graph complete in {time.monotonic() - started:.0f}s; artifacts in $EAGLE3_ROOT, runs in $DAGSTER_HOME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
