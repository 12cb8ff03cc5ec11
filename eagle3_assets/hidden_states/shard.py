"""Extract one shard of hidden states: preflight, resume at sample level, progress, manifest.

`plan_shard` is the preflight, and runs before any model is loaded (a 1T model takes
25 minutes to load; a refusal must not cost that). On rows [start, end) it
1. refuses when a row is longer than the model context or the store cannot be written;
2. removes leftovers of writers that died, and keeps every row file that fully
   validates (the integrity check's own per-row verdict); the rest is to be recomputed,
   so a partial or corrupt file is overwritten, never taken for a finished one.
   When anything is left to do, a stale `_SUCCESS.json` goes first: a shard being
   repaired never looks complete;
3. refuses when free disk is short of what is left to write (every byte of it: the
   hidden states, ids, mask and each file's header, `SampleSpec.projected_bytes`).

`run_shard` then, with the backend open,
4. writes each sample atomically as the backend returns it (or verifies the file a
   backend wrote itself), reporting progress at most every `progress_interval_s`
   seconds and once at the end;
5. writes `_SUCCESS.json` last.

Refusals are `Refusal`s: retrying them cannot help, so Dagster does not.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from fractions import Fraction

from eagle3_assets.crash_points import crash_point
from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.figures import duration
from eagle3_assets.hidden_states.base import ExtractedSample, ExtractionRequest, HiddenStateExtractor, WrittenSample
from eagle3_assets.hidden_states.integrity import inspect_rows, manifest_problem
from eagle3_assets.hidden_states.manifest import ShardManifest
from eagle3_assets.sample_file import (
    FORMAT,
    MISSING,
    SampleSpec,
    encode_sample,
    manifest_path,
    sample_path,
    sample_problem,
    shard_dir,
    written_sample_problem,
)
from eagle3_assets.settings import ExtractionSettings
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore, StoreError
from eagle3_assets.tokenized import TokenizedSet

log = logging.getLogger(__name__)


class ShardExtractionError(Eagle3Error, RuntimeError):
    """A shard cannot be extracted; the message names the shard, and the row where there is one."""


class ShardRefusal(Refusal, ShardExtractionError):
    """The shard was refused before any work: retrying cannot help."""


class RowTooLongError(ShardRefusal):
    pass


class StoreNotWritableError(ShardRefusal):
    pass


class InsufficientSpaceError(ShardRefusal):
    pass


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class ExtractionProgress:
    """Figures of a running shard; `as_metadata()` is what a progress observation carries."""

    shard: str
    samples_done: int  # valid files present: skipped + computed
    samples_total: int
    samples_skipped: int
    tokens_done: int
    tokens_total: int
    seconds: float  # since computing started
    samples_per_s: float  # computed samples only: skipped ones cost no model time
    tokens_per_s: float
    bytes_written: int  # this run
    bytes_per_sample: float  # over all files present (skipped + written); 0 before any
    bytes_per_token: float
    eta_s: float | None  # remaining tokens / tokens_per_s; None before the first sample
    projected_bytes_all_shards: int | None  # every token of the tokenized set x bytes_per_token
    free_bytes: int | None  # None: unknown (object/memory store)
    final: bool

    def summary(self) -> str:
        """The figures a person watching the log needs, on one line."""
        eta = "unknown" if self.eta_s is None else duration(self.eta_s)
        free = "" if self.free_bytes is None else f", {_gb(self.free_bytes)} free"
        return (
            f"shard {self.shard}: {self.samples_done}/{self.samples_total} samples ({self.samples_skipped} kept), "
            f"{self.samples_per_s:.2f} samples/s, {self.tokens_per_s:,.0f} tokens/s, {_gb(self.bytes_written)} written, "
            f"ETA {eta}{free}"
        )

    def as_metadata(self) -> dict[str, float | int]:
        """A flat dict of numbers; unknown figures are left out rather than sent as None."""
        d = asdict(self)
        d.pop("shard")
        d["final"] = int(self.final)
        return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class ShardResult:
    shard: str
    rows_total: int
    rows_skipped: int  # already valid, kept
    rows_computed: int
    tokens: int  # all rows of the shard
    tokens_computed: int
    bytes: int  # all row files of the shard
    bytes_written: int
    seconds: float
    temporaries_removed: int
    repaired: dict[int, str] = field(default_factory=dict)  # row -> why its existing file was redone
    notes: list[str] = field(default_factory=list)
    manifest: ShardManifest | None = None

    def as_metadata(self) -> dict[str, float | int]:
        return {
            "rows_total": self.rows_total,
            "rows_skipped": self.rows_skipped,
            "rows_computed": self.rows_computed,
            "rows_repaired": len(self.repaired),
            "tokens": self.tokens,
            "tokens_computed": self.tokens_computed,
            "bytes": self.bytes,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "temporaries_removed": self.temporaries_removed,
        }


def check_rows_fit(tokenized: TokenizedSet, shard: Shard, max_context: int) -> None:
    """RowTooLongError naming the shard, the first row too long, and both lengths."""
    too_long = [r for r in shard.rows if tokenized.row_length(r) > max_context]
    if too_long:
        row = too_long[0]
        more = f" ({len(too_long)} rows of the shard are too long: {too_long[:10]})" if len(too_long) > 1 else ""
        raise RowTooLongError(
            f"shard {shard.key}: row {row} has {tokenized.row_length(row)} tokens, "
            f"more than the model context of {max_context} tokens{more}"
        )


def check_writable(store: ArtifactStore, shard: Shard) -> None:
    """Write and remove a probe in the shard directory; StoreNotWritableError naming shard and path."""
    try:
        store.check_writable(shard_dir(shard.key))
    except StoreError as e:
        raise StoreNotWritableError(
            f"shard {shard.key}: cannot write to {store.url_of(shard_dir(shard.key))}: {e}"
        ) from e


def preflight_disk(
    shard: Shard, *, remaining_tokens: int, remaining_files: int, spec: SampleSpec, margin: float, free: int | None,
    where: str, beside: Sequence[tuple[str, int]] = (),
) -> str:  # fmt: skip
    """Raise InsufficientSpaceError when free < (projected + beside) x (1 + margin); else return a note. `beside`: what
    else will be written to the disk before this shard's bytes can go (rolling mode, `rolling_disk_needs`), named."""
    projected = spec.projected_bytes(remaining_tokens, remaining_files)
    total = projected + sum(b for _, b in beside)
    # Exact decimal arithmetic: 28,160 x 1.05 in floats rounds up one byte too many.
    needed = total + math.ceil(total * Fraction(repr(margin)))
    formula = (
        f"{remaining_tokens:,} remaining tokens x {spec.bytes_per_token} bytes (4 x hidden {spec.hidden_size} in "
        f"{spec.dtype}, ids, mask) + {remaining_files:,} files x {spec.file_overhead(remaining_tokens // max(1, remaining_files))} header bytes"
        f" = {projected:,} bytes"
        + "".join(f"; + {b:,} bytes for {what}" for what, b in beside)
        + (f"; = {total:,} bytes" if beside else "")
        + f", plus {margin:.0%} margin"
    )
    if free is None:
        return (
            f"disk preflight skipped: free space is unknown on {where} "
            f"(needs {_gb(needed)} ({needed:,} bytes: {formula}))"
        )
    if free < needed:
        raise InsufficientSpaceError(
            f"shard {shard.key}: not enough free space on {where}: needs {_gb(needed)} ({needed:,} bytes: {formula}), "
            f"free {_gb(free)} ({free:,} bytes)"
        )
    return f"disk preflight ok: needs {_gb(needed)} ({needed:,} bytes), free {_gb(free)} ({free:,} bytes)"


