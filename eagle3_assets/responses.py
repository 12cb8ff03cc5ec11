"""The `responses` artifact: the target's answer to every prompt, generated resumably.

Each row records the prompt exactly as the engine saw it (`prompt_token_ids`: the chat
template with the generation prompt, rendered once) and exactly what the engine
produced (`completion_token_ids`, the stop token included when it stopped on one), with
`finish_reason`: that pair is the training row. `chat_template_kwargs` records what the
prompt was rendered with: the run-wide kwargs and the prompt's own, merged. The messages
keep the answer's text and its reasoning apart (`content`, `reasoning_content`) for
people, decoded from those ids.

Rows are generated in parts of `rows_per_part` prompts; each part is written
atomically to `responses/parts/part-NNNNN.jsonl`, so a killed run keeps every
finished part and the rerun generates only what is missing (and retries rows that
failed). A row the engine failed (`retryable`) leaves the asset due (`ResponsesSummary.retry`, kept in its record),
so the next materialization retries it, up to `generation.max_row_attempts` sends to the engine (its record counts
them, `attempts`): a row the engine keeps failing (a server context below the row, a request that always times out)
is then given up, reported as not generated with its last error, and keeps nothing due, so `tokenized` and what
follows go on without it. A row that cannot be generated as set (a prompt over `max_seq_len`, a
template error) is said once and not retried until something changes. When all parts exist they are joined into `responses/responses.jsonl`.
A part is trusted only if it parses, holds exactly the prompt ids it should, rendered with
the template kwargs they are rendered with now, and was written in this format (parts of
the earlier, text-only format are regenerated). Each row is stamped (`made_by`) with what made it:
the target, the generation settings and the prompt's own content (`Renderer.stamp`, docs/DESIGN.md §9);
a row with another stamp is generated again, so appended prompts generate only the new rows and another
target or other generation settings regenerate all of them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3_assets.chat import ChatTemplateError, check_template_kwargs, generation_prompt_ids, mode_label
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.figures import duration
from eagle3_assets.generation.base import Generated, Generator
from eagle3_assets.prompts import Prompt
from eagle3_assets.provenance import digest
from eagle3_assets.reasoning import ReasoningFormat, split_completion
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.storage import ArtifactStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

PARTS_DIR = "responses/parts"
RESPONSES_FILE = "responses/responses.jsonl"
TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids")


STALE = "made from other inputs (another target, generation settings or prompt): generated again"
# A row of a store made before rows were stamped: what made it is unknown, so it is never trusted (said, not silent).
UNSTAMPED = "made before provenance was kept (no record of the target and settings that made it): generated again"


class ResponsesError(Eagle3Error, RuntimeError):
    """Too many rows failed; everything generated is kept and a rerun retries the failures."""


@dataclass(frozen=True)
class ResponsesProgress:
    rows_done: int
    rows_total: int
    rows_generated: int  # in this run
    rows_failed: int
    completion_tokens: int  # in this run
    seconds: float

    def summary(self) -> str:
        """The figures a person watching the log needs, on one line."""
        figures = self.as_metadata()
        eta = duration(figures["eta_s"]) if figures["eta_s"] >= 0 else "unknown"
        return (
            f"responses: {self.rows_done}/{self.rows_total} rows, {self.rows_failed} failed, "
            f"{figures['rows_per_s']} rows/s, {figures['tokens_per_s']} tokens/s, ETA {eta}"
        )

    def as_metadata(self) -> dict[str, float | int]:
        rate = self.rows_generated / self.seconds if self.seconds > 0 else 0.0
        left = self.rows_total - self.rows_done
        return {
            "rows_done": self.rows_done,
            "rows_total": self.rows_total,
            "rows_failed": self.rows_failed,
            "rows_per_s": round(rate, 3),
            "tokens_per_s": round(self.completion_tokens / self.seconds, 1) if self.seconds > 0 else 0.0,
            "eta_s": round(left / rate, 1) if rate > 0 else -1.0,
        }


@dataclass(frozen=True)
class ResponsesSummary:
    rows: int
    rows_failed: int
    rows_reused: int  # taken from parts written by an earlier run
    rows_generated: int
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    finish_length: int  # rows cut by max_new_tokens
    bytes: int
    seconds: float
    first_errors: list[str]
    modes: dict[str, int]  # rows per set of chat-template kwargs ('{}' = the template's defaults)
    rows_to_retry: int = 0  # of the failed rows, those the engine failed: the next materialization retries them
    rows_given_up: int = 0  # of the failed rows, those the engine failed `generation.max_row_attempts` times
    given_up: list[str] = field(default_factory=list)  # the first of them, each with its last error

    def as_metadata(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def retry(self) -> str | None:
        """Why the asset is due again though made as the settings say (kept in its record), or None."""
        if not self.rows_to_retry:
            return None
        return (
            f"{self.rows_to_retry} row(s) failed in the engine and are retried on the next materialization "
            f"(first: {'; '.join(self.first_errors[:2])})"
        )


def part_path(index: int) -> str:
    return f"{PARTS_DIR}/part-{index:05d}.jsonl"


def made_by(settings: Mapping[str, Any], target_version: str, code: int) -> str:
    """What every row generated now is made from, its prompt aside: the generation settings in `responses`' provenance,
    the target's version and the code revision."""
    return digest({"settings": settings, "target_model": target_version, "code": code})


