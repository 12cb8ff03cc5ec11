"""The prompt set: JSONL, one prompt per line, validated line by line.

Each line is an object with an optional `id` and either `prompt` (a string) or
`messages` (a chat ending with a user turn), and optionally `chat_template_kwargs` (an
object: variables for the chat template of this prompt alone, e.g. `{"enable_thinking":
false}`, over the run-wide `generation.chat_template_kwargs`). Errors name the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.errors import Refusal

PROMPTS_FILE = "prompts/prompts.jsonl"
EVAL_PROMPTS_FILE = "prompts/eval_prompts.jsonl"

_ROLES = {"system", "user", "assistant"}


class PromptsError(Refusal, ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)  # other fields (e.g. the demo's `kind`), kept as-is
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)  # file:line it was parsed from, for errors about it

    def template_kwargs(self, run_wide: Mapping[str, Any]) -> dict[str, Any]:
        """What the chat template renders this prompt with: the run-wide kwargs, this prompt's over them."""
        return {**run_wide, **self.chat_template_kwargs}

    def to_json(self) -> dict[str, Any]:
        kwargs = {"chat_template_kwargs": self.chat_template_kwargs} if self.chat_template_kwargs else {}
        return {"id": self.id, "messages": self.messages, **kwargs, **self.extra}


def _parse_line(obj: Any, where: str, lineno: int) -> Prompt:
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    pid = str(obj.get("id", f"line-{lineno}"))
    extra = {k: v for k, v in obj.items() if k not in {"id", "prompt", "messages", "chat_template_kwargs"}}
    kwargs = obj.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise PromptsError(
            f"{where} (id {pid}): 'chat_template_kwargs' must be an object (e.g. {{\"enable_thinking\": false}}), "
            f"got {type(kwargs).__name__}"
        )
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise PromptsError(f"{where} (id {pid}): 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise PromptsError(
                    f"{where} (id {pid}): messages[{i}] must be an object with role in {sorted(_ROLES)} "
                    "and a string 'content'"
                )
        if messages[-1]["role"] != "user":
            raise PromptsError(f"{where} (id {pid}): the last message must be the user's, got {messages[-1]['role']!r}")
        if not messages[-1]["content"].strip():
            raise PromptsError(f"{where} (id {pid}): empty prompt (the last user message has no text)")
    elif "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise PromptsError(f"{where} (id {pid}): 'prompt' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise PromptsError(f"{where} (id {pid}): empty prompt")
        messages = [{"role": "user", "content": text}]
    else:
        raise PromptsError(f"{where} (id {pid}): needs a 'prompt' string or a 'messages' list")
    _check_fact_spans(obj, f"{where} (id {pid})")
    return Prompt(pid, messages, extra, kwargs, where)


def _check_fact_spans(obj: dict[str, Any], where: str) -> None:
    """An eval prompt's `fact_spans` index its `reference` answer: checked here, not after the evaluation's passes."""
    reference = obj.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise PromptsError(f"{where}: 'reference' must be a string (the expected answer), got {type(reference).__name__}")
    if "fact_spans" not in obj:
        return
    if reference is None:
        raise PromptsError(f"{where}: fact_spans are character offsets into 'reference'; give the reference answer too")
    spans = obj["fact_spans"]
    ok = isinstance(spans, list) and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        and 0 <= s[0] < s[1] <= len(reference)
        for s in spans
    )  # fmt: skip
    if not ok:
        raise PromptsError(
            f"{where}: fact_spans must be [[start, end], ...] character offsets with 0 <= start < end <= "
            f"{len(reference)} (the reference's length), got {spans!r}"
        )


def decode_prompts(data: bytes, source: str) -> str:
    """The file's text; PromptsError naming the line and column of the first byte that is not UTF-8."""
    try:
        # utf-8-sig: a byte-order mark at the start (Windows editors write one) is not part of line 1.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        lineno = data.count(b"\n", 0, e.start) + 1
        raise PromptsError(
            f"{source}:{lineno}, column {e.start - line_start + 1}: byte {data[e.start]:#04x} is not UTF-8 "
            "(save the file as UTF-8)"
        ) from None


def heldout_overlap(train: Sequence[Prompt], heldout: Sequence[Prompt]) -> list[str]:
    """The held-out prompts that are training prompts too (the same id, or the same messages), each named with the
    file and line it came from: a drafter judged on rows it trained on is judged too kindly."""
    ids = {p.id for p in train}
    texts = {json.dumps(p.messages, sort_keys=True) for p in train}
    return [f"{p.id} ({p.source})" for p in heldout if p.id in ids or json.dumps(p.messages, sort_keys=True) in texts]


def parse_prompts(text: str, source: str) -> list[Prompt]:
    """All prompts in a JSONL text; raises PromptsError naming `source` and the line at fault."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    # A byte-order mark (Windows editors write one) is not part of the first line.
    for lineno, line in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            # json's messages end where its position goes ("Unterminated string starting at"): the column ends them.
            raise PromptsError(
                f"{where}, column {e.colno}: malformed JSON ({e.msg.removesuffix(' at')} at line {lineno}, column "
                f"{e.colno}); fix the line"
            ) from None
        prompt = _parse_line(obj, where, lineno)
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            # A `\ud800` escape decodes to half a UTF-16 pair, which no UTF-8 file can hold.
            raise PromptsError(
                f"{where} (id {prompt.id}): {e.object[e.start : e.end]!r} is half of a UTF-16 surrogate pair, not text"
            ) from None
        if prompt.id in seen:
            raise PromptsError(f"{where}: duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise PromptsError(f"{source}: no prompts")
    return prompts


def dump_prompts(prompts: list[Prompt]) -> str:
    return "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in prompts)
