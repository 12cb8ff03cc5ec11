"""Hidden-state shards: the sample format, extraction backends, shard extraction and its integrity check.

sample_file.py     the per-sample file format (the one definition of it)
base.py            the backend interface
hf_extractor.py    the target loaded in this process (transformers)
vllm_extractor.py  a vLLM server running the extract_hidden_states method
shard.py           extract_shard: preflight, sample-level resume, progress, manifest
integrity.py       the per-row verdict and the shard check

`open_extractor` picks the backend the settings name; the backends' own modules (and
transformers or the HTTP client they pull in) are imported only when one is opened.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.hidden_states.base import (
    ExtractedSample,
    ExtractionRequest,
    ExtractorConfigError,
    ExtractorError,
    HiddenStateExtractor,
    WrittenSample,
)
from eagle3_assets.settings import Settings
from eagle3_assets.target import TargetModel

__all__ = [
    "ExtractedSample",
    "ExtractionRequest",
    "ExtractorConfigError",
    "ExtractorError",
    "HiddenStateExtractor",
    "WrittenSample",
    "extract_in_order",
    "open_extractor",
]


def open_extractor(
    settings: Settings,
    target: TargetModel,
    *,
    device: str = "auto",
    server_url: str | None = None,
    write_root: Path | None = None,
) -> HiddenStateExtractor:
    """The backend `settings.extraction.backend` names, for `target` and its resolved aux layer ids.

    The vLLM backend uses the server at `server_url` (one of `vllm.server_urls`, leased by the
    caller) or `vllm.server_url`, or starts one that its `close()` stops and that may write
    sample files under `write_root` (the local artifact store).
    """
    backend = settings.extraction.backend
    if backend == "vllm":
        from eagle3_assets.hidden_states.vllm_extractor import VLLMExtractor

        return VLLMExtractor(target, settings.vllm, server_url=server_url, write_root=write_root)
    if backend == "hf":
        from eagle3_assets.hidden_states.hf_extractor import HFExtractor

        return HFExtractor(target, batch_tokens=settings.extraction.batch_tokens, device=device)
    raise ExtractorConfigError(f"extraction.backend: {backend!r} is not one of 'hf', 'vllm'")


def extract_in_order(extractor: HiddenStateExtractor, requests: list[ExtractionRequest]) -> list[ExtractedSample]:
    """All samples, in the order of `requests`, as tensors (holds them all in memory: small inputs only)."""
    by_row = {}
    for s in extractor.extract(requests, spec=None):
        if not isinstance(s, ExtractedSample):
            raise ExtractorError(f"the {extractor.backend} backend wrote row {s.row} itself; tensors were asked for")
        by_row[s.row] = s
    missing = [r.row for r in requests if r.row not in by_row]
    if missing:
        raise ExtractorError(f"the {extractor.backend} backend returned no sample for rows {missing}")
    return [by_row[r.row] for r in requests]