def _final_manifest(
    store: ArtifactStore,
    tokenized: TokenizedSet,
    plan: ShardPlan,
    spec: SampleSpec,
    backend: str,
    tally: _Tally,
    *,
    seconds: float,
) -> ShardManifest:
    """The shard's manifest, written last. When nothing was redone, the manifest of the run that made these files
    still tells the truth and is kept."""
    shard = plan.shard
    if not plan.todo and manifest_problem(store, tokenized, shard, spec) is None:
        kept = ShardManifest.read(store, shard.key)
        if kept is not None:
            return kept
    manifest = ShardManifest(
        format=FORMAT, shard=shard.key, row_start=shard.start, row_end=shard.end, rows=len(shard),
        tokens=tally.tokens_total, bytes=tally.bytes_present + tally.bytes_written,
        aux_layer_ids=tuple(spec.aux_layer_ids), hidden_size=spec.hidden_size, dtype=spec.dtype,
        last_hidden_state_norm=spec.last_hidden_state_norm, model=spec.model or "", backend=backend,
        rows_computed=tally.computed, rows_skipped=tally.rows_skipped, seconds=round(seconds, 3),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    manifest.write(store)
    return manifest


@dataclass
class _Tally:
    """Running figures of one `extract_shard` call."""

    shard: Shard
    tokens_total: int  # rows of the shard
    tokens_all_shards: int  # the whole tokenized set
    rows_skipped: int
    tokens_todo: int
    bytes_present: int  # valid files kept from earlier runs
    started: float  # clock when computing began
    computed: int = 0
    tokens_computed: int = 0
    bytes_written: int = 0

    def progress(self, now: float, *, free: int | None, final: bool) -> ExtractionProgress:
        seconds = now - self.started
        done = self.rows_skipped + self.computed
        tokens_done = self.tokens_total - self.tokens_todo + self.tokens_computed
        bytes_now = self.bytes_present + self.bytes_written
        tokens_per_s = self.tokens_computed / seconds if seconds > 0 else 0.0
        bytes_per_token = bytes_now / tokens_done if tokens_done else 0.0
        if tokens_per_s > 0:
            eta = (self.tokens_total - tokens_done) / tokens_per_s
        else:
            eta = 0.0 if final else None
        return ExtractionProgress(
            shard=self.shard.key,
            samples_done=done,
            samples_total=len(self.shard),
            samples_skipped=self.rows_skipped,
            tokens_done=tokens_done,
            tokens_total=self.tokens_total,
            seconds=round(seconds, 3),
            samples_per_s=self.computed / seconds if seconds > 0 else 0.0,
            tokens_per_s=tokens_per_s,
            bytes_written=self.bytes_written,
            bytes_per_sample=bytes_now / done if done else 0.0,
            bytes_per_token=bytes_per_token,
            eta_s=eta,
            projected_bytes_all_shards=round(self.tokens_all_shards * bytes_per_token) if tokens_done else None,
            free_bytes=free,
            final=final,
        )


def _write_sample(
    store: ArtifactStore, tokenized: TokenizedSet, shard: Shard, sample: ExtractedSample, spec: SampleSpec, backend: str
) -> int:
    """Encode, validate and atomically write one row's file; returns its size."""
    row = sample.row
    ids, mask = tokenized.row(row)
    data = encode_sample(
        row=row,
        input_ids=sample.input_ids,
        loss_mask=mask,
        aux_hidden_states=sample.aux_hidden_states,
        last_hidden_state=sample.last_hidden_state,
        spec=spec,
        backend=backend,
    )
    # Validate where it is written, with the check's own rules: a bad sample never lands.
    problem = sample_problem(data, row=row, input_ids=ids, loss_mask=mask, spec=spec)
    if problem:
        raise ShardExtractionError(
            f"shard {shard.key} row {row}: the {backend} backend produced an invalid sample, not written: {problem}"
        )
    try:
        return store.write_bytes(sample_path(shard.key, row), data)
    except (StoreError, OSError) as e:
        where = store.url_of(sample_path(shard.key, row))
        raise ShardExtractionError(f"shard {shard.key} row {row}: cannot write {where}: {e}") from e


def _verify_written(store: ArtifactStore, tokenized: TokenizedSet, shard: Shard, written: WrittenSample, spec: SampleSpec) -> int:
    """Check a file the backend wrote itself (header, ids, mask: its values were checked where they
    were computed); a bad one is removed and fails the shard. Returns its size."""
    rel = sample_path(shard.key, written.row)
    ids, mask = tokenized.row(written.row)
    try:
        problem, size = written_sample_problem(
            str(store.local_path(rel)), row=written.row, input_ids=ids, loss_mask=mask, spec=spec
        )
    except OSError as e:
        raise ShardExtractionError(f"shard {shard.key} row {written.row}: the backend's file is unreadable: {e}") from e
    if problem:
        store.remove(rel)
        raise ShardExtractionError(
            f"shard {shard.key} row {written.row}: the file the backend wrote ({store.url_of(rel)}) is invalid and was "
            f"removed: {problem}"
        )
    return size


@dataclass
class ShardPlan:
    """What `plan_shard` found: the rows left to compute, and what the run keeps from earlier ones."""

    shard: Shard
    spec: SampleSpec  # hidden size, aux ids, dtype, model; the norm is the backend's, set when it writes
    todo: list[int]
    repaired: dict[int, str]  # row -> why its existing file will be redone
    bytes_present: int  # valid files kept
    temporaries_removed: int
    notes: list[str]
    started: float

    @property
    def rows_skipped(self) -> int:
        return len(self.shard) - len(self.todo)


def plan_shard(
    store: ArtifactStore,
    tokenized: TokenizedSet,
    shard: Shard,
    spec: SampleSpec,
    settings: ExtractionSettings,
    *,
    max_context: int,
    free_bytes: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    beside: Sequence[tuple[str, int]] = (),
) -> ShardPlan:
    """The preflight (steps 1-3 of the module docstring): raises a `ShardRefusal`, or says what is left to do.

    `spec.last_hidden_state_norm` None accepts files of either convention (each records its own);
    `free_bytes` overrides the store's free-space figure (tests); `beside`: what else the disk must take, named.
    """
    started = clock()
    if shard.end > tokenized.num_rows:
        raise ShardRefusal(f"shard {shard.key} ends past the tokenized set of {tokenized.num_rows} rows")
    check_rows_fit(tokenized, shard, max_context)
    check_writable(store, shard)
    removed = store.remove_temporaries(shard_dir(shard.key))
    statuses = inspect_rows(store, tokenized, shard, spec)
    todo = [s.row for s in statuses if not s.ok]
    repaired = {s.row: s.problem for s in statuses if not s.ok and s.problem != MISSING}
    for row, problem in repaired.items():
        log.warning("shard %s row %d: existing file redone: %s", shard.key, row, problem)
    notes = [f"removed {removed} temporary file(s) left by an interrupted writer"] if removed else []
    if todo:
        # The shard is incomplete whatever happens next: it must not look finished.
        store.remove(manifest_path(shard.key))
        note = preflight_disk(
            shard,
            remaining_tokens=sum(tokenized.row_length(r) for r in todo),
            remaining_files=len(todo),
            spec=spec,
            margin=settings.disk_margin,
            free=free_bytes if free_bytes is not None else store.free_bytes(),
            where=store.url_of(shard_dir(shard.key)),
            beside=beside,
        )
        notes.append(note)
        log.info("shard %s: %s", shard.key, note)
    bytes_present = sum(s.bytes for s in statuses if s.ok)
    return ShardPlan(shard, spec, todo, repaired, bytes_present, removed, notes, started)


def completed_shard(store: ArtifactStore, tokenized: TokenizedSet, plan: ShardPlan) -> ShardResult | None:
    """The shard's result when every row is already valid and its manifest agrees: no backend needed."""
    shard = plan.shard
    if plan.todo or manifest_problem(store, tokenized, shard, plan.spec) is not None:
        return None
    manifest = ShardManifest.read(store, shard.key)
    return ShardResult(
        shard=shard.key, rows_total=len(shard), rows_skipped=len(shard), rows_computed=0,
        tokens=tokenized.tokens_in(shard.start, shard.end), tokens_computed=0, bytes=plan.bytes_present,
        bytes_written=0, seconds=0.0, temporaries_removed=plan.temporaries_removed, notes=plan.notes, manifest=manifest,
    )  # fmt: skip


def run_shard(
    store: ArtifactStore,
    tokenized: TokenizedSet,
    plan: ShardPlan,
    extractor: HiddenStateExtractor,
    settings: ExtractionSettings,
    *,
    on_progress: Callable[[ExtractionProgress], None] | None = None,
    free_bytes: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ShardResult:
    """Steps 4-5: compute the planned rows with `extractor`, then write `_SUCCESS.json`."""
    shard, key = plan.shard, plan.shard.key
    check_rows_fit(tokenized, shard, extractor.max_context)  # a server may serve less context than the config says
    spec = replace(plan.spec, last_hidden_state_norm=extractor.last_hidden_state_norm)

    def free_now() -> int | None:
        return free_bytes if free_bytes is not None else store.free_bytes()

    tally = _Tally(
        shard=shard,
        tokens_total=tokenized.tokens_in(shard.start, shard.end),
        tokens_all_shards=tokenized.num_tokens,
        rows_skipped=plan.rows_skipped,
        tokens_todo=sum(tokenized.row_length(r) for r in plan.todo),
        bytes_present=plan.bytes_present,
        started=clock(),
    )
    last_emit = tally.started
    pending = {r: tokenized.row_length(r) for r in plan.todo}
    local_dir = store.local_path(shard_dir(key))
    direct = bool(plan.todo) and extractor.writes_files(local_dir)

    def request(row: int) -> ExtractionRequest:
        ids, mask = tokenized.row(row)
        path = str(store.local_path(sample_path(key, row))) if direct else None
        return ExtractionRequest(row=row, input_ids=ids, loss_mask=mask, path=path)

    for sample in extractor.extract([request(r) for r in plan.todo], spec) if plan.todo else ():
        if sample.row not in pending:
            raise ShardExtractionError(
                f"shard {key}: the {extractor.backend} backend returned row {sample.row}, "
                "which was not requested or came twice"
            )
        if isinstance(sample, WrittenSample):
            tally.bytes_written += _verify_written(store, tokenized, shard, sample, spec)
        else:
            tally.bytes_written += _write_sample(store, tokenized, shard, sample, spec, extractor.backend)
        tally.tokens_computed += pending.pop(sample.row)
        tally.computed += 1
        crash_point(f"extracted:{key}:{tally.computed}")
        now = clock()
        if on_progress is not None and now - last_emit >= settings.progress_interval_s:
            on_progress(tally.progress(now, free=free_now(), final=False))
            last_emit = now
    if pending:
        rows = sorted(pending)
        raise ShardExtractionError(
            f"shard {key}: the {extractor.backend} backend returned no sample for {len(rows)} row(s): {rows[:10]}"
        )

    t_end = clock()
    if on_progress is not None:
        on_progress(tally.progress(t_end, free=free_now(), final=True))
    total_bytes = tally.bytes_present + tally.bytes_written
    manifest = _final_manifest(store, tokenized, plan, spec, extractor.backend, tally, seconds=t_end - plan.started)
    notes = plan.notes + ([f"{extractor.backend} backend wrote each file itself (one write per sample)"] if direct else [])
    return ShardResult(
        shard=key, rows_total=len(shard), rows_skipped=tally.rows_skipped, rows_computed=tally.computed,
        tokens=tally.tokens_total, tokens_computed=tally.tokens_computed, bytes=total_bytes,
        bytes_written=tally.bytes_written, seconds=t_end - plan.started, temporaries_removed=plan.temporaries_removed,
        repaired=plan.repaired, notes=notes, manifest=manifest,
    )  # fmt: skip


def extract_shard(
    store: ArtifactStore,
    tokenized: TokenizedSet,
    shard: Shard,
    extractor: HiddenStateExtractor,
    settings: ExtractionSettings,
    *,
    model_name: str,
    on_progress: Callable[[ExtractionProgress], None] | None = None,
    free_bytes: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ShardResult:
    """`plan_shard` then `run_shard` with a backend already open (scripts, tests, benchmarks).

    The `hidden_states` asset plans before it opens the backend, so a refusal never waits for a model load.
    """
    spec = SampleSpec(extractor.hidden_size, tuple(extractor.aux_layer_ids), settings.storage_dtype, model_name)
    plan = plan_shard(
        store, tokenized, shard, spec, settings, max_context=extractor.max_context, free_bytes=free_bytes, clock=clock
    )
    return run_shard(
        store, tokenized, plan, extractor, settings, on_progress=on_progress, free_bytes=free_bytes, clock=clock
    )
