"""The target's chat template, used once per prompt: the token ids the engine is given.

A conversation is rendered with the generation prompt (`add_generation_prompt=True`),
and those ids are both what the engine completes and the prompt part of the training
row. Nothing generated is ever rendered back through the template: templates drop
history reasoning, write empty think blocks, add newlines after the end-of-turn token
or leave the stop token out, so a re-rendered conversation is not what the target saw
or produced (`tokenized.py` takes the generated ids as they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from eagle3_assets.errors import Eagle3Error

Message = dict[str, Any]


class ChatTemplateError(Eagle3Error, ValueError):
    """The target's chat template cannot render a conversation; the message names it and why."""


def generation_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """The conversation rendered with the generation prompt, as token ids (the template writes any BOS itself)."""
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises anything; the row is named by the caller
        raise ChatTemplateError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _offsets(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` and each token's character span; slow tokenizers (no offset mapping) by decoding prefixes."""
    if tokenizer.is_fast:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    spans, start = [], 0
    for k in range(1, len(ids) + 1):
        end = len(tokenizer.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        spans.append((start, end))
        start = end
    return ids, spans


def span_token_flags(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[bool]]:
    """`text`'s token ids and, per token, whether it overlaps one of the [start, end) character spans."""
    ids, offsets = _offsets(tokenizer, text)
    return ids, [any(a < end and start < b for start, end in spans) for a, b in offsets]
