"""The interface every generation backend implements: token ids in, token ids out.

A backend gets each conversation's prompt as the token ids `responses.Renderer` made from
it (the chat template with the generation prompt, rendered once, here), and returns
exactly the token ids the engine produced, the stop token included when it stopped on
one. Those two lists are the training row (`tokenized.py`); the texts a person reads
are decoded from them by one rule for every backend (`reasoning.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

Message = dict[str, Any]


@dataclass(frozen=True)
class Generated:
    """What the engine produced for one prompt, or why it produced nothing."""

    completion_token_ids: list[int]
    finish_reason: str  # "stop" (a stop token ended it) | "length" (max_new_tokens or the context) | "error"
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Generated:
        return cls([], "error", error)


class Generator(Protocol):
    """Completes token-id prompts; a failing row comes back as `Generated.failed`, not raised."""

    name: str
    stop_token_ids: set[int]  # what ends a completion ("stop"); included in the completion ids

    def generate(self, prompts: list[list[int]]) -> list[Generated]: ...

    def close(self) -> None: ...