@dataclass(frozen=True)
class RowStamps:
    """What a row is stamped with, and rendered with: enough to tell a row made before is kept, without the tokenizer
    (`rows_to_generate`, the start command's `--plan`)."""

    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # run-wide; a prompt's own go over them
    made_by: str = ""  # `made_by(...)`: the target and generation settings a row is generated with

    def template_kwargs(self, prompt: Prompt) -> dict[str, Any]:
        return prompt.template_kwargs(self.chat_template_kwargs)

    def stamp(self, prompt: Prompt) -> str:
        """What a row of `prompt` generated now is made from: the settings, the target and the prompt itself."""
        return digest([self.made_by, prompt.id, prompt.messages, self.template_kwargs(prompt), prompt.extra])


@dataclass(frozen=True)
class Renderer:
    """Everything that turns prompts into engine input and engine output into a record."""

    tokenizer: PreTrainedTokenizerBase
    reasoning: ReasoningFormat
    stop_token_ids: set[int]
    max_seq_len: int  # a prompt this long leaves no room for an answer in a training row
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # run-wide; a prompt's own go over them
    made_by: str = ""  # `made_by(...)`: the target and generation settings a row is generated with

    @property
    def stamps(self) -> RowStamps:
        return RowStamps(self.chat_template_kwargs, self.made_by)

    def template_kwargs(self, prompt: Prompt) -> dict[str, Any]:
        return self.stamps.template_kwargs(prompt)

    def stamp(self, prompt: Prompt) -> str:
        return self.stamps.stamp(prompt)


def render(prompt: Prompt, renderer: Renderer) -> list[int] | str:
    """The prompt's token ids, or why it cannot be generated (its error)."""
    try:
        ids = generation_prompt_ids(renderer.tokenizer, prompt.messages, renderer.template_kwargs(prompt))
    except ChatTemplateError as e:
        return str(e)
    if len(ids) >= renderer.max_seq_len:
        return (
            f"prompt has {len(ids)} tokens, max_seq_len is {renderer.max_seq_len}: no room for an answer in a "
            "training row (not generated)"
        )
    return ids


def response_record(
    row: int, prompt: Prompt, prompt_ids: list[int] | None, g: Generated, renderer: Renderer, attempts: int = 1
) -> dict[str, Any]:
    """One row; a failed one says whether a retry may succeed (`retryable`: the engine failed it, not its prompt) and
    how many sends in a row the engine failed (`attempts`)."""
    messages = list(prompt.messages)
    reasoning_tokens = 0
    if g.error is None and prompt_ids is not None:
        split = split_completion(
            renderer.tokenizer, renderer.reasoning, prompt_ids, g.completion_token_ids, renderer.stop_token_ids
        )
        messages.append({"role": "assistant", "content": split.content, "reasoning_content": split.reasoning})
        reasoning_tokens = split.reasoning_tokens
    return {
        "id": prompt.id,
        "row": row,
        "messages": messages,
        "chat_template_kwargs": renderer.template_kwargs(prompt),
        "prompt_token_ids": prompt_ids or [],
        "completion_token_ids": g.completion_token_ids,
        "finish_reason": g.finish_reason,
        "usage": {
            "prompt_tokens": len(prompt_ids or []),
            "completion_tokens": len(g.completion_token_ids),
            "reasoning_tokens": reasoning_tokens,
        },
        "error": g.error,
        **({"retryable": prompt_ids is not None} if g.error is not None else {}),
        # Sends to the engine that failed in a row, under what makes the row now (`made_by`).
        **({"attempts": attempts} if g.error is not None and prompt_ids is not None else {}),
        **prompt.extra,
        "made_by": renderer.stamp(prompt),
    }


