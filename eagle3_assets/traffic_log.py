"""A request log, as servers and gateways write it: OpenAI-style chat-completion calls, one JSON object a line.

The accepted shapes of a line (one call each; a streamed call is logged as its assembled response):
- `{"request": {...}, "response": {...}}`: the request body (`messages`, `model`, sampling parameters,
  `chat_template_kwargs`) and the response body (`model`, `choices`, vLLM's `prompt_token_ids`); either may wrap
  its body in `{"body": {...}}`, as OpenAI's batch files do (`{"custom_id", "body": ...}` beside
  `{"custom_id", "response": {"status_code", "body": ...}}` joined on one line);
- `{"messages": [...], ..., "response": {...}}`: the request's fields at the top, the response under `response`;
- `{"messages": [...], ..., "choices": [...]}`: request and response fields side by side on one object.
`response` may be absent or null (only the request was logged), or an error (`error`, a status code other than
200): the prompt is used and its reply generated.

A message is `{"role", "content"}`; `developer` is read as `system` (OpenAI's newer name for it); content given as
parts keeps its text parts, joined by newlines as vLLM joins them. A line the prompt set cannot hold (not JSON, no
messages, a tool call or result, an image, a chat that does not end with the user's turn) is dropped, named by its
file and line and why (`Dropped`); nothing in one line stops the others.

Whether a logged reply stands for generation is decided per call (`reply_decision`): only the target's own greedy
output, with the token ids the engine produced logged (vLLM's `return_token_ids`), since a training row is those
ids, never the text tokenized again (docs/DESIGN.md §3).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from eagle3_assets.errors import Refusal

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_GLOB = set("*?[")


class TrafficLogError(Refusal, ValueError):
    """The request log cannot be read at all (no file, an unknown protocol); the message names `traffic.log`."""


class LineDropped(ValueError):
    """One line the prompt set cannot hold; the message says why."""


@dataclass(frozen=True)
class Dropped:
    where: str  # file:line
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class LoggedCall:
    """One chat-completion call of the log: the prompt as the request sent it, and what the response logged."""

    where: str  # file:line
    messages: list[dict[str, str]]
    chat_template_kwargs: dict[str, Any]
    request: dict[str, Any]  # the request body: model, sampling parameters
    response: dict[str, Any] | None = None  # the response body; None when not logged, or an error
    response_error: str | None = None  # why a logged response is no reply

    @property
    def model(self) -> str | None:
        name = (self.response or {}).get("model") or self.request.get("model")
        return name if isinstance(name, str) else None


# --- the files ----------------------------------------------------------------------------------------------


def log_files(url: str) -> list[str]:
    """The files `traffic.log` names, sorted by name: the file itself, every file under a directory (hidden ones, such
    as a writer's temporaries, aside), or a glob's matches. Raises TrafficLogError when there are none."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if _GLOB & set(path):
            found = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if not any(part.startswith(".") for part in p[len(path) :].split("/"))]
        elif fs.isfile(path):
            found = [path]
        else:
            found = []
    except (ValueError, ImportError, OSError) as e:  # an unknown protocol, an unreachable store
        raise TrafficLogError(f"traffic.log: cannot read {url}: {e}") from None
    if not found:
        raise TrafficLogError(f"traffic.log: no file at {url} (name a JSONL file, a directory of them or a glob)")
    # Local files by their paths, as a person names them in a message; any other store by its URL.
    return sorted(p if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(p) for p in found)


def _lines(url: str) -> Iterator[tuple[int, bytes]]:
    with fsspec.open(url, "rb", compression="infer") as f:
        yield from enumerate(f, start=1)


def read_log(url: str) -> tuple[list[LoggedCall], list[Dropped], int, list[str]]:
    """Every call in the log's files, in file then line order; the lines dropped, each with why; the count of
    non-blank lines read; the files."""
    files = log_files(url)
    calls: list[LoggedCall] = []
    dropped: list[Dropped] = []
    lines = 0
    for name in files:
        try:
            for lineno, raw in _lines(name):
                if not raw.strip():
                    continue
                lines += 1
                where = f"{name}:{lineno}"
                try:
                    calls.append(parse_line(raw.rstrip(b"\r\n"), where))
                except LineDropped as e:
                    dropped.append(Dropped(where, str(e)))
        except OSError as e:  # a file gone between listing and reading, a truncated gzip
            raise TrafficLogError(f"traffic.log: cannot read {name}: {e}") from None
    return calls, dropped, lines, files


# --- one line -----------------------------------------------------------------------------------------------


