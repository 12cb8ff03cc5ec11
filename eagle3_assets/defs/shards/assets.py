"""`hidden_states`: one partition per shard of tokenized rows, extracted on the GPU node."""

from contextlib import ExitStack
from dataclasses import replace

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    Backoff,
    MaterializeResult,
    ResourceParam,
    RetryPolicy,
    asset,
)

from eagle3_assets.defs.data.assets import target_model, tokenized
from eagle3_assets.defs.failures import failures, refusal
from eagle3_assets.defs.observe import observe, to_metadata
from eagle3_assets.defs.partitions import registered_shard_keys, shard_partitions
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.defs.shards.server_slots import server_slot
from eagle3_assets.drafter.rolling import rolling_disk_needs
from eagle3_assets.hidden_states import open_extractor
from eagle3_assets.hidden_states.shard import ExtractionProgress, completed_shard, plan_shard, run_shard
from eagle3_assets.leases import Lease
from eagle3_assets.project import Project
from eagle3_assets.provenance import claim_dir
from eagle3_assets.sample_file import SampleSpec, shard_dir, shard_lease_dir
from eagle3_assets.settings import ExtractionSettings, Settings
from eagle3_assets.shard_window import Window
from eagle3_assets.shards import Shard
from eagle3_assets.tokenized import TokenizedSet


HIDDEN_STATES = AssetKey("hidden_states")


def _admitting_window(context: AssetExecutionContext, project: Project, shard_key: str) -> Window | None:
    """In rolling mode, the training window, which must admit the shard (else a refusal naming why); None offline."""
    settings = project.settings
    if not settings.training.rolling:
        return None
    window = Window.read(
        project.store, registered_shard_keys(context.instance), settings.training.window_shards, settings.drafters
    )
    if (refused := window.refusal(shard_key)) is not None:
        raise refusal(refused)
    return window


def _server_url(context: AssetExecutionContext, settings: Settings, shard_key: str, stack: ExitStack) -> str | None:
    """The vLLM server this shard extracts through: one of several held for the run (a slot lease, released with
    `stack`), the one named, or None (the extractor starts its own, or the backend is HF)."""
    urls = settings.vllm.extraction_urls
    if settings.extraction.backend == "vllm" and len(urls) > 1:
        lease = server_slot(context.instance, context.run_id, context.op_handle.name, urls, log=context.log.info)
        url = stack.enter_context(lease)
        context.log.info(f"shard {shard_key}: extracting through the vLLM server at {url}")
        return url
    return urls[0] if urls else None


def hidden_states_asset(extraction: ExtractionSettings) -> AssetsDefinition:
    """The asset, with `extraction.max_retries` retries of a failed shard (refusals are never retried)."""

    @asset(
        key=HIDDEN_STATES,
        group_name="shards",
        partitions_def=shard_partitions,
        deps=[tokenized, target_model],
        pool="gpu",
        kinds={"safetensors"},
        # No backfill_policy: the default launches one run per shard, so shards succeed,
        # fail and retry independently.
        retry_policy=RetryPolicy(max_retries=extraction.max_retries, delay=10, backoff=Backoff.EXPONENTIAL),
    )
    def hidden_states(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        """Aux-layer and final hidden states of every row of one shard, one safetensors file per row."""
        shard = Shard.parse(context.partition_key)
        store, settings = project.store, project.settings
        window = _admitting_window(context, project, shard.key)
        final: dict[str, float | int] = {}

        def on_progress(progress: ExtractionProgress) -> None:
            final.update(progress.as_metadata())
            observe(context, final)
            context.log.info(progress.summary())

        with failures(f"shard {shard.key}"), ExitStack() as stack:
            # One extractor per shard, whichever instance, node or command runs it (the `gpu` pool only
            # orders runs of one instance): taken before anything loads or is written, so a second one
            # refuses at once, naming this one; everything after goes through its check.
            lease = stack.enter_context(Lease(store, shard_lease_dir(shard.key), context.run_id))
            store = store.guarded(lease.check)
            owned = replace(project, store=store)
            want = Staleness(project).expected("hidden_states", shard.key)
            # Files extracted from another target, other rows or other settings are never reused.
            if causes := claim_dir(store, shard_dir(shard.key), want):
                context.log.warning(f"shard {shard.key}: its files are not reused, it is extracted again: {'; '.join(causes)}")
            target = project.target()
            tset = TokenizedSet.load(store)
            spec = SampleSpec(target.hidden_size, target.aux_layer_ids, settings.extraction.storage_dtype, project.model_name)
            # Before any model loads: a refusal (disk, context, a read-only store) costs nothing.
            # Rolling: the disk must also take the other admitted shards, the reservoir and a checkpoint, or it fills
            # before a release can free it.
            beside = (
                rolling_disk_needs(store, tset, window, shard.key, spec, settings.training.replay_reservoir_rows)
                if window is not None
                else []
            )
            plan = plan_shard(
                store, tset, shard, spec, settings.extraction, max_context=target.max_context or 1 << 30, beside=beside
            )
            for note in plan.notes:
                context.log.info(note)
            url, backend = None, "none"
            result = completed_shard(store, tset, plan)
            if result is None:
                url = _server_url(context, settings, shard.key, stack)
                extractor = open_extractor(settings, target, server_url=url, write_root=store.local_path(""))
                stack.callback(extractor.close)
                backend = extractor.backend
                result = run_shard(store, tset, plan, extractor, settings.extraction, on_progress=on_progress)
                for note in result.notes[len(plan.notes) :]:
                    context.log.info(note)
            else:
                context.log.info(f"shard {shard.key}: every row is valid and its manifest agrees; nothing to extract")
            version = materialized(owned, want, partition=shard.key)
        return MaterializeResult(
            data_version=version["data_version"],
            metadata=version["metadata"] | to_metadata(
                {
                    **final,
                    **result.as_metadata(),
                    "backend": backend,
                    "server": url or "",
                    "path": store.url_of(shard_dir(shard.key)),
                }
            )
        )

    return hidden_states
