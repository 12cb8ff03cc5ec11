"""From prompts to the draft vocabulary: prompts, target_model, responses, tokenized, token_freq, vocab_map."""


import json
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    ResourceParam,
    asset,
)

from eagle3_assets.chat import check_template_kwargs
from eagle3_assets.defs.failures import failures, refusal
from eagle3_assets.defs.observe import observe, to_metadata
from eagle3_assets.defs.partitions import sync_shard_partitions
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.generation import open_generator
from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project
from eagle3_assets.prompts import (
    EVAL_PROMPTS_FILE,
    PROMPTS_FILE,
    decode_prompts,
    dump_prompts,
    heldout_overlap,
    parse_prompts,
)
from eagle3_assets.reasoning import detect_format
from eagle3_assets.responses import PARTS_DIR, RESPONSES_FILE, Renderer, generate_responses, made_by, read_responses
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.provenance import (
    RETRY, bytes_digest, digest, mark_replacing, read_record, sampled_version, unknown_target_files,
)
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.target import load_tokenizer, stop_token_ids
from eagle3_assets.traffic import TRAFFIC_PROMPTS_FILE, LoggedReplies, read_replies
from eagle3_assets.tokenized import (
    TOKENIZED_FILE,
    TokenizedSet,
    plan_rows,
    remove_stale_shard_dirs,
    replan_reason,
    tokenize_responses,
)
from eagle3_assets.drafter.imported_release import adopted_vocab_map, install_start_from
from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR
from eagle3_assets.leases import Lease
from eagle3_assets.vocab_map import (
    TOKEN_FREQ_FILE,
    VOCAB_MAP_FILE,
    VocabMap,
    VocabMapError,
    load_token_frequencies,
    save_token_frequencies,
    sticky_vocab_map,
    token_frequencies,
)

GROUP = "data"


def _demo_prompt_texts(project: Project) -> tuple[str, str]:
    from eagle3_assets.demo.prompts import demo_prompt_sets

    train, heldout = demo_prompt_sets(project.settings.demo)
    return (
        "".join(json.dumps(p) + "\n" for p in train),
        "".join(json.dumps(p) + "\n" for p in heldout),
    )


def _read_source(path: str, setting: str) -> str:
    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise refusal(f"{setting}: cannot read {path}: {e}") from None
    except OSError as e:  # a network error may pass
        raise Failure(f"{setting}: cannot read {path}: {e}") from None
    with failures():
        return decode_prompts(data, path)


