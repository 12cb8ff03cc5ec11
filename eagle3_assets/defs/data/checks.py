"""Checks on the data artifacts: the training rows are what the target generated; the vocab map keeps its contract."""

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, ResourceParam, asset_check

from eagle3_assets.defs.data.assets import tokenized, vocab_map
from eagle3_assets.defs.failures import failures
from eagle3_assets.drafter.imported_release import adopted_release_map
from eagle3_assets.project import Project
from eagle3_assets.reasoning import detect_format
from eagle3_assets.reasoning_coverage import first_problems, reasoning_coverage
from eagle3_assets.responses import read_responses
from eagle3_assets.target import load_tokenizer, stop_token_ids
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VocabMap, vocab_map_problems


@asset_check(
    asset=tokenized,
    name="reasoning_coverage",
    blocking=True,
    description="Every row's masked tokens are the completion the target generated, and its reasoning is in the mask",
)
def reasoning_coverage_check(project: ResourceParam[Project]) -> AssetCheckResult:
    store, settings = project.store, project.settings
    with failures():
        target = project.target()
        tokenizer = load_tokenizer(target)
        fmt = detect_format(tokenizer, settings.generation.reasoning)
        coverage = reasoning_coverage(
            TokenizedSet.load(store), read_responses(store), tokenizer, fmt, stop_token_ids(target),
            max_seq_len=settings.max_seq_len,
        )  # fmt: skip
    return AssetCheckResult(
        passed=coverage.ok,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            **coverage.as_metadata(),
            "reasoning_format": fmt,
            "first_problems": MetadataValue.md("\n".join(f"- {p}" for p in first_problems(coverage)) or "none"),
        },
    )


@asset_check(asset=vocab_map, blocking=True, description="d2t/t2d shapes, dtypes and nonzero(t2d) == d2t + arange")
def vocab_map_invariant(project: ResourceParam[Project]) -> AssetCheckResult:
    with failures():
        vmap = VocabMap.load(project.store)
        target_vocab = project.target().vocab_size
        # While the release is an import whose map is kept, the map is its own, of its size (`adopted_vocab_map`).
        adopted = adopted_release_map(project.store)
        draft = project.settings.draft_vocab_size if adopted is None else len(adopted[0].d2t)
    problems = vocab_map_problems(vmap, draft_vocab_size=draft, target_vocab_size=target_vocab)
    return AssetCheckResult(
        passed=not problems,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "problems": MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none"),
            "draft_vocab_size": int(len(vmap.d2t)),
            "target_vocab_size": int(len(vmap.t2d)),
        },
    )
