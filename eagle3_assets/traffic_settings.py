"""The `traffic` settings section: prompts taken from a server's or gateway's request log (`traffic.py`).

Kept out of `settings.py` (one field there names this section). Unset, the graph is what it was without it: no
`traffic_prompts` asset, `responses` generates from `prompts` alone, and no record changes.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from eagle3_assets.section import Section


class TrafficSettings(Section):
    """Where the request log is, how much of it is held out, and whose logged replies may stand for generation."""

    log: str = Field(
        description="the request log: one JSONL file, a directory of them or a glob (local or fsspec URL; .gz read "
        "as gzip); files are read in sorted order, and a prompt keeps its place in the prompt set once admitted",
    )
    heldout_share: float = Field(
        0.1,
        ge=0.0,
        le=0.5,
        description="share of the log's distinct prompts held out (never trained on), chosen by a hash of each "
        "prompt: appending to the log never moves a prompt between the splits",
    )
    model: str | None = Field(
        None,
        description="the name the log records for the target (the `model` of its requests or responses); a logged "
        "reply is used in place of generation only when it is this model's greedy output with its token ids logged; "
        "unset, every row is generated",
    )

    @field_validator("log")
    @classmethod
    def _named(cls, log: str) -> str:
        if not log.strip():
            raise ValueError("empty; name the request log (a JSONL file, a directory of them or a glob)")
        return log

    @field_validator("model")
    @classmethod
    def _model_named(cls, model: str | None) -> str | None:
        if model is not None and not model.strip():
            raise ValueError("empty; name the model as the log records it, or leave it unset (every row generated)")
        return model