@asset(group_name=GROUP, kinds={"jsonl"})
def prompts(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The prompt set, validated line by line and copied into the store (demo: generated here)."""
    settings, store = project.settings, project.store
    with failures():
        want = Staleness(project).expected("prompts")
    if settings.prompts is None:
        text, eval_text = _demo_prompt_texts(project)
        source = "embedded demo prompts"
    else:
        text, source, eval_text = _read_source(settings.prompts, "prompts"), settings.prompts, None
    if settings.eval_prompts:  # one's own held-out prompts, beside the demo's or one's own training prompts
        eval_text = _read_source(settings.eval_prompts, "eval_prompts")
    with failures():
        rows = parse_prompts(text, source)
        eval_rows = parse_prompts(eval_text, settings.eval_prompts or "embedded demo eval prompts") if eval_text else []
    if overlap := heldout_overlap(rows, eval_rows):
        raise refusal(
            f"eval_prompts: {len(overlap)} held-out prompt(s) are training prompts too (the same id or the same "
            f"messages): {', '.join(overlap[:5])}{' …' if len(overlap) > 5 else ''}; drafter_eval would judge the "
            "drafter on rows it trained on. Remove them from one of the two files"
        )
    with failures():
        written = dump_prompts(rows)
        mark_replacing(store, "prompts", store.url_of(PROMPTS_FILE))
        nbytes = store.write_text(PROMPTS_FILE, written)
        eval_written = dump_prompts(eval_rows) if eval_rows else ""
        if eval_rows:
            store.write_text(EVAL_PROMPTS_FILE, eval_written)
        elif store.exists(EVAL_PROMPTS_FILE):
            store.remove(EVAL_PROMPTS_FILE)  # another prompt set's held-out rows must not be evaluated
    version = materialized(project, want, bytes_digest(written.encode(), eval_written.encode()))
    preview = "\n".join(f"- `{p.id}`: {p.messages[-1]['content'][:120]}" for p in rows[:5])
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            "rows": len(rows),
            "eval_rows": len(eval_rows),
            "bytes": nbytes,
            "source": source,
            "path": store.url_of(PROMPTS_FILE),
            "mean_prompt_chars": round(sum(len(p.messages[-1]["content"]) for p in rows) / len(rows), 1),
            "preview": MetadataValue.md(preview),
        }
    )


def _demo_target_current(project: Project) -> bool:
    store = project.store
    if not (store.exists(f"{DEMO_MODEL_DIR}/config.json") and store.exists(DEMO_MODEL_SETTINGS)):
        return False
    return store.read_json(DEMO_MODEL_SETTINGS) == project.settings.demo.model_dump()


def _build_demo_target(context: AssetExecutionContext, project: Project) -> dict[str, object]:
    from eagle3_assets.demo.target import build_demo_target

    with tempfile.TemporaryDirectory(prefix="eagle3-demo-target-") as tmp:
        info = build_demo_target(Path(tmp) / "model", project.settings.demo, log=context.log.info)
        project.store.put_dir(Path(tmp) / "model", DEMO_MODEL_DIR)
    project.store.write_json(DEMO_MODEL_SETTINGS, project.settings.demo.model_dump())
    return {k: v for k, v in vars(info).items() if isinstance(v, int | float | str)}


@asset(group_name=GROUP, kinds={"pytorch"})
def target_model(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The target LLM: the configured HF directory, validated; in the demo, a small model built once and cached."""
    started = time.monotonic()
    built: dict[str, object] = {}
    if project.settings.is_demo:
        if _demo_target_current(project):
            context.log.info("demo target already built with these settings; reusing it")
        else:
            built = _build_demo_target(context, project)
    with failures():
        target = project.target()
        project.settings.check_against_target(target)
        tokenizer = load_tokenizer(target)
        reasoning = detect_format(tokenizer, project.settings.generation.reasoning)
        want = Staleness(project).expected("target_model")  # the files just validated
    spec = SampleSpec(target.hidden_size, target.aux_layer_ids, project.settings.extraction.storage_dtype)
    # Its version is its content identity; the version a record made before that had is kept beside it, so a release
    # made then is still this target's (`provenance.sampled_version`).
    earlier = {} if project.settings.is_demo else {"sampled_version": sampled_version(want, project.settings.target_model)}
    with failures():
        unknown = [] if project.settings.is_demo else unknown_target_files(project.settings.target_model)
    if unknown:
        context.log.warning(
            f"target_model: {len(unknown)} file(s) in {project.settings.target_model} are no known part of a model "
            f"and not part of its identity (a change to them redoes nothing): {', '.join(unknown[:20])}"
        )
    version = materialized(project, want, extra=earlier)
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            **to_metadata(target.as_metadata()),
            "reasoning_format": reasoning,
            "slow_tokenizer": not tokenizer.is_fast,
            "unknown_files": MetadataValue.json(unknown),
            "hidden_state_bytes_per_token": spec.hidden_bytes_per_token,
            "source": "built (demo)" if built else ("cached (demo)" if project.settings.is_demo else "configured"),
            "seconds": round(time.monotonic() - started, 2),
            **{f"demo_{k}": v for k, v in built.items() if k != "path"},
        }
    )


