"""Per drafter family (`settings.drafters`), made from its spec (`eagle3_assets/families.py`): its drafter (training
+ export: `drafter` for EAGLE-3, `drafter_<family>` for the others) and its eval (served in vLLM, acceptance measured:
`drafter_eval`, `drafter_eval_<family>`); then `drafter_release`, the export meant to be served, of whichever family
serves best, replaced only by one that serves at least as well."""

import json
from collections.abc import Sequence

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
from eagle3_assets.defs.ops.runs import GPU_POOL
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.defs.shards.checks import unusable_shards
from eagle3_assets.drafter.eval_report import ServedReport
from eagle3_assets.drafter.evaluate import evaluate_drafter
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.imported_release import install_start_from
from eagle3_assets.drafter.release import (
    EVALUATED_SHA256,
    Decision,
    PROMOTION_LEASE_DIR,
    RELEASE_DIR,
    choose,
    decide,
    promote,
    target_version,
)
from eagle3_assets.families import EAGLE3, FamilySpec, family_spec
from eagle3_assets.leases import Lease
from eagle3_assets.project import Project
from eagle3_assets.settings import TrainingSettings

GROUP = "drafter"
DRAFTER = AssetKey(EAGLE3.drafter_asset)
DRAFTER_RELEASE = AssetKey("drafter_release")
RELEASE_CHECK = "no_regression"
SERVED_CHECK = "served_is_trained"


def drafter_key(family: FamilySpec) -> AssetKey:
    return AssetKey(family.drafter_asset)


def eval_key(family: FamilySpec) -> AssetKey:
    return AssetKey(family.eval_asset)


