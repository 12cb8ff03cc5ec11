"""Hidden-state shards: per-sample files, extraction backends, shard extraction and its integrity check.

The HF backend (`hf_extractor.HFExtractor`) is not imported here: it pulls in transformers,
which the checks and the data loader do not need.
"""

from eagle3_assets.hidden_states.extractor import (
    ExtractedSample,
    ExtractionRequest,
    ExtractorConfigError,
    HiddenStateExtractor,
    extract_in_order,
    open_extractor,
)
from eagle3_assets.hidden_states.integrity import ShardCheckReport, check_shard, check_shards
from eagle3_assets.hidden_states.sample_file import (
    FORMAT,
    SampleSpec,
    manifest_path,
    sample_path,
    shard_dir,
)
from eagle3_assets.hidden_states.shard import (
    ExtractionProgress,
    InsufficientSpaceError,
    RowTooLongError,
    ShardExtractionError,
    ShardResult,
    StoreNotWritableError,
    extract_shard,
)

__all__ = [
    "FORMAT",
    "ExtractedSample",
    "ExtractionProgress",
    "ExtractionRequest",
    "ExtractorConfigError",
    "HiddenStateExtractor",
    "InsufficientSpaceError",
    "RowTooLongError",
    "SampleSpec",
    "ShardCheckReport",
    "ShardExtractionError",
    "ShardResult",
    "StoreNotWritableError",
    "check_shard",
    "check_shards",
    "extract_in_order",
    "extract_shard",
    "manifest_path",
    "open_extractor",
    "sample_path",
    "shard_dir",
]
