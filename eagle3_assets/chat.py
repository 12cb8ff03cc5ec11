"""Render a conversation with the target's own chat template and mark the assistant tokens.

The loss mask is found without knowing the template's separators: for every
assistant turn i, the text of `messages[:i]` plus the generation prompt and the
text of `messages[:i+1]` bound exactly the characters the assistant produced
(reasoning, answer and end-of-turn marker). Tokens starting inside those spans
get mask 1. A template that does not render conversations prefix-consistently is
reported instead of guessed at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations the way the loss mask needs."""


@dataclass(frozen=True)
class RenderedRow:
    input_ids: list[int]
    loss_mask: list[int]


def require_chat_template(tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"{where}: the tokenizer has no chat template (tokenizer_config.json has no 'chat_template' "
            "and there is no chat_template.jinja); conversations cannot be rendered"
        )


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of each assistant turn."""
    full = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ChatTemplateError(
                f"chat template is not prefix-consistent at message {i}: rendering the conversation up to "
                "an assistant turn does not extend the rendering before it, so assistant tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    return full, spans


def render_with_loss_mask(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> RenderedRow:
    """Token ids of the whole conversation and a mask that is 1 exactly on assistant tokens."""
    text, spans = assistant_spans(tokenizer, messages)
    # The template writes any BOS itself; the tokenizer must not add another.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    mask = [0] * len(ids)
    span_iter = iter(spans)
    span = next(span_iter, None)
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        while span is not None and start >= span[1]:
            span = next(span_iter, None)
        if span is None:
            break
        if start >= span[0]:
            mask[t] = 1
    return RenderedRow(ids, mask)


def span_token_flags(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[bool]]:
    """`text`'s token ids and, per token, whether it overlaps one of the [start, end) character spans."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(a < end and start < b for start, end in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), flags
