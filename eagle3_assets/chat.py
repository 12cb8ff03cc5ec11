"""The target's chat template, used once per prompt: the token ids the engine is given.

A conversation is rendered with the generation prompt (`add_generation_prompt=True`),
and those ids are both what the engine completes and the prompt part of the training
row. Nothing generated is ever rendered back through the template: templates drop
history reasoning, write empty think blocks, add newlines after the end-of-turn token
or leave the stop token out, so a re-rendered conversation is not what the target saw
or produced (`tokenized.py` takes the generated ids as they are).

Chat-template kwargs choose a serving mode (Qwen3/GLM `enable_thinking`, DeepSeek-V3.1
`thinking`, gpt-oss `reasoning_effort`): a prompt renders with the run-wide
`generation.chat_template_kwargs` and its own over them, and that merged set is its
"mode" everywhere (the `responses` row records it, `drafter_eval` renders and reports by
it). A kwarg the template ignores is refused (`check_template_kwargs`), not warned about:
a row would otherwise record a mode it was never rendered in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.prompts import Prompt

Message = dict[str, Any]


class ChatTemplateError(Eagle3Error, ValueError):
    """The target's chat template cannot render a conversation; the message names it and why."""


class TemplateKwargsError(Refusal, ValueError):
    """A chat-template kwarg the target's template never reads: the mode it names would not be rendered."""


def mode_label(template_kwargs: Mapping[str, Any]) -> str:
    """One name per set of template kwargs, the key reports are grouped by ('{}' = the template's defaults)."""
    return json.dumps(dict(template_kwargs), sort_keys=True, ensure_ascii=False)


def render_text(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template_kwargs: Mapping[str, Any] | None = None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **dict(template_kwargs or {})
        )
    except Exception as e:  # noqa: BLE001 - jinja raises anything; the row is named by the caller
        raise ChatTemplateError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None


def generation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The conversation rendered with the generation prompt and `template_kwargs`, as token ids (the template
    writes any BOS itself)."""
    return list(tokenizer(render_text(tokenizer, messages, template_kwargs), add_special_tokens=False)["input_ids"])


def _template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template or ""
    return " ".join(template.values()) if isinstance(template, dict) else template


def ignored_template_kwargs(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template_kwargs: Mapping[str, Any]
) -> list[str]:
    """The kwargs the template ignores for this conversation: rendering without one gives the same text, and the
    template never names it. (Same text alone is not enough: `enable_thinking: true` is Qwen3's default.)"""
    full = render_text(tokenizer, messages, template_kwargs)
    source = _template_source(tokenizer)
    ignored = []
    for name in template_kwargs:
        without = {k: v for k, v in template_kwargs.items() if k != name}
        if render_text(tokenizer, messages, without) == full and not re.search(rf"\b{re.escape(name)}\b", source):
            ignored.append(name)
    return ignored


# apply_chat_template's own arguments: the rendering itself (generation prompt, ids vs text) is not a mode.
RESERVED_KWARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], run_wide: Mapping[str, Any]) -> None:
    """Refuse, naming the kwarg and where it is set, any kwarg that is an argument of the rendering itself or
    that the template ignores; each mode is tried on its first prompt."""
    seen: set[str] = set()
    for prompt in prompts:
        kwargs = prompt.template_kwargs(run_wide)
        label = mode_label(kwargs)
        if label in seen:
            continue
        seen.add(label)

        def where(name: str) -> str:
            return f"prompt {prompt.id!r}" if name in prompt.chat_template_kwargs else "generation.chat_template_kwargs"

        if reserved := sorted(RESERVED_KWARGS & set(kwargs)):
            raise TemplateKwargsError(
                f"{where(reserved[0])}: chat_template_kwargs {reserved[0]!r} is an argument of the rendering "
                "itself, not a variable of the template; every prompt is rendered once, with the generation prompt, "
                "as text then ids"
            )
        if ignored := ignored_template_kwargs(tokenizer, prompt.messages, kwargs):
            raise TemplateKwargsError(
                f"{where(ignored[0])}: chat_template_kwargs {ignored[0]!r} changes nothing: the target's chat "
                "template renders the same text without it and never reads it. Remove it or fix its name: a row "
                "rendered with it would record a mode it was not rendered in"
            )


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
