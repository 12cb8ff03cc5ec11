"""`drafter` (training + export), `drafter_eval` (served in vLLM, acceptance measured) and `drafter_release`
(the export meant to be served, replaced only by one that serves at least as well)."""

import json

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    ResourceParam,
    asset,
)

from eagle3_assets.defs.data.assets import target_model, vocab_map
from eagle3_assets.defs.drafter.launch import train_with_torchrun
from eagle3_assets.defs.drafter.window import WindowReporter, rolling_refusal
from eagle3_assets.defs.failures import failures, refusal
from eagle3_assets.defs.observe import to_metadata
from eagle3_assets.defs.ops.runs import GPU_POOL, TRAINER_POOL
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.defs.shards.checks import unusable_shards
from eagle3_assets.drafter.eval_report import ServedReport
from eagle3_assets.drafter.evaluate import evaluate_drafter
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR, RELEASE_DIR, decide, promote, target_version
from eagle3_assets.leases import Lease
from eagle3_assets.project import Project
from eagle3_assets.settings import TrainingSettings

GROUP = "drafter"
DRAFTER = AssetKey("drafter")
DRAFTER_RELEASE = AssetKey("drafter_release")
RELEASE_CHECK = "no_regression"


def drafter_asset(training: TrainingSettings) -> AssetsDefinition:
    """The `drafter` asset. Offline it holds the `gpu` pool like every GPU step. Rolling, it trains while
    shards are extracted, so it takes its own `trainer` pool: holding `gpu` while it waits for a shard
    would keep that shard's extraction from ever starting."""

    rolling = training.rolling

    @asset(
        key=DRAFTER,
        group_name=GROUP,
        deps=[vocab_map, HIDDEN_STATES, target_model],
        pool=TRAINER_POOL if rolling else GPU_POOL,
        kinds={"pytorch"},
    )
    def drafter(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        """The EAGLE-3 draft model, trained on every shard (resumes from its last checkpoint), then exported.
        Rolling (`training.mode: rolling`): each shard as it lands, released once a checkpoint has learnt it.

        Training runs as a torchrun job on every GPU `training.launch` names (`launch.py`)."""
        store = project.store
        with failures():
            want = Staleness(project).expected("drafter")
        keys = registered_shard_keys(context.instance)
        if not keys:
            raise refusal("no hidden-state shards are registered: materialize `tokenized` first")
        reporter: WindowReporter | None = None
        if rolling:
            if (refused := rolling_refusal(store, keys)) is not None:
                raise refused
            reporter = WindowReporter(context, store, keys, training.window_shards)
            reporter.poll(force=True)
        elif bad := unusable_shards(context.instance, project, keys):
            listing = "; ".join(f"{k}: {why}" for k, why in bad.items())
            raise refusal(f"drafter refuses to train: {len(bad)} of {len(keys)} shards are not usable ({listing})")

        with failures():
            try:
                trained = train_with_torchrun(context, project, watch=reporter.poll if reporter else lambda: None)
            finally:
                if reporter is not None:
                    reporter.poll(force=True)
        version = materialized(project, want)
        return MaterializeResult(data_version=version["data_version"], metadata={**trained.metadata, **version["metadata"]})

    return drafter


@asset(group_name=GROUP, deps=[DRAFTER], pool=GPU_POOL, kinds={"vllm"})
def drafter_eval(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The export served with the target in vLLM on held-out prompts: acceptance, and the features' share of it."""
    with failures():
        want = Staleness(project).expected("drafter_eval")
        report = evaluate_drafter(project.store, project.target(), project.settings, log=context.log.info)
    if not report.outputs_match:
        raise Failure(
            "speculative decoding changed the greedy output (it must not): " + json.dumps(report.mismatches[:3])
        )
    version = materialized(project, want)
    return MaterializeResult(
        data_version=version["data_version"],
        metadata=to_metadata(report.as_metadata()) | {"export": project.store.url_of(EXPORT_DIR)} | version["metadata"],
    )


@asset(
    key=DRAFTER_RELEASE,
    group_name=GROUP,
    deps=[drafter_eval],
    check_specs=[
        AssetCheckSpec(
            RELEASE_CHECK,
            asset=DRAFTER_RELEASE,
            blocking=True,
            description="the new export serves at least as well as the released drafter (same prompts, k and engine), "
            "greedy, and above evaluation.release_min_acceptance; else it is not released",
        )
    ],
)
def drafter_release(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The drafter meant to be served (`drafter/release/`): the new export once `drafter_eval` found it at least as
    good as the released one. When it is not, the released drafter stays and the `no_regression` check fails naming
    both figures (`drafter/release.py`)."""
    store = project.store
    with failures():
        want = Staleness(project).expected("drafter_release")
    with failures(), Lease(store, PROMOTION_LEASE_DIR, context.run.run_id):
        report = ServedReport.read(store)
        target = target_version(store)
        decision = decide(store, report, target, project.settings.evaluation.release_min_acceptance)
        if decision.promote:
            promote(store, decision, report, target)
    figures = {f"new_{k}": v for k, v in decision.candidate.items()} | {
        f"released_{k}": v for k, v in (decision.released or {}).items()
    }
    version = materialized(project, want)
    return MaterializeResult(
        data_version=version["data_version"],
        metadata=to_metadata({"promoted": decision.promote, "reason": decision.reason, **figures})
        | {"release": store.url_of(RELEASE_DIR)}
        | version["metadata"],
        check_results=[
            AssetCheckResult(
                check_name=RELEASE_CHECK,
                passed=decision.promote,
                severity=AssetCheckSeverity.ERROR,
                description=decision.reason,
                metadata=to_metadata(figures),
            )
        ],
    )