def responses_asset(*after: AssetKey) -> AssetsDefinition:
    """`responses`, after the inputs `after` too (`traffic_prompts`, with `traffic` set). Declared here, not added
    to the definition later: Dagster 1.13's `map_asset_specs` adds the dep to the asset graph and an input to the op,
    but does not tie that input to the asset, so a run could start `responses` before it."""

    @asset(name="responses", group_name=GROUP, deps=[prompts, target_model, *after], pool="gpu", kinds={"jsonl"})
    def responses(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
        """The target's answer to every prompt, as the token ids it generated; resumable part by part."""
        return _responses(context, project)

    return responses


def _responses(context: AssetExecutionContext, project: Project) -> MaterializeResult:
    store, settings = project.store, project.settings
    with failures():
        want = Staleness(project).expected("responses")
        store.check_writable(PARTS_DIR)  # before the model loads: on a large target that takes minutes
        # With `traffic` set, the prompts and the log's training prompts (`traffic_prompts`), each where it was.
        source = TRAFFIC_PROMPTS_FILE if settings.traffic is not None else PROMPTS_FILE
        rows = parse_prompts(store.read_text(source), store.url_of(source))
        target = project.target()
        tokenizer = load_tokenizer(target)
        renderer = Renderer(
            tokenizer,
            detect_format(tokenizer, settings.generation.reasoning),
            stop_token_ids(target),
            settings.max_seq_len,
            settings.generation.chat_template_kwargs,
            # Rows are reused by what made them, the prompt set aside: appended prompts keep the others.
            made_by=made_by(want.settings, want.inputs["target_model"], want.code),
        )
        check_template_kwargs(tokenizer, rows, settings.generation.chat_template_kwargs)  # before the model loads
        generator = open_generator(target, settings.generation, settings.vllm)
        if settings.traffic is not None:  # the target's own greedy replies, logged, stand for generating them
            generator = LoggedReplies(generator, read_replies(store), settings.generation.max_new_tokens)
        try:
            summary = generate_responses(
                store,
                rows,
                generator,
                renderer,
                settings.generation,
                on_progress=lambda p: observe(context, p.as_metadata()),
                log=context.log.info,
            )
        finally:
            generator.close()
    if summary.rows_failed:
        kept = summary.rows_failed - summary.rows_to_retry - summary.rows_given_up
        context.log.warning(
            f"responses: {summary.rows_failed} of {summary.rows} rows failed: {summary.rows_to_retry} in the engine, "
            f"retried on the next materialization (the asset stays due until they succeed), {summary.rows_given_up} "
            "the engine kept failing, not generated and not retried (what follows goes on without them), "
            f"{kept} that cannot be generated as set, not retried until the prompts or settings change; first: "
            + "; ".join(summary.first_errors)
        )
    meta = summary.as_metadata()
    # The record keeps the retry: the asset stays due (`provenance.current_problem`) until the rows succeed.
    retry = {RETRY: summary.retry} if summary.retry else {}
    version = materialized(project, want, bytes_digest(store.read_bytes(RESPONSES_FILE)), extra=retry)
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            **to_metadata({k: v for k, v in meta.items() if k not in ("first_errors", "given_up")}),
            "error_rate": round(summary.rows_failed / max(1, summary.rows), 4),
            "first_errors": MetadataValue.md("\n".join(f"- {e}" for e in summary.first_errors) or "none"),
            "given_up": MetadataValue.md("\n".join(f"- {e}" for e in summary.given_up) or "none"),
            "backend": generator.name,
            **({"rows_from_logged_replies": generator.served} if isinstance(generator, LoggedReplies) else {}),
            "reasoning_format": renderer.reasoning,
            "path": store.url_of(RESPONSES_FILE),
        }
    )


responses = responses_asset()


@asset(group_name=GROUP, deps=[responses, target_model], kinds={"safetensors"})
def tokenized(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """Each response as a training row, token-exact: prompt ids (mask 0) + generated ids (mask 1); registers shard keys."""
    store, settings = project.store, project.settings
    with failures():
        want = Staleness(project).expected("tokenized")
        tset, summary = tokenize_responses(
            read_responses(store),
            max_seq_len=settings.max_seq_len,
            overlong=settings.overlong,
            unfinished=settings.unfinished_responses,
        )
    # Rolling mode trains shard after shard in a single pass: each shard must be a uniform slice (seeded shuffle).
    seed = settings.training.seed if settings.training.rolling else None
    row_order = f"shuffled (seed {seed})" if seed is not None else "responses"
    before, previous, replan = read_record(store, "tokenized"), None, None
    if before is not None and store.exists(TOKENIZED_FILE):
        replan = replan_reason(before.provenance.changed_settings(want))
        if replan is None:
            with failures("tokenized"):
                previous = TokenizedSet.load(store)
    plan = plan_rows(tset, settings.shard_size, seed, previous, replan)
    tset, shards = plan.tset, plan.tset.shards(settings.shard_size)
    nbytes = tset.save(
        store,
        metadata={"model": project.model_name, "max_seq_len": str(settings.max_seq_len), "row_order": row_order},
    )
    keys = [s.key for s in shards]
    # Each shard's rows, digested: a shard is extracted again only when its own rows changed.
    shard_rows = {s.key: tset.rows_digest(s.start, s.end) for s in shards}
    was = before.extra.get("shard_rows", {}) if before is not None else {}
    to_extract = [k for k in keys if was.get(k) != shard_rows[k]]
    rows_version = tset.rows_digest(0, tset.num_rows)
    if shards != plan_shards(tset.num_rows, settings.shard_size):  # shards added after a short one: the cut is content
        rows_version = digest([rows_version, keys])
    version = materialized(project, want, rows_version, extra={"shard_rows": shard_rows})
    stale = sync_shard_partitions(context.instance, keys)
    removed = remove_stale_shard_dirs(store, keys)
    for note in plan.notes:
        context.log.warning(f"tokenized: {note}")
    if was and to_extract:
        context.log.warning(
            f"tokenized: {len(to_extract)} of {len(keys)} shards to extract ({sum(len(Shard.parse(k)) for k in to_extract)} "
            f"rows; new or with other rows: {', '.join(to_extract[:8])}{', …' if len(to_extract) > 8 else ''}); "
            f"{plan.kept_rows} rows kept their shard"
        )
    if stale:
        context.log.warning(f"tokenized: removed shard keys that are no longer shards of the tokenized set: {stale}")
    if removed:
        context.log.warning(
            f"tokenized: removed {len(removed)} shard directories that are no longer shards of the tokenized set "
            f"({sum(removed.values())} bytes): {', '.join(removed)}"
        )
    if summary.rows_unfinished:
        verb = "dropped" if settings.unfinished_responses == "drop" else "kept as generated (no end-of-turn added)"
        context.log.warning(
            f"{summary.rows_unfinished} responses stopped at generation.max_new_tokens and were {verb} "
            f"(unfinished_responses: {settings.unfinished_responses}); first ids: {summary.unfinished_ids}"
        )
    fields = {k: v for k, v in vars(summary).items() if k != "unfinished_ids"}
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            **to_metadata(fields),
            "unfinished_ids": MetadataValue.json(summary.unfinished_ids),
            "bytes": nbytes,
            "shards": len(keys),
            "shard_keys": MetadataValue.json(keys),
            "shards_to_extract": len(to_extract),
            "rows_kept_in_place": plan.kept_rows,
            "replanned": "; ".join(plan.notes) or "no",
            "stale_shard_dirs_removed": len(removed),
            "stale_shard_bytes_removed": sum(removed.values()),
            "row_order": row_order,
            "path": store.url_of(TOKENIZED_FILE),
        }
    )


