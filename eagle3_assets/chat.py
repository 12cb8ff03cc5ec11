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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes

from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.prompts import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

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


# apply_chat_template's own arguments: the rendering itself (generation prompt, ids vs text) is not a mode.
RESERVED_KWARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
# What transformers renders every template with, beside RESERVED_KWARGS and the tokenizer's special tokens
# (bos_token, …): a kwarg of the same name replaces it in every prompt (or breaks the rendering: `messages`).
TEMPLATE_CONTEXT = frozenset({"messages", "raise_exception", "strftime_now"})
# A kwarg names a mode, recorded in every row and in the run's metadata: text belongs in the messages.
MAX_KWARG_BYTES = 4096
_COMPARISONS = frozenset({"eq", "ne", "in", "notin"})


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", type(None): "null", list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _constants(node: nodes.Node) -> list[Any]:
    if isinstance(node, nodes.Const):
        return [node.value]
    if isinstance(node, nodes.List | nodes.Tuple) and all(isinstance(i, nodes.Const) for i in node.items):
        return [i.value for i in node.items]
    return []


@dataclass(frozen=True)
class TemplateUses:
    """How the chat template uses its variables: what tells which type it expects of a kwarg."""

    compared: dict[str, list[Any]]  # the constants a variable is compared with (`x is false`, `x in ["a", "b"]`)
    conditions: frozenset[str]  # variables tested for truth as they are (`{% if x %}`, `not x`, `x and y`)


def template_uses(tokenizer: PreTrainedTokenizerBase) -> TemplateUses:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = _template_source(tokenizer)
    try:
        # transformers' own environment: its extensions ({% generation %}) parse.
        tree = _compile_jinja_template(source).environment.parse(source) if source else None
    except jinja2.TemplateError:
        tree = None  # rendering names the error, prompt by prompt
    if tree is None:
        return TemplateUses({}, frozenset())
    found: dict[str, list[Any]] = {}
    for test in tree.find_all(nodes.Test):
        if isinstance(test.node, nodes.Name):
            fixed = {"true": [True], "false": [False], "none": [None]}.get(test.name)
            values = fixed if fixed is not None else (_constants(test.args[0]) if test.name == "sameas" else [])
            found.setdefault(test.node.name, []).extend(values)
    for compare in tree.find_all(nodes.Compare):
        left = compare.expr
        for operand in compare.ops:
            right = operand.expr
            if operand.op in _COMPARISONS:
                if isinstance(left, nodes.Name):
                    found.setdefault(left.name, []).extend(_constants(right))
                elif isinstance(right, nodes.Name) and operand.op in {"eq", "ne"}:
                    found.setdefault(right.name, []).extend(_constants(left))
            left = right
    conditions: set[str] = set()
    stack = [node.test for node in tree.find_all((nodes.If, nodes.CondExpr))]
    while stack:
        node = stack.pop()
        if isinstance(node, nodes.Name):
            conditions.add(node.name)
        elif isinstance(node, nodes.Not):
            stack.append(node.node)
        elif isinstance(node, nodes.And | nodes.Or):
            stack += [node.left, node.right]
    return TemplateUses({name: values for name, values in found.items() if values}, frozenset(conditions))