def parse_line(raw: bytes, where: str) -> LoggedCall:
    """One line as a call; LineDropped says why it is none."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LineDropped(f"byte {raw[e.start]:#04x} at column {e.start + 1} is not UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineDropped(f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineDropped(f"expected a JSON object, got {type(obj).__name__}")
    request, response = _shape(obj)
    messages = _messages(request.get("messages"))
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise LineDropped(f"'chat_template_kwargs' must be an object, got {type(kwargs).__name__}")
    error = _response_error(response)
    return LoggedCall(where, messages, kwargs, request, None if error else response, error)


def _body(part: Any) -> Any:
    """A request or response as logged, or the `body` it wraps (OpenAI's batch files)."""
    if isinstance(part, dict) and "messages" not in part and "choices" not in part and isinstance(part.get("body"), dict):
        return {**part["body"], **({"status_code": part["status_code"]} if "status_code" in part else {})}
    return part


def _shape(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if "request" in obj:
        request, response = _body(obj["request"]), _body(obj.get("response"))
    elif "messages" in obj or isinstance(obj.get("body"), dict):
        request = _body(obj)
        response = _body(obj.get("response")) if obj.get("response") is not None else (obj if "choices" in obj else None)
    else:
        raise LineDropped(
            "neither a 'request' object nor 'messages': not a chat-completion call (the shapes read are "
            "{request, response}, {messages, ..., response} and {messages, ..., choices})"
        )
    if not isinstance(request, dict):
        raise LineDropped(f"'request' must be an object, got {type(request).__name__}")
    if response is not None and not isinstance(response, dict):
        raise LineDropped(f"'response' must be an object or null, got {type(response).__name__}")
    return request, response


def _response_error(response: dict[str, Any] | None) -> str | None:
    if response is None:
        return None
    if response.get("error"):
        return "the response logged is an error"
    status = response.get("status_code", 200)
    return None if status == 200 else f"the response logged has status {status}"


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise LineDropped(f"messages[{i}] holds a {kind!r} part: only text is a prompt here")
            texts.append(part["text"])
        return "\n".join(texts)
    raise LineDropped(f"messages[{i}] has no text content (got {type(content).__name__})")


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise LineDropped("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise LineDropped(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise LineDropped(f"messages[{i}] is a tool call or its result: only text chats are prompts here")
        if role not in _ROLES:
            raise LineDropped(f"messages[{i}] has role {role!r}; known roles: {', '.join(_ROLES)}")
        out.append({"role": _ROLES[role], "content": _text(m.get("content"), i)})
    if out[-1]["role"] != "user":
        raise LineDropped(f"the last message is the {out[-1]['role']}'s: a prompt ends with the user's turn")
    if not out[-1]["content"].strip():
        raise LineDropped("empty prompt (the last user message has no text)")
    return out


# --- whose reply ----------------------------------------------------------------------------------------------

# Request fields that make an engine's output other than the target's free greedy output even at temperature 0:
# penalties, biases, early stops, constrained decoding. Each is named when it is why a reply is generated again.
_UNCHANGED = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0), "logit_bias": (None, {}), "stop": (None, [], ""), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None, []), "tools": (None, []), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None, []), "guided_grammar": (None,), "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
}  # fmt: skip


@dataclass(frozen=True)
class ReplyDecision:
    """Whether a row's reply is the logged one or generated, the reason (`kind` short and stable, for counts;
    `why` in words), and the logged completion's token ids when it is used."""

    source: Literal["logged", "generated"]
    kind: str
    why: str
    completion_token_ids: list[int] = field(default_factory=list, repr=False)


def _generated(kind: str, why: str) -> ReplyDecision:
    return ReplyDecision("generated", kind, why)


def _choice(response: dict[str, Any]) -> dict[str, Any] | None:
    choices = response.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


def _sampling(request: dict[str, Any]) -> ReplyDecision | None:
    """None when the request asked for plain greedy decoding, else why not."""
    t, k = request.get("temperature"), request.get("top_k")
    greedy = (isinstance(t, int | float) and not isinstance(t, bool) and t == 0) or (k == 1 and not isinstance(k, bool))
    if not greedy:
        said = "temperature not logged (the server's default samples: 1.0 in the OpenAI API)" if t is None else (
            f"temperature {t}" + (f", top_k {k}" if k is not None else ""))  # fmt: skip
        return _generated("sampled", f"sampled, not greedy: {said}")
    for name, unchanged in _UNCHANGED.items():
        if request.get(name) not in unchanged:
            value = json.dumps(request[name], ensure_ascii=False)
            return _generated("constrained", f"the request sets {name} {value[:80]}: not the target's plain greedy output")
    return None


def reply_decision(
    call: LoggedCall, *, target: str | None, run_temperature: float, prompt_ids: list[int], vocab_size: int
) -> ReplyDecision:
    """Whether `call`'s logged reply is the row's reply: only when this run generates greedily (generation.temperature
    0), the log names the target (`traffic.model`), the request was plain greedy decoding, the reply ended on its own
    (finish_reason stop), and the response logged the token ids: the prompt's, equal to this target's rendering
    (`prompt_ids`), and the completion's. Anything else: generated again, saying why."""
    if run_temperature != 0:
        return _generated(
            "run samples", f"generation.temperature is {run_temperature}: this run samples its rows, and a logged "
            "greedy reply is not what it would make",
        )  # fmt: skip
    if target is None:
        return _generated("model unset", "traffic.model is not set: no logged reply is known to be the target's")
    if call.response is None:
        return _generated("no reply", call.response_error or "no reply logged")
    if call.model != target:
        return _generated("other model", f"answered by {call.model!r}, not the target ({target!r}, traffic.model)")
    if (not_greedy := _sampling(call.request)) is not None:
        return not_greedy
    choice = _choice(call.response)
    if choice is None:
        return _generated("no reply", "the response logged has no choices")
    if choice.get("finish_reason") != "stop":
        return _generated(
            "unfinished", f"finish_reason {choice.get('finish_reason')!r}: the reply did not end on its own"
        )
    ids, logged_prompt = choice.get("token_ids"), call.response.get("prompt_token_ids")
    if ids is None or logged_prompt is None:
        return _generated(
            "text only", "token ids not logged (a training row is the ids the engine produced, docs/DESIGN.md §3; "
            "vLLM logs them with return_token_ids)",
        )  # fmt: skip
    if logged_prompt != prompt_ids:
        n = len(logged_prompt) if isinstance(logged_prompt, list) else "?"
        return _generated(
            "prompt differs", f"the server's prompt ({n} token ids) is not the target's template's rendering here "
            f"({len(prompt_ids)} token ids): another template or chat_template_kwargs",
        )  # fmt: skip
    valid = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)
    if not valid:
        return _generated("bad ids", f"the completion's token ids are not {vocab_size}-vocabulary ids of a non-empty reply")
    return ReplyDecision("logged", "logged", f"the greedy output of {target!r}, token ids logged", list(ids))