@asset(group_name=GROUP, deps=[tokenized, target_model], kinds={"numpy"})
def token_freq(project: ResourceParam[Project]) -> MaterializeResult:
    """How often each target token appears on loss-masked (generated) positions."""
    store = project.store
    with failures("tokenized"):
        want = Staleness(project).expected("token_freq")
        vocab_size = project.target().vocab_size
        tset = TokenizedSet.load(store)
        try:
            freq = token_frequencies(tset.input_ids, tset.loss_mask, vocab_size)
        except ValueError as e:
            raise Failure(f"tokenized: {e}") from None
    nbytes = save_token_frequencies(store, freq)
    version = materialized(project, want, bytes_digest(freq.tobytes()))
    top = np.argsort(-freq, kind="stable")[:10]
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            "target_vocab": int(len(freq)),
            "distinct_tokens": int(np.count_nonzero(freq)),
            "loss_tokens": int(freq.sum()),
            "top_ids": MetadataValue.json({int(i): int(freq[i]) for i in top}),
            "bytes": nbytes,
            "path": store.url_of(TOKEN_FREQ_FILE),
        }
    )


@asset(group_name=GROUP, deps=[token_freq], kinds={"safetensors"})
def vocab_map(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """d2t/t2d (docs/DESIGN.md §3): the `draft_vocab_size` most frequent target tokens, or the previous map while it
    covers the loss tokens within `vocab_map_keep_margin` of a fresh one (`sticky_vocab_map`: appended rows then keep
    the map, its data version, and the drafter trained on it). While the release is a published drafter imported with
    `start_from` (installed here first, when the store has no release), the import's own map: the drafter continues
    it (`imported_release.adopted_vocab_map`)."""
    store, settings = project.store, project.settings
    with failures("vocab_map"):
        want = Staleness(project).expected("vocab_map")
        freq = load_token_frequencies(store)
        if settings.start_from is not None:  # under the promotion lease: one writer of the release
            with Lease(store, PROMOTION_LEASE_DIR, context.run.run_id):
                context.log.info(f"start_from: {install_start_from(store, settings, project.target()).reason}")
        try:
            previous = VocabMap.load(store) if store.exists(VOCAB_MAP_FILE) else None
        except VocabMapError:
            previous = None  # unreadable: computed afresh
        try:
            adopted = adopted_vocab_map(store, freq, settings.draft_vocab_size)
            keep = settings.vocab_map_keep_margin
            vmap, how = adopted or sticky_vocab_map(previous, freq, settings.draft_vocab_size, keep)
        except ValueError as e:
            raise Failure(f"vocab_map: {e}") from None
    context.log.info(f"vocab_map: {how}")
    nbytes = vmap.save(store)
    version = materialized(project, want, bytes_digest(vmap.d2t.tobytes(), vmap.t2d.tobytes()))
    covered = int(freq[vmap.t2d].sum())
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={
            **version["metadata"],
            "draft_vocab_size": int(len(vmap.d2t)),
            "target_vocab_size": int(len(vmap.t2d)),
            "distinct_tokens_seen": int(np.count_nonzero(freq)),
            "padding_ids": int(np.count_nonzero(freq[vmap.t2d] == 0)),
            "loss_token_coverage": round(covered / max(1, int(freq.sum())), 6),
            "map": how,
            "bytes": nbytes,
            "path": store.url_of(VOCAB_MAP_FILE),
        }
    )
