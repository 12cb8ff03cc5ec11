"""`traffic_prompts`: the prompts of a request log (`traffic` settings), judged by the target's chat template, split
into training and held-out prompts, and whose logged replies stand for generation (`eagle3_assets/traffic.py`).

In the graph only with `traffic` set: then `responses` generates from the set it writes, and appending to the log
makes it due (its record holds the log's digest), and so `responses` for the new rows, and the drafter continuing
the release, under the plan and its approval like any other change."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, ResourceParam, asset

from eagle3_assets.defs.data.assets import GROUP, prompts, target_model
from eagle3_assets.defs.failures import failures
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.project import Project
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, PROMPTS_FILE, Prompt, parse_prompts
from eagle3_assets.provenance import bytes_digest
from eagle3_assets.target import load_tokenizer
from eagle3_assets.traffic import (
    TRAFFIC_HELDOUT_FILE,
    TRAFFIC_PROMPTS_FILE,
    TRAFFIC_REPORT_FILE,
    TrafficBuild,
    TrafficResult,
    kept_lines,
    write_traffic,
)
from eagle3_assets.traffic_log import read_log

SHOWN = 20  # dropped lines and rows listed in the metadata; the report holds them all


@asset(group_name=GROUP, deps=[prompts, target_model], kinds={"jsonl"})
def traffic_prompts(context: AssetExecutionContext, project: ResourceParam[Project]) -> MaterializeResult:
    """The request log's prompts: de-duplicated, rendered by the target's template, held out by a hash of each prompt;
    appended to the prompt set `responses` generates from, each row saying whose reply it gets."""
    settings, store = project.settings, project.store
    traffic = settings.traffic
    assert traffic is not None, "traffic_prompts is in the graph only with `traffic` set"
    with failures():
        want = Staleness(project).expected("traffic_prompts")
        base = parse_prompts(store.read_text(PROMPTS_FILE), store.url_of(PROMPTS_FILE))
        heldout = (
            parse_prompts(store.read_text(EVAL_PROMPTS_FILE), store.url_of(EVAL_PROMPTS_FILE))
            if store.exists(EVAL_PROMPTS_FILE) else []
        )  # fmt: skip
        target = project.target()
        calls, dropped, lines, files = read_log(traffic.log)
        judge = TrafficBuild(
            load_tokenizer(target), target.vocab_size, settings.generation.chat_template_kwargs, settings.max_seq_len,
            traffic.heldout_share, traffic.model, settings.generation.temperature,
        )  # fmt: skip
        result = judge.build(calls, dropped, lines, files, base, heldout, kept_lines(store))
        prompt_set, written = write_traffic(store, result, base)
    if result.dropped:
        context.log.warning(
            f"traffic_prompts: {len(result.dropped)} of {lines} lines dropped; first: "
            + "; ".join(str(d) for d in result.dropped[:5])
        )
    counts = result.reply_counts()
    context.log.info(
        f"traffic_prompts: {len(result.train)} training and {len(result.heldout)} held-out prompts from {lines} lines "
        f"of {len(files)} file(s); replies: {counts or 'none'}"
    )
    version = materialized(project, want, bytes_digest(written))
    return MaterializeResult(
        data_version=version["data_version"],
        metadata={**version["metadata"], **_metadata(result, prompt_set, counts), "log": traffic.log,
                  "path": store.url_of(TRAFFIC_PROMPTS_FILE), "heldout_path": store.url_of(TRAFFIC_HELDOUT_FILE),
                  "report": store.url_of(TRAFFIC_REPORT_FILE)},
    )  # fmt: skip


def _metadata(result: TrafficResult, prompt_set: list[Prompt], counts: dict[str, int]) -> dict[str, object]:
    rows = "\n".join(
        f"- `{r['id']}` ({r['where']}): {r['split']}" + (f", {r['reply']}: {r['why']}" if "reply" in r else "")
        for r in (row.as_report() for row in result.rows[:SHOWN])
    )
    return {
        "files": len(result.files),
        "lines": result.lines,
        "rows_train": len(result.train),
        "rows_heldout": len(result.heldout),
        "rows_dropped": len(result.dropped),
        "prompt_set_rows": len(prompt_set),
        "replies_logged": counts.get("logged", 0),
        "replies_generated": sum(n for k, n in counts.items() if k != "logged"),
        "reply_sources": MetadataValue.json(counts),
        "dropped": MetadataValue.md("\n".join(f"- {d}" for d in result.dropped[:SHOWN]) or "none"),
        "rows": MetadataValue.md(rows or "none"),
    }
