"""Prompts from traffic: the request log (`traffic_log.py`) as training and held-out prompts for the target.

Per call of the log, in file then line order:
- dropped, naming its file:line and why, when the target's chat template cannot render it (or refuses its
  `chat_template_kwargs`, as `responses` would: `chat.check_template_kwargs`), when it leaves no room for an answer
  (`max_seq_len`), when it is a prompt of the store already (a training prompt of `prompts`, or a held-out one of
  `eval_prompts`: the same messages in the same mode, the rule of `prompts.heldout_overlap`), or when an earlier
  call rendered the same prompt (the text the engine is given: de-duplicated on what the target sees);
- kept, with an id and a split both taken from a hash of the prompt (its messages and its own template kwargs):
  a prompt is held out when its hash falls under `traffic.heldout_share`, so the split is the prompt's own, not
  its place in the log, and appending to the log never moves an old prompt between the splits;
- a kept training prompt records whose reply its row gets (`traffic_reply`: `logged` or `generated`,
  `traffic_log.reply_decision`), which `responses` keeps in the row.

The prompt set `responses` generates from with `traffic` set (`TRAFFIC_PROMPTS_FILE`) is the store's prompts and
the log's training prompts, each kept where it was the last time the set was written and new ones after them:
appending to the log (to any of its files) or to the prompt file appends to the set, so the rows already
generated, tokenized and extracted stay where they are and the drafter continues the release (README, "New rows
continue the released drafter"). A prompt gone from its file (a log rotated away) leaves the set, which is no
append: the drafter then trains from scratch, saying so.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


from eagle3_assets.chat import ChatTemplateError, TemplateKwargsError, check_template_kwargs, mode_label, render_text
from eagle3_assets.generation.base import Generated, Generator
from eagle3_assets.prompts import Prompt, dump_prompts, parse_prompts
from eagle3_assets.provenance import ProvenanceError, digest, source_digest
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.traffic_log import Dropped, LoggedCall, ReplyDecision, TrafficLogError, log_files, reply_decision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

TRAFFIC_PROMPTS_FILE = "traffic/prompts.jsonl"  # what `responses` generates from: the prompts and the log's training rows
TRAFFIC_HELDOUT_FILE = "traffic/heldout.jsonl"  # the log's held-out prompts, never trained on
TRAFFIC_REPLIES_FILE = "traffic/replies.jsonl"  # the logged replies that stand for generation, as token ids
TRAFFIC_REPORT_FILE = "traffic/report.json"  # every line dropped and every row kept, with why
REPLY_FIELD = "traffic_reply"  # a training prompt's extra field: `logged` or `generated`


@dataclass(frozen=True)
class TrafficRow:
    prompt: Prompt
    heldout: bool
    reply: ReplyDecision | None  # None for a held-out row: drafter_eval serves it, nothing is trained on it
    prompt_token_ids: list[int]

    def as_report(self) -> dict[str, Any]:
        reply = {"reply": self.reply.source, "why": self.reply.why} if self.reply else {}
        return {"id": self.prompt.id, "where": self.prompt.source, "split": "heldout" if self.heldout else "train", **reply}


@dataclass(frozen=True)
class TrafficResult:
    rows: list[TrafficRow]  # kept, in log order
    dropped: list[Dropped]
    lines: int  # non-blank lines read
    files: list[str]

    @property
    def train(self) -> list[Prompt]:
        return [r.prompt for r in self.rows if not r.heldout]

    @property
    def heldout(self) -> list[Prompt]:
        return [r.prompt for r in self.rows if r.heldout]

    def reply_counts(self) -> dict[str, int]:
        """Training rows per reply source and reason (`logged`, `generated: <kind>`)."""
        return dict(Counter(r.reply.source + ("" if r.reply.source == "logged" else f": {r.reply.kind}")
                            for r in self.rows if r.reply))  # fmt: skip

    def as_report(self) -> dict[str, Any]:
        return {
            "files": self.files, "lines": self.lines, "dropped": [str(d) for d in self.dropped],
            "rows": [r.as_report() for r in self.rows],
        }  # fmt: skip


def prompt_hash(messages: Sequence[Mapping[str, Any]], own_kwargs: Mapping[str, Any]) -> str:
    """The prompt's own hash: its id and its split. The run-wide kwargs are left out, so a setting moves no prompt."""
    text = json.dumps({"messages": list(messages), "chat_template_kwargs": dict(own_kwargs)}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def traffic_id(messages: Sequence[Mapping[str, Any]], own_kwargs: Mapping[str, Any]) -> str:
    return f"traffic-{prompt_hash(messages, own_kwargs)[:16]}"


def is_heldout(hash_hex: str, share: float) -> bool:
    return int(hash_hex[:15], 16) / 16**15 < share


def _same_prompt_key(messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> str:
    # By role and text, as a log line's messages are kept: a prompt file's other message fields make no other prompt.
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    return json.dumps([turns, dict(kwargs)], sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class TrafficBuild:
    """What a call is judged by: the target's tokenizer, the store's prompts and the settings that apply."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    run_kwargs: Mapping[str, Any]  # generation.chat_template_kwargs
    max_seq_len: int
    heldout_share: float
    target_name: str | None  # traffic.model
    run_temperature: float  # generation.temperature

    def build(
        self, calls: Sequence[LoggedCall], dropped: Sequence[Dropped], lines: int, files: list[str],
        base: Sequence[Prompt], base_heldout: Sequence[Prompt], kept_before: Mapping[str, str] | None = None,
    ) -> TrafficResult:  # fmt: skip
        """Every call kept (train or held out) or dropped, with why (`dropped` holds the lines already dropped).

        Of the calls of one prompt the first is kept, but the one kept the last time (`kept_before`: id -> file:line,
        `kept_lines`) goes first while it is there: the log is only appended to, so that line decides the prompt's
        reply as it did, and a new file sorting before the old ones changes no row already made."""
        before = kept_before or {}
        calls = sorted(calls, key=lambda c: before.get(traffic_id(c.messages, c.chat_template_kwargs)) != c.where)
        known = {_same_prompt_key(p.messages, p.template_kwargs(self.run_kwargs)): f"a training prompt of `prompts` already (id {p.id})"
                 for p in base}  # fmt: skip
        known |= {
            _same_prompt_key(p.messages, p.template_kwargs(self.run_kwargs)): f"a held-out prompt of `eval_prompts` (id {p.id}): "
            "never trained on"
            for p in base_heldout
        }
        ids = {p.id for p in (*base, *base_heldout)}
        seen: dict[str, str] = {}  # rendered prompt -> where it was first
        modes: dict[str, str | None] = {}  # mode label -> why the template refuses it, or None
        rows, out = [], list(dropped)
        for call in calls:
            try:
                rows.append(self._row(call, known, ids, seen, modes))
            except _Drop as e:
                out.append(Dropped(call.where, str(e)))
        # Dropped lines in log order: those of the reading and of the judging, interleaved as the log has them.
        out.sort(key=lambda d: _file_line(d.where, files))
        return TrafficResult(rows, out, lines, files)

    def _row(
        self, call: LoggedCall, known: dict[str, str], ids: set[str], seen: dict[str, str], modes: dict[str, str | None]
    ) -> TrafficRow:
        h = prompt_hash(call.messages, call.chat_template_kwargs)
        prompt = Prompt(traffic_id(call.messages, call.chat_template_kwargs), call.messages, {},
                        dict(call.chat_template_kwargs), call.where)  # fmt: skip
        kwargs = prompt.template_kwargs(self.run_kwargs)
        try:
            text, unrenderable = render_text(self.tokenizer, call.messages, kwargs), None
        except ChatTemplateError as e:
            text, unrenderable = "", str(e)
        if (refused := self._mode_refused(prompt, kwargs, modes, rendered=unrenderable is None)) is not None:
            raise _Drop(refused)
        if unrenderable is not None:
            raise _Drop(unrenderable)
        if (already := known.get(_same_prompt_key(call.messages, kwargs))) is not None:
            raise _Drop(already)
        if prompt.id in ids:
            raise _Drop(f"its id {prompt.id} is the id of a prompt of the store")
        if text in seen:
            raise _Drop(f"duplicate of {seen[text]} (the same prompt as the target's template renders it)")
        prompt_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompt_ids) >= self.max_seq_len:
            raise _Drop(f"the prompt has {len(prompt_ids)} tokens, max_seq_len is {self.max_seq_len}: no room for an answer")
        seen[text] = call.where
        if is_heldout(h, self.heldout_share):
            return TrafficRow(prompt, True, None, prompt_ids)
        reply = reply_decision(
            call, target=self.target_name, run_temperature=self.run_temperature, prompt_ids=prompt_ids,
            vocab_size=self.vocab_size,
        )  # fmt: skip
        kept = Prompt(prompt.id, prompt.messages, {REPLY_FIELD: reply.source}, prompt.chat_template_kwargs, call.where)
        return TrafficRow(kept, False, reply, prompt_ids)

    def _mode_refused(self, prompt: Prompt, kwargs: Mapping[str, Any], modes: dict[str, str | None], rendered: bool) -> str | None:
        """Why `responses` would refuse the prompt's template kwargs (`chat.check_template_kwargs`), or None; one look
        per mode, kept once a prompt of it rendered (a prompt that renders in no mode tells nothing of its kwargs)."""
        label = mode_label(kwargs)
        if label in modes:
            return modes[label]
        try:
            check_template_kwargs(self.tokenizer, [prompt], self.run_kwargs)
            verdict = None
        except TemplateKwargsError as e:
            # Its message starts by naming the prompt and its file:line, which the dropped line names already.
            verdict = str(e).split(": ", 1)[1] if str(e).startswith("prompt ") else str(e)
        if verdict is not None or rendered:
            modes[label] = verdict
        return verdict


class _Drop(Exception):
    """A call judged unfit; the message says why."""


def _file_line(where: str, files: list[str]) -> tuple[int, int]:
    name, _, line = where.rpartition(":")
    return (files.index(name) if name in files else len(files), int(line) if line.isdigit() else 0)


# --- the prompt set responses generates from -----------------------------------------------------------------


def generation_set(base: Sequence[Prompt], train: Sequence[Prompt], previous_ids: Sequence[str]) -> list[Prompt]:
    """The store's prompts and the log's training prompts: each where it was in the set written last
    (`previous_ids`), the new ones after them in the order they come (the prompt file's, then the log's)."""
    now = {p.id: p for p in (*base, *train)}
    kept = [now[i] for i in dict.fromkeys(previous_ids) if i in now]
    placed = {p.id for p in kept}
    return kept + [p for p in (*base, *train) if p.id not in placed]


def write_traffic(store: ArtifactStore, result: TrafficResult, base: Sequence[Prompt]) -> tuple[list[Prompt], bytes]:
    """Write the prompt set, the held-out prompts, the logged replies and the report; returns the set and the bytes
    its data version is a digest of (the set, the held-out prompts and the replies)."""
    prompts = prompt_set_now(store, result, base)
    replies = "".join(
        json.dumps({"id": r.prompt.id, "prompt_token_ids": r.prompt_token_ids,
                    "completion_token_ids": r.reply.completion_token_ids}) + "\n"
        for r in result.rows if r.reply is not None and r.reply.source == "logged"
    )  # fmt: skip
    texts = {TRAFFIC_PROMPTS_FILE: dump_prompts(prompts), TRAFFIC_HELDOUT_FILE: dump_prompts(result.heldout),
             TRAFFIC_REPLIES_FILE: replies}  # fmt: skip
    for path, text in texts.items():
        store.write_text(path, text)
    store.write_json(TRAFFIC_REPORT_FILE, result.as_report())
    return prompts, "".join(texts.values()).encode()


def prompt_set_now(store: ArtifactStore, result: TrafficResult, base: Sequence[Prompt]) -> list[Prompt]:
    """The set `write_traffic` writes (and `--plan` counts): ordered by the one the store holds."""
    previous = [p.id for p in read_prompt_set(store)] if store.exists(TRAFFIC_PROMPTS_FILE) else []
    return generation_set(base, result.train, previous)


def kept_lines(store: ArtifactStore) -> dict[str, str]:
    """Each prompt's call kept the last time, by id: file:line (`TrafficBuild.build`'s `kept_before`)."""
    if not store.exists(TRAFFIC_REPORT_FILE):
        return {}
    return {r["id"]: r["where"] for r in store.read_json(TRAFFIC_REPORT_FILE).get("rows", [])}


def read_prompt_set(store: ArtifactStore) -> list[Prompt]:
    return parse_prompts(store.read_text(TRAFFIC_PROMPTS_FILE), store.url_of(TRAFFIC_PROMPTS_FILE))


def read_replies(store: ArtifactStore) -> dict[tuple[int, ...], list[int]]:
    """The logged replies by the prompt token ids they answer (what a generator is given)."""
    if not store.exists(TRAFFIC_REPLIES_FILE):
        return {}
    rows = [json.loads(line) for line in store.read_text(TRAFFIC_REPLIES_FILE).splitlines() if line.strip()]
    return {tuple(r["prompt_token_ids"]): r["completion_token_ids"] for r in rows}


def log_digest(url: str) -> str:
    """The log's version, for `traffic_prompts`' provenance: each file's name and content digest (cached by what its
    store says of it, `provenance.source_digest`), so appending to any file makes the asset due."""
    try:
        return digest([[name, source_digest(name)] for name in log_files(url)])
    except TrafficLogError as e:  # as a prompt file gone is: the plan and the conditions say so
        raise ProvenanceError(str(e)) from None


# --- logged replies in place of generation ----------------------------------------------------------------------


class LoggedReplies:
    """A generator that answers a prompt with its logged reply, the target's own greedy output, where the log holds
    one (`read_replies`), and sends the others to `inner`. A reply longer than `max_new_tokens` is cut there and
    finishes on `length`, as greedy generation under that limit would."""

    def __init__(self, inner: Generator, replies: Mapping[tuple[int, ...], list[int]], max_new_tokens: int):
        self.inner, self.replies, self.max_new_tokens = inner, replies, max_new_tokens
        self.name = inner.name
        self.stop_token_ids = inner.stop_token_ids
        self.served = 0  # rows answered from the log

    def generate(self, prompts: list[list[int]]) -> list[Generated]:
        logged = {i: self.replies[tuple(p)] for i, p in enumerate(prompts) if tuple(p) in self.replies}
        rest = [p for i, p in enumerate(prompts) if i not in logged]
        generated = iter(self.inner.generate(rest) if rest else [])
        out = []
        for i in range(len(prompts)):
            if i not in logged:
                out.append(next(generated))
                continue
            ids = logged[i]
            cut = len(ids) > self.max_new_tokens
            out.append(Generated(ids[: self.max_new_tokens], "length" if cut else "stop"))
        self.served += len(logged)
        return out

    def close(self) -> None:
        self.inner.close()
