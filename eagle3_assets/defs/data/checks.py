"""Checks on the data artifacts."""


from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, ResourceParam, asset_check
from safetensors.numpy import load as st_load

from eagle3_assets.defs.data.assets import vocab_map
from eagle3_assets.project import Project
from eagle3_assets.vocab_map import VOCAB_MAP_FILE, VocabMap, vocab_map_problems


@asset_check(asset=vocab_map, blocking=True, description="d2t/t2d shapes, dtypes and nonzero(t2d) == d2t + arange")
def vocab_map_invariant(project: ResourceParam[Project]) -> AssetCheckResult:
    tensors = st_load(project.store.read_bytes(VOCAB_MAP_FILE))
    target_vocab = project.target_shape().vocab_size
    problems = vocab_map_problems(
        VocabMap(tensors["d2t"], tensors["t2d"]),
        draft_vocab_size=project.settings.draft_vocab_size,
        target_vocab_size=target_vocab,
    )
    return AssetCheckResult(
        passed=not problems,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "problems": MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none"),
            "draft_vocab_size": int(len(tensors["d2t"])),
            "target_vocab_size": int(len(tensors["t2d"])),
        },
    )