def _probe(value: Any) -> Any:
    """Another value of the same kind: a variable the template reads renders differently with one of them."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str | list | dict):
        return type(value)() if value else {str: "x", list: [None], dict: {"x": None}}[type(value)]
    return None if value is not None else "x"


def _reads(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], kwargs: Mapping[str, Any], full: str,
           name: str, compared: Sequence[Any]) -> bool:  # fmt: skip
    """Whether the rendering (`full` with `kwargs`) changes with `name`: without it, or with another value (one the
    template compares it with, or one of the same kind). A value the template raises on counts: it reads it."""
    without = {k: v for k, v in kwargs.items() if k != name}
    others = [without] + [{**kwargs, name: v} for v in (*compared, _probe(kwargs[name])) if v != kwargs[name]]
    for other in others:
        try:
            if render_text(tokenizer, messages, other) != full:
                return True
        except ChatTemplateError:
            return True
    return False


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], run_wide: Mapping[str, Any]) -> None:
    """Refuse, naming the kwarg and where it is set (the setting, or the prompt and its file:line), any kwarg that is
    an argument of the rendering itself, shadows the template's own context, is longer than MAX_KWARG_BYTES, is not
    of the type the template compares it with, or does not change the rendering; each mode is tried on its first
    prompt. Nothing is rendered with a kwarg before it passed the first three."""
    shadowed = TEMPLATE_CONTEXT | set(tokenizer.SPECIAL_TOKENS_ATTRIBUTES) | set(tokenizer.special_tokens_map)
    uses = template_uses(tokenizer)
    seen: set[str] = set()
    for prompt in prompts:
        kwargs = prompt.template_kwargs(run_wide)
        label = mode_label(kwargs)
        if label in seen:
            continue
        seen.add(label)

        def where(name: str) -> str:
            if name not in prompt.chat_template_kwargs:
                return "generation.chat_template_kwargs"
            return f"prompt {prompt.id!r}" + (f" ({prompt.source})" if prompt.source else "")

        if reserved := sorted(RESERVED_KWARGS & set(kwargs)):
            raise TemplateKwargsError(
                f"{where(reserved[0])}: chat_template_kwargs {reserved[0]!r} is an argument of the rendering "
                "itself, not a variable of the template; every prompt is rendered once, with the generation prompt, "
                "as text then ids"
            )
        if shadows := sorted(shadowed & set(kwargs)):
            raise TemplateKwargsError(
                f"{where(shadows[0])}: chat_template_kwargs {shadows[0]!r} would replace the template's own "
                f"{shadows[0]!r} (what every prompt is rendered with: the conversation, the tokenizer's special "
                "tokens, the generation prompt); remove it"
            )
        for name, value in kwargs.items():
            size = len(json.dumps(value, ensure_ascii=False, default=str).encode())
            if size > MAX_KWARG_BYTES:
                raise TemplateKwargsError(
                    f"{where(name)}: chat_template_kwargs {name!r} is {size} bytes as JSON, over the "
                    f"{MAX_KWARG_BYTES}-byte limit: a kwarg chooses a mode and is recorded in every row; put text in "
                    "the prompt's messages"
                )
        for name, value in kwargs.items():
            expected = list(dict.fromkeys(uses.compared.get(name, [])))
            kinds = list(dict.fromkeys(_kind(v) for v in expected))
            is_value = f"chat_template_kwargs {name!r} is {json.dumps(value, ensure_ascii=False)} ({_kind(value)})"
            if expected and _kind(value) not in kinds:
                shown = ", ".join(json.dumps(v) for v in expected)
                raise TemplateKwargsError(
                    f"{where(name)}: {is_value}, but the chat template compares it with {shown} ({' or '.join(kinds)}), "
                    f"so no comparison matches it; give {' or '.join(kinds)}, e.g. {json.dumps({name: expected[0]})}"
                )
            spelt = str(value).strip().lower()
            if isinstance(value, str) and spelt in ("true", "false") and name in uses.conditions and not expected:
                raise TemplateKwargsError(
                    f"{where(name)}: {is_value}, but the chat template tests it as a condition, where every "
                    f"non-empty string is true; give a boolean, e.g. {json.dumps({name: spelt == 'true'})}"
                )
        try:
            full = render_text(tokenizer, prompt.messages, kwargs)
        except ChatTemplateError as e:
            try:
                render_text(tokenizer, prompt.messages, {})
            except ChatTemplateError:
                seen.discard(label)  # the prompt fails, not its kwargs: its row fails on its own; try the next one
                continue
            raise TemplateKwargsError(
                f"{where(next(iter(kwargs)))}: chat_template_kwargs {label} break the rendering of prompt "
                f"{prompt.id!r}, which renders without them: {e}"
            ) from None
        for name in kwargs:
            if not _reads(tokenizer, prompt.messages, kwargs, full, name, uses.compared.get(name, [])):
                raise TemplateKwargsError(
                    f"{where(name)}: chat_template_kwargs {name!r} changes nothing: the target's chat template "
                    "renders the same text without it and with any other value. Remove it or fix its name: a row "
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