def _read_part(store: ArtifactStore, index: int, chunk: list[Prompt], renderer: RowStamps) -> list[dict[str, Any]] | None:
    """The part's records if it is complete and matches the prompts and their template kwargs, else None
    (it will be regenerated)."""
    if not store.exists(part_path(index)):
        return None
    try:
        records = [json.loads(line) for line in store.read_text(part_path(index)).splitlines()]
    except (ValueError, UnicodeDecodeError):
        return None
    expected = [(p.id, renderer.template_kwargs(p)) for p in chunk]
    # A part written before prompts were appended holds a prefix of its chunk: its rows are kept.
    if not records or [(r.get("id"), r.get("chat_template_kwargs", {})) for r in records] != expected[: len(records)]:
        return None
    if not all(all(f in r for f in TOKEN_FIELDS) for r in records):
        return None
    # A row made by another target, other settings or another prompt under the same id is redone.
    # Attempts count under what makes the row now: another stamp starts them over.
    kept = [
        r if r.get("made_by") == renderer.stamp(p) else {**r, "error": STALE if "made_by" in r else UNSTAMPED, "attempts": 0}
        for r, p in zip(records, chunk)
    ]
    return kept + [{"error": "a prompt appended since this part was written"} for _ in chunk[len(records) :]]


def given_up(record: Mapping[str, Any], max_row_attempts: int) -> bool:
    """The engine failed this row `max_row_attempts` sends in a row: it is not sent again while what makes it stays."""
    return bool(record.get("error")) and record.get("attempts", 0) >= max_row_attempts