def drafter_asset(
    training: TrainingSettings, family: FamilySpec = EAGLE3, families: Sequence[str] = (EAGLE3.name,)
) -> AssetsDefinition:
    """A family's drafter asset (`drafter` for EAGLE-3, `drafter_<family>` for the others). Offline it holds the
    `gpu` pool like every GPU step. Rolling, it trains while shards are extracted, so it takes a `trainer` pool of
    its family's own (`FamilySpec.trainer_pool`): holding `gpu` while it waits for a shard would keep that shard's
    extraction from ever starting, and every family (`families`, `settings.drafters`) trains from the window at once."""

    rolling = training.rolling
    name = family.drafter_asset

    @asset(
        key=drafter_key(family),
        group_name=GROUP,
        deps=[vocab_map, HIDDEN_STATES, target_model],
        pool=family.trainer_pool if rolling else GPU_POOL,
        kinds={"pytorch"},
        description=f"{family.description}, trained on every shard (resumes from its last checkpoint), then "
        "exported. Rolling (`training.mode: rolling`): each shard as it lands, released once a checkpoint of every "
        "family has learnt it. Training runs as a torchrun job on every GPU `training.launch` names (`launch.py`).",
    )
    def drafter(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        store = project.store
        with failures():
            want = Staleness(project).expected(name)
        keys = registered_shard_keys(context.instance)
        if not keys:
            raise refusal("no hidden-state shards are registered: materialize `tokenized` first")
        reporter: WindowReporter | None = None
        if rolling:
            if (refused := rolling_refusal(store, keys, family)) is not None:
                raise refused
            reporter = WindowReporter(context, store, keys, training.window_shards, families=families)
            reporter.poll(force=True)
        elif bad := unusable_shards(context.instance, project, keys):
            listing = "; ".join(f"{k}: {why}" for k, why in bad.items())
            raise refusal(f"{name} refuses to train: {len(bad)} of {len(keys)} shards are not usable ({listing})")

        with failures():
            try:
                trained = train_with_torchrun(
                    context, project, watch=reporter.poll if reporter else lambda: None, family=family
                )
            finally:
                if reporter is not None:
                    reporter.poll(force=True)
        version = materialized(project, want)
        return MaterializeResult(data_version=version["data_version"], metadata={**trained.metadata, **version["metadata"]})

    return drafter


def drafter_eval_asset(family: FamilySpec = EAGLE3, *after: AssetKey) -> AssetsDefinition:
    """A family's export served with the target in vLLM on held-out prompts (`drafter_eval`, `drafter_eval_<family>`),
    after the inputs `after` too (`traffic_prompts`, with `traffic` set: its held-out split is served too). Declared
    here, as `responses_asset` declares its own (`defs/data/assets.py`)."""
    name = family.eval_asset

    @asset(
        key=eval_key(family),
        group_name=GROUP,
        deps=[drafter_key(family), *after],
        pool=GPU_POOL,
        kinds={"vllm"},
        check_specs=[
            AssetCheckSpec(
                SERVED_CHECK,
                asset=eval_key(family),
                blocking=True,
                description="vLLM's acceptance per draft position at each k is the trained drafter's, replayed over the "
                "same greedy answers, within served_replay.REPLAY_TOLERANCE; else it names the first position that "
                "parts and what the export tells vLLM otherwise than the drafter trained with",
            )
        ],
        description=f"The {family.name} export served with the target in vLLM on held-out prompts: acceptance at 3 and 7 "
        "speculative tokens, and the features' share of it; with `traffic`, on the traffic's held-out split and the "
        "original held-out prompts each (`prompt_sets`). With `start_from`, after `release_baseline`, which installs the "
        "published drafter as the release and serves it first: its passes are read here, the bar the gate holds.",
    )
    def drafter_eval(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        with failures():
            want = Staleness(project).expected(name)
            if project.settings.start_from is not None:  # under the promotion lease: one writer of the release
                with Lease(project.store, PROMOTION_LEASE_DIR, context.run.run_id):
                    started = install_start_from(project.store, project.settings, project.target())
                context.log.info(f"start_from: {started.reason}")
            report = evaluate_drafter(
                project.store, project.target(), project.settings, log=context.log.info, family=family
            )
        if not report.outputs_match:
            raise Failure(
                "speculative decoding changed the greedy output (it must not): " + json.dumps(report.mismatches[:3])
            )
        # The digest ties the record to this report: a promotion on it keeps which inputs it was made from
        # (`release.promote`), so the release it made never makes this eval due.
        version = materialized(project, want, extra={EVALUATED_SHA256: report.export_sha256})
        export = project.store.child(family.root).url_of(EXPORT_DIR)
        return MaterializeResult(
            data_version=version["data_version"],
            metadata=to_metadata(report.as_metadata()) | {"family": family.name, "export": export} | version["metadata"],
            check_results=[
                AssetCheckResult(
                    check_name=SERVED_CHECK,
                    passed=report.served_is_trained,
                    severity=AssetCheckSeverity.ERROR,
                    description="; ".join(c.describe() for c in report.replay),
                    metadata={f"parted_at_k{c.k}": -1 if c.parted_at is None else c.parted_at for c in report.replay},
                )
            ],
        )

    return drafter_eval


def release_figures(decisions: dict[str, Decision], chosen: str | None) -> dict[str, float]:
    """The figures `drafter_release` shows: the chosen family's (or the first's) beside the released drafter's, and each
    family's. With `traffic`, new_/released_ are those on the traffic's held-out prompts, new_original_/
    released_original_ those on the original ones."""
    shown = decisions[chosen] if chosen is not None else next(iter(decisions.values()))
    figures = {f"new_{k}": v for k, v in shown.candidate.items()} | {
        f"released_{k}": v for k, v in (shown.released or {}).items()
    }
    figures |= {f"new_original_{k}": v for k, v in (shown.candidate_original or {}).items()} | {
        f"released_original_{k}": v for k, v in (shown.released_original or {}).items()
    }
    for f, d in decisions.items():  # each family's served figures, beside the released one's
        figures |= {f"{f}_{k}": v for k, v in d.candidate.items()}
    return figures


def drafter_release_asset(families: list[str]) -> AssetsDefinition:
    """`drafter_release`, after the eval of every family the settings train."""

    @asset(
        key=DRAFTER_RELEASE,
        group_name=GROUP,
        deps=[eval_key(family_spec(f)) for f in families],
        check_specs=[
            AssetCheckSpec(
                RELEASE_CHECK,
                asset=DRAFTER_RELEASE,
                blocking=True,
                description="a new export serves at least as well as the released drafter (same prompts, k and "
                "engine; overall and in each context bin of evaluation.min_prompts_per_bin prompts or more), greedy, "
                "and above evaluation.release_min_acceptance, and best of the families; else it is not released. With "
                "`traffic`: it beats the released drafter on the traffic's held-out prompts and serves within "
                "evaluation.original_regression_margin of it on the original held-out prompts",
            )
        ],
    )
    def drafter_release(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        """The drafter meant to be served (`drafter/release/`), of whichever family serves best: a new export once
        its `drafter_eval` found it at least as good as the released one and better than the other families'. When
        none is, the released drafter stays and the `no_regression` check fails naming the figures
        (`drafter/release.py`)."""
        store = project.store
        with failures():
            want = Staleness(project).expected("drafter_release")
        with failures(), Lease(store, PROMOTION_LEASE_DIR, context.run.run_id) as lease:
            # Every write of the release, its settling included, checks the lease first: a promoter paused past it
            # publishes nothing over the release the one that took over made.
            store = store.guarded(lease.check, lease.me.describe())
            store.remove_temporaries(RELEASE_DIR.rsplit("/", 1)[0], "release")  # a killed promotion's copies
            target = target_version(store)
            sources = {f: store.child(family_spec(f).root) for f in families}
            reports = {f: ServedReport.read(out) for f, out in sources.items()}
            evaluation = project.settings.evaluation
            # With `traffic` set, judged on both prompt sets (`release.traffic_decision`).
            margin = evaluation.original_regression_margin if project.settings.traffic is not None else None
            decisions = {
                f: decide(store, reports[f], target, evaluation.release_min_acceptance, sources[f],
                          evaluation.min_prompts_per_bin, family=f,
                          approved_target=evaluation.replace_release_for_target, original_margin=margin)
                for f in families
            }  # fmt: skip
            chosen, reasons = choose(decisions)
            if chosen is not None:
                promote(store, decisions[chosen], reports[chosen], target, sources[chosen], chosen)
        figures = release_figures(decisions, chosen)
        reason = (decisions[chosen].reason if chosen is not None else "") + "".join(
            f"; {why}" for why in reasons.values()
        )
        reason = reason.removeprefix("; ")
        version = materialized(project, want)
        return MaterializeResult(
            data_version=version["data_version"],
            # Promoted: the release changed; the check passes also when the release, the best, stays.
            metadata=to_metadata({"promoted": chosen is not None and not decisions[chosen].released_now,
                                  "family": chosen or "", "reason": reason, **figures})
            | {"release": store.url_of(RELEASE_DIR)}
            | version["metadata"],
            check_results=[
                AssetCheckResult(
                    check_name=RELEASE_CHECK,
                    passed=chosen is not None,
                    severity=AssetCheckSeverity.ERROR,
                    description=reason,
                    metadata=to_metadata(figures),
                )
            ],
        )

    return drafter_release
