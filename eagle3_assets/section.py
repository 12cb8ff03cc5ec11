"""The base of every settings section: what one validation rule says for all of them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A settings section: unknown keys are refused (a misspelt setting is an error, not a default), values are frozen,
    and `.inf` / `.nan`, valid YAML floats that a bound like `ge=0` lets through, are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