def rows_to_generate(
    store: ArtifactStore, prompts: list[Prompt], stamps: RowStamps, rows_per_part: int, max_row_attempts: int
) -> int:
    """How many of `prompts` the next `responses` generates (`generate_responses`' own rule, read only): every row its
    part does not hold made as `stamps` would stamp it now, and every failed row not given up."""
    size = rows_per_part
    parts = [_read_part(store, i, prompts[i * size : (i + 1) * size], stamps) for i in range((len(prompts) + size - 1) // size)]
    chunks = [prompts[i * size : (i + 1) * size] for i in range(len(parts))]
    return sum(
        len(c) if p is None else sum(1 for r in p if r.get("error") and not given_up(r, max_row_attempts))
        for p, c in zip(parts, chunks, strict=True)
    )


def generate_responses(
    store: ArtifactStore,
    prompts: list[Prompt],
    generator: Generator,
    renderer: Renderer,
    settings: GenerationSettings,
    *,
    on_progress: Callable[[ResponsesProgress], None] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> ResponsesSummary:
    started = time.monotonic()
    check_template_kwargs(renderer.tokenizer, prompts, renderer.chat_template_kwargs)
    store.remove_temporaries(PARTS_DIR)
    size = settings.rows_per_part
    num_parts = (len(prompts) + size - 1) // size
    for stale in store.listdir(PARTS_DIR):
        if stale.startswith("part-") and int(stale[5:10]) >= num_parts:
            store.remove(f"{PARTS_DIR}/{stale}")

    parts = [_read_part(store, index, prompts[index * size : (index + 1) * size], renderer.stamps) for index in range(num_parts)]
    _announce_redo(parts, log)
    done = reused = generated = failed = new_tokens = 0
    for index in range(num_parts):
        first = index * size
        chunk = prompts[first : first + size]
        records = parts[index]
        cap = settings.max_row_attempts
        redo = (
            list(range(len(chunk)))
            if records is None
            else [i for i, r in enumerate(records) if r.get("error") and not given_up(r, cap)]
        )
        if records is not None:
            reused += len(chunk) - len(redo)
        if redo:
            rendered = {i: render(chunk[i], renderer) for i in redo}
            ready = [i for i in redo if isinstance(rendered[i], list)]
            outputs = dict(zip(ready, generator.generate([rendered[i] for i in ready]), strict=True))
            records = records or [{} for _ in chunk]
            for i in redo:
                ids = rendered[i]
                g = outputs[i] if isinstance(ids, list) else Generated.failed(str(ids))
                attempts = records[i].get("attempts", 0) + 1
                records[i] = response_record(first + i, chunk[i], ids if isinstance(ids, list) else None, g, renderer, attempts)
                new_tokens += len(g.completion_token_ids)
            generated += len(redo)
            store.write_text(part_path(index), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            log(f"responses: part {index + 1}/{num_parts} written ({len(redo)} rows generated)")
        failed += sum(1 for r in records if r.get("error"))
        done += len(chunk)
        progress = ResponsesProgress(done, len(prompts), generated, failed, new_tokens, time.monotonic() - started)
        log(progress.summary())
        if on_progress is not None:
            on_progress(progress)

    return _join_parts(store, num_parts, reused, generated, settings, started)


def _announce_redo(parts: list[list[dict[str, Any]] | None], log: Callable[[str], None]) -> None:
    """Before anything is generated, what is generated again though it was generated before, and why: rows of a store
    made before provenance was kept, rows made from other inputs."""
    rows = [r for part in parts if part is not None for r in part]
    causes = Counter(r["error"] for r in rows if r.get("error") in (STALE, UNSTAMPED))
    if causes:
        log(
            f"responses: {sum(causes.values())} of {len(rows)} rows generated before are generated again: "
            + "; ".join(f"{n} {cause}" for cause, n in causes.items())
        )


def _join_parts(
    store: ArtifactStore, num_parts: int, reused: int, generated: int, settings: GenerationSettings, started: float
) -> ResponsesSummary:
    lines: list[str] = []
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0}
    errors: list[str] = []
    gave_up: list[str] = []
    finish_length = retry = 0
    modes: Counter[str] = Counter()
    for index in range(num_parts):
        for line in store.read_text(part_path(index)).splitlines():
            record = json.loads(line)
            for k in totals:
                totals[k] += record["usage"][k]
            if given_up(record, settings.max_row_attempts):
                gave_up.append(
                    f"row {record['row']} (id {record['id']}): not generated: the engine failed it {record['attempts']} "
                    f"times (generation.max_row_attempts {settings.max_row_attempts}), last: {record['error']}"
                )
                errors.append(gave_up[-1])
            elif record.get("error"):
                errors.append(f"row {record['row']} (id {record['id']}): {record['error']}")
                retry += bool(record.get("retryable"))
            finish_length += record["finish_reason"] == "length"
            modes[mode_label(record.get("chat_template_kwargs", {}))] += 1
            lines.append(line + "\n")
    nbytes = store.write_text(RESPONSES_FILE, "".join(lines))
    summary = ResponsesSummary(
        rows=len(lines),
        rows_failed=len(errors),
        rows_reused=reused,
        rows_generated=generated,
        bytes=nbytes,
        finish_length=finish_length,
        seconds=round(time.monotonic() - started, 3),
        first_errors=errors[:5],
        modes=dict(modes),
        rows_to_retry=retry,
        rows_given_up=len(gave_up),
        given_up=gave_up[:5],
        **totals,
    )
    rate = len(errors) / max(1, len(lines))
    if rate > settings.max_error_rate:
        raise ResponsesError(
            f"{len(errors)} of {len(lines)} rows failed ({rate:.1%}), above generation.max_error_rate "
            f"({settings.max_error_rate:.1%}); all rows are kept in {store.url_of(RESPONSES_FILE)} and a rerun "
            f"retries the failed ones. First errors: " + "; ".join(errors[:5])
        )
    return summary


def read_responses(store: ArtifactStore) -> list[dict[str, Any]]:
    return [json.loads(line) for line in store.read_text(RESPONSES_FILE).splitlines()]
