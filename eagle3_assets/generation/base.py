"""The interface every generation backend implements, and the reasoning/answer split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

Message = dict[str, Any]


@dataclass(frozen=True)
class Completion:
    """One row's answer, or its error. Token counts come from the engine, not from re-tokenising."""

    reasoning: str
    content: str
    finish_reason: str  # "stop" | "length" | "error"
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Completion:
        return cls("", "", "error", 0, 0, 0, error)


class Generator(Protocol):
    """Answers a batch of conversations; a failing row is returned as `Completion.failed`, not raised."""

    name: str

    def generate(self, conversations: list[list[Message]]) -> list[Completion]: ...

    def close(self) -> None: ...


def split_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> tuple[str, str]:
    """(reasoning, answer) of a generated text; no closing tag means no reasoning.

    Same rule as vLLM's deepseek_r1 parser: everything before the closing tag is
    reasoning (an opening tag, if generated, is dropped). Whitespace is kept as
    generated, so re-rendering with the chat template gives back the same tokens.
    """
    head, sep, tail = text.partition(close_tag)
    if not sep:
        return "", text
    if head.startswith(open_tag):
        head = head[len(open_tag) :]
    return head, tail
