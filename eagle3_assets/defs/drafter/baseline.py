"""`release_baseline`: with `start_from` set, the published drafter it imports, installed as the release and served
alone on the held-out prompts before any export is (`eagle3_assets/drafter/release_baseline.py`). Every eval runs
after it and reads its passes: the figure the first export is judged against is this one."""

import json

from dagster import AssetExecutionContext, AssetKey, AssetsDefinition, MaterializeResult, ResourceParam, asset

from eagle3_assets.defs.data.assets import prompts, target_model
from eagle3_assets.defs.failures import failures
from eagle3_assets.defs.observe import to_metadata
from eagle3_assets.defs.ops.runs import GPU_POOL
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.drafter.imported_release import install_start_from
from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR, RELEASE_DIR
from eagle3_assets.drafter.release_baseline import serve_release_baseline
from eagle3_assets.leases import Lease
from eagle3_assets.project import Project
from eagle3_assets.provenance import bytes_digest

GROUP = "drafter"
RELEASE_BASELINE = AssetKey("release_baseline")


def release_baseline_asset(*after: AssetKey) -> AssetsDefinition:
    """`release_baseline`, after the inputs `after` too (`traffic_prompts`, with `traffic` set: its held-out split is
    served too, as every eval serves it)."""

    @asset(
        key=RELEASE_BASELINE,
        group_name=GROUP,
        deps=[prompts, target_model, *after],
        pool=GPU_POOL,
        kinds={"vllm"},
        description="The published drafter `start_from` names, installed as the release of a store with none and "
        "served alone by vLLM on the held-out prompts (plain, and at 3 and 7 speculative tokens) before any export: "
        "the baseline the release gate holds. Its passes are kept, and the first drafter_eval reads them.",
    )
    def release_baseline(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        store = project.store
        with failures():
            want = Staleness(project).expected("release_baseline")
            # Under the promotion lease: one writer of the release, its record included.
            target = project.target()
            with Lease(store, PROMOTION_LEASE_DIR, context.run.run_id) as lease:
                guarded = store.guarded(lease.check, lease.me.describe())
                context.log.info(f"start_from: {install_start_from(guarded, project.settings, target).reason}")
                baseline = serve_release_baseline(guarded, target, project.settings, log=context.log.info)
        context.log.info(f"release_baseline: {baseline.reason}")
        served = baseline.served
        figures = {} if served is None else {f"mean_acceptance_length_{k}": v for k, v in served.acceptance.items()}
        content = json.dumps({"reason": baseline.reason, "figures": baseline.figures}, sort_keys=True)
        version = materialized(project, want, bytes_digest(content.encode()))
        return MaterializeResult(
            data_version=version["data_version"],
            metadata=to_metadata({"served": served is not None, "reason": baseline.reason, **figures,
                                  "outputs_match_greedy": served is None or served.outputs_match_greedy,
                                  "release": store.url_of(RELEASE_DIR), "figures": baseline.figures or {}})
            | version["metadata"],
        )  # fmt: skip

    return release_baseline
