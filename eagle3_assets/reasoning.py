"""Where the reasoning is in what the target generated, found on the completion's token ids.

Training rows take the generated tokens as they are (`tokenized.py`); this split only
says which of them are reasoning: a token count for the coverage check and the
figures, and the two texts for people (`reasoning_content`, `content` in `responses`).
Both generation backends return token ids and both are split here, by one rule.

Two formats, found from the tokenizer (`detect_format`) or named by `generation.reasoning`:

- `think`: `<think>reasoning</think>answer`. The reasoning is open when the generation
  prompt ends inside an open think block (DeepSeek-R1 distills, QwQ, Kimi-K2-Thinking
  end it with `<think>`) or the completion begins with the open tag (whitespace before
  it allowed). Everything up to and including the close tag is reasoning, also when no
  open tag was generated (DeepSeek-R1 writes none). A completion without a close tag
  is all reasoning when the reasoning was open: a row cut by `max_new_tokens` inside
  its thinking, as vLLM's `deepseek_r1` parser reads it; otherwise it is all answer (a
  model that did not think). A prompt whose think block is already closed (Qwen3 with
  thinking off) leaves the reasoning closed.
- `harmony` (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, separated by
  `<|start|>assistant`; every token before the `final` channel's header is reasoning
  (analysis and commentary), the final message's text is the answer. No final channel
  (truncated) means all reasoning.
- `none`: no reasoning.

Tags may be several tokens: positions are found on the decoded text and mapped back to
the smallest token prefix that contains them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal


from eagle3_assets.errors import Refusal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

ReasoningFormat = Literal["think", "harmony", "none"]
THINK_TAGS = ("<think>", "</think>")
HARMONY = {"channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>", "start": "<|start|>"}
HARMONY_STOPS = ("<|return|>", "<|call|>", "<|end|>")


class ReasoningFormatError(Refusal, ValueError):
    """The reasoning format named in the settings does not fit the target's tokenizer."""


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning_tokens: int  # the first `reasoning_tokens` completion tokens are reasoning (tags and headers included)
    reasoning: str  # text for people, tags removed
    content: str  # the answer's text, special tokens removed


def _single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1


def detect_format(tokenizer: PreTrainedTokenizerBase, setting: str = "auto") -> ReasoningFormat:
    """`generation.reasoning` resolved for this tokenizer: harmony when its channel tokens exist, think when
    `<think>`/`</think>` are tokens of it, else none.

    An explicit setting that contradicts the tokenizer is refused, naming both: `harmony` without the harmony
    tokens, and `think` or `none` on a harmony tokenizer (gpt-oss writes every answer in channels: either would
    count its analysis as answer). `think` is allowed where the tags are not single tokens (they may be several),
    and `none` on a think tokenizer (a model may carry the tags and never think)."""
    harmony = all(_single_token(tokenizer, t) for t in (*HARMONY.values(), "<|return|>"))
    think = all(_single_token(tokenizer, t) for t in THINK_TAGS)
    found: ReasoningFormat = "harmony" if harmony else "think" if think else "none"
    if setting == "auto":
        return found
    if (setting == "harmony") != harmony:
        have = (
            "has gpt-oss's harmony tokens (<|channel|>, <|message|>, <|return|>)"
            if harmony
            else "has no <|channel|>/<|message|>/<|return|> tokens"
        )
        raise ReasoningFormatError(
            f"generation.reasoning: {setting!r} contradicts the tokenizer, which {have} and reads as {found!r}; "
            f"set generation.reasoning to {found!r} or 'auto'"
        )
    return setting  # type: ignore[return-value]


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special: bool = False) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def _prefix_holding(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], needle: str, occurrence: int = 1) -> int | None:
    """The smallest k such that decode(ids[:k]) holds `needle` `occurrence` times; None when the whole does not."""

    def holds(k: int) -> bool:
        return _decode(tokenizer, ids[:k]).count(needle) >= occurrence

    if not holds(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _without_stop(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stop_ids: set[int]) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] in stop_ids else list(ids)


def split_think(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    stop_ids: set[int],
    tags: tuple[str, str] = THINK_TAGS,
) -> ReasoningSplit:
    open_tag, close_tag = tags
    prompt_tail = _decode(tokenizer, prompt_ids[-16:]).rstrip()
    opened_in_prompt = prompt_tail.rfind(open_tag) > prompt_tail.rfind(close_tag)
    text = _decode(tokenizer, completion_ids)
    close = _prefix_holding(tokenizer, completion_ids, close_tag)
    if close is None:
        body = _without_stop(tokenizer, completion_ids, stop_ids)
        if opened_in_prompt or text.lstrip().startswith(open_tag):
            reasoning = _decode(tokenizer, body).lstrip().removeprefix(open_tag)
            return ReasoningSplit(len(body), reasoning, "")
        return ReasoningSplit(0, "", _decode(tokenizer, completion_ids, skip_special=True))
    head = _decode(tokenizer, completion_ids[:close])
    reasoning = head[: head.rindex(close_tag)].lstrip().removeprefix(open_tag)
    return ReasoningSplit(close, reasoning, _decode(tokenizer, completion_ids[close:], skip_special=True))


def split_harmony(tokenizer: PreTrainedTokenizerBase, completion_ids: Sequence[int]) -> ReasoningSplit:
    vocab = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in HARMONY.items()}
    stops = {tokenizer.convert_tokens_to_ids(t) for t in HARMONY_STOPS}
    ids = list(completion_ids)
    messages: list[tuple[int, str, list[int]]] = []  # (index of the <|channel|> token, channel name, text ids)
    i = 0
    while i < len(ids):
        if ids[i] != vocab["channel"]:
            i += 1
            continue
        header = i
        j = i + 1
        while j < len(ids) and ids[j] != vocab["message"]:
            j += 1
        channel = _decode(tokenizer, ids[i + 1 : j]).strip().split()[0] if j > i + 1 else ""
        k = j + 1
        while k < len(ids) and ids[k] not in stops:
            k += 1
        messages.append((header, channel, ids[j + 1 : k]))
        i = k + 1
    final = next((m for m in messages if m[1] == "final"), None)
    reasoning = "".join(_decode(tokenizer, text) for _, channel, text in messages if channel != "final")
    if final is None:
        return ReasoningSplit(len(_without_stop(tokenizer, ids, stops)), reasoning, "")
    header = final[0]
    # The `<|start|>assistant` before the final header belongs to the reasoning part: it is not the answer.
    return ReasoningSplit(header, reasoning, _decode(tokenizer, final[2], skip_special=True))


def split_completion(
    tokenizer: PreTrainedTokenizerBase,
    fmt: ReasoningFormat,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    stop_ids: set[int],
) -> ReasoningSplit:
    """Which leading completion tokens are reasoning, and the two texts (see the module docstring)."""
    if fmt == "think":
        return split_think(tokenizer, prompt_ids, completion_ids, stop_ids)
    if fmt == "harmony":
        return split_harmony(tokenizer, completion_ids)
    return ReasoningSplit(0, "", _decode(tokenizer, completion_ids, skip_special=True))
