"""Integrity of hidden-state shards: every row's file present, loadable and right.

The per-row verdict (`inspect_rows`) is also what extraction resumes from, so a file
that extraction skips is exactly a file this check accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.errors import Refusal
from eagle3_assets.hidden_states.manifest import ManifestError, ShardManifest
from eagle3_assets.provenance import RECORD_NAME
from eagle3_assets.sample_file import (
    CHECK_RECORD_NAME,
    MANIFEST_NAME,
    MISSING,
    SAMPLE_SUFFIX,
    SampleSpec,
    sample_path,
    sample_problem,
    sample_row,
    shard_dir,
)
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore, StoreError
from eagle3_assets.tokenized import TokenizedSet


class StaleShardKeyError(Refusal, ValueError):
    """A registered shard key that the current tokenized set does not cover."""


@dataclass(frozen=True)
class RowStatus:
    row: int
    problem: str | None  # None: the file is valid
    bytes: int  # file size; 0 when missing

    @property
    def ok(self) -> bool:
        return self.problem is None


def inspect_rows(
    store: ArtifactStore, tokenized: TokenizedSet, shard: Shard, spec: SampleSpec, rows: Sequence[int] | None = None
) -> list[RowStatus]:
    """The verdict on each row's file (all rows of the shard by default)."""
    present = set(store.listdir(shard_dir(shard.key)))  # one listing, not one existence check per row
    out = []
    for row in shard.rows if rows is None else rows:
        if f"{row}{SAMPLE_SUFFIX}" not in present:
            out.append(RowStatus(row, MISSING, 0))
            continue
        try:
            data = store.read_bytes(sample_path(shard.key, row))
        except (StoreError, OSError) as e:
            out.append(RowStatus(row, f"unreadable ({e})", 0))
            continue
        ids, mask = tokenized.row(row)
        out.append(RowStatus(row, sample_problem(data, row=row, input_ids=ids, loss_mask=mask, spec=spec), len(data)))
    return out


@dataclass(frozen=True)
class ShardCheckReport:
    shard: str
    rows_expected: int
    rows_ok: int
    tokens: int  # tokens of the shard's rows (tokenized set)
    bytes: int  # bytes of the row files present
    problems: dict[str, str] = field(default_factory=dict)  # "rows_0-200/17.safetensors" -> reason

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rows_checked(self) -> int:
        return self.rows_expected

    def problem_lines(self) -> list[str]:
        """One line per bad file, in row order; consecutive rows with the same problem (a shard never
        extracted: every row missing) folded into one line naming the first and last file."""
        lines: list[str] = []
        run: list[tuple[str, str]] = []

        def flush() -> None:
            if len(run) > 2:
                lines.append(f"{run[0][0]} … {run[-1][0].rsplit('/', 1)[-1]}: {run[0][1]} ({len(run)} files)")
            else:
                lines.extend(f"{path}: {why}" for path, why in run)
            run.clear()

        previous: int | None = None
        for path, why in self.problems.items():
            row = sample_row(path.rsplit("/", 1)[-1])
            if not (run and row is not None and previous is not None and row == previous + 1 and why == run[0][1]):
                flush()
            run.append((path, why))
            previous = row
        flush()
        return lines

    def summary(self, limit: int = 20) -> str:
        if self.ok:
            return f"{self.shard}: all {self.rows_expected} rows valid ({self.tokens:,} tokens, {self.bytes:,} bytes)"
        lines = self.problem_lines()
        shown = lines[:limit] + ([f"… and {len(lines) - limit} more"] if len(lines) > limit else [])
        bad_rows = self.rows_expected - self.rows_ok
        head = f"{self.shard}: {bad_rows} of {self.rows_expected} rows bad, {len(self.problems)} problems"
        return "\n".join([head, *shown])

    def as_metadata(self) -> dict[str, int]:
        return {
            "rows_expected": self.rows_expected,
            "rows_ok": self.rows_ok,
            "problems": len(self.problems),
            "tokens": self.tokens,
            "bytes": self.bytes,
        }


def manifest_problem(store: ArtifactStore, tokenized: TokenizedSet, shard: Shard, spec: SampleSpec) -> str | None:
    """Why the shard's `_SUCCESS.json` is missing or disagrees with the shard, or None."""
    try:
        m = ShardManifest.read(store, shard.key)
    except ManifestError as e:
        return str(e)
    if m is None:
        return "missing (the shard never completed)"
    expected = {
        "rows": len(shard),
        "tokens": tokenized.tokens_in(shard.start, shard.end),
        "aux_layer_ids": tuple(spec.aux_layer_ids),
        "hidden_size": spec.hidden_size,
        "dtype": spec.dtype,
    }
    for key, want in expected.items():
        if getattr(m, key) != want:
            return f"{key} is {getattr(m, key)!r}, expected {want!r}"
    return None


def check_shard(
    store: ArtifactStore,
    tokenized: TokenizedSet,
    shard: Shard,
    *,
    hidden_size: int,
    aux_layer_ids: Sequence[int],
    dtype: str,
    model: str | None = None,
    last_hidden_state_norm: str | None = None,
    require_manifest: bool = True,
) -> ShardCheckReport:
    """Check every row file of `shard` (and its `_SUCCESS.json` unless require_manifest=False).

    `model` / `last_hidden_state_norm` None: any value is accepted (the norm must still be a known one).
    """
    if shard.end > tokenized.num_rows:
        raise StaleShardKeyError(
            f"shard {shard.key} ends past the tokenized set of {tokenized.num_rows} rows: its key was registered for "
            "an earlier tokenized set (another shard_size or prompt set); re-materialize tokenized, which registers "
            "the current keys, and run the shards it lists"
        )
    spec = SampleSpec(
        hidden_size=hidden_size,
        aux_layer_ids=tuple(aux_layer_ids),
        dtype=dtype,
        model=model,
        last_hidden_state_norm=last_hidden_state_norm,
    )
    statuses = inspect_rows(store, tokenized, shard, spec)
    problems = {f"{shard.key}/{s.row}{SAMPLE_SUFFIX}": s.problem for s in statuses if s.problem is not None}

    expected_names = {f"{r}{SAMPLE_SUFFIX}" for r in shard.rows} | {MANIFEST_NAME, CHECK_RECORD_NAME, RECORD_NAME}
    for name in store.listdir(shard_dir(shard.key)):
        if name not in expected_names:
            problems[f"{shard.key}/{name}"] = "unexpected file (not a row of this shard)"
    if require_manifest:
        problem = manifest_problem(store, tokenized, shard, spec)
        if problem:
            problems[f"{shard.key}/{MANIFEST_NAME}"] = problem

    return ShardCheckReport(
        shard=shard.key,
        rows_expected=len(shard),
        rows_ok=sum(s.ok for s in statuses),
        tokens=tokenized.tokens_in(shard.start, shard.end),
        bytes=sum(s.bytes for s in statuses),
        problems=problems,
    )


def check_shards(
    store: ArtifactStore, tokenized: TokenizedSet, shards: Sequence[Shard], **spec: Any
) -> list[ShardCheckReport]:
    """`check_shard` over each shard, in order, with the same keyword arguments; nothing is re-extracted."""
    return [check_shard(store, tokenized, shard, **spec) for shard in shards]
