"""`python -m eagle3_assets.start --plan`: what the next start would run, why, and what it would cost.

A plan is a list of steps (an asset, or one shard of `hidden_states`), in the order the start command launches them:
tick after tick (`wave`), each tick's unpartitioned assets first, in graph order, then its shards in row order
(`start.py: GraphStart.run`). Each step says why it runs (the setting, input or code that changed, "never
materialized", or an input made again before it) and what it costs: rows to generate, shards and bytes to extract,
optimizer steps, and seconds, each measured from the store's own past materializations (`Rate`) where there are any;
where there are none it says so rather than guess.

Under the daemon a plan over `approval.limit_s` waits for a person (`over_limit`), until an `Approval` covers it.

Plain figures only here; `defs/plan.py` reads them from the Dagster instance and the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from eagle3_assets.errors import Eagle3Error
from eagle3_assets.figures import duration, size
from eagle3_assets.provenance import bytes_digest
from eagle3_assets.storage import ArtifactStore

NO_PAST = "no past run to measure from"
LATER = "hidden_states[…]"  # the shards a tokenized made again cuts with other rows: known once it is made


@dataclass(frozen=True)
class Rate:
    """Seconds (or bytes) per unit, measured over `units` units of past runs."""

    per_unit: float
    units: float
    unit: str  # "row", "shard row", "step"

    @classmethod
    def measured(cls, pairs: Sequence[tuple[float, float]], unit: str) -> Rate | None:
        """From (amount, units) pairs of past runs; None when they hold no unit."""
        units = sum(u for _, u in pairs)
        return cls(sum(a for a, _ in pairs) / units, units, unit) if units > 0 else None


@dataclass(frozen=True)
class Cost:
    """What a step costs. A figure left None is not one this step has (a shard generates no rows); `seconds` None
    means no past run to measure it from, and `basis` says what the figures were measured from."""

    rows: int | None = None  # responses to generate
    shards: int | None = None  # shards to extract
    bytes: float | None = None  # bytes the shards will hold
    steps: int | None = None  # optimizer steps
    seconds: float | None = None
    basis: str = NO_PAST

    def describe(self) -> str:
        parts = []
        if self.rows is not None:
            parts.append(f"{self.rows:,} rows to generate")
        if self.shards is not None and self.shards != 1:
            parts.append(f"{self.shards:,} shards")
        if self.bytes is not None:
            parts.append(f"~{size(self.bytes)} to write")
        if self.steps is not None:
            parts.append(f"~{self.steps:,} optimizer steps")
        parts.append(f"~{duration(self.seconds)}" if self.seconds is not None else "time unknown")
        return ", ".join(parts) + f" ({self.basis})"


@dataclass(frozen=True)
class Step:
    label: str  # `vocab_map`, `hidden_states[rows_0-20]`; `hidden_states[…]` for shards known only later
    made_before: bool  # a redo, or a first make
    reason: str
    cost: Cost
    wave: int  # the tick of the start command that launches it (0: the first)
    sharded: bool = False  # a shard: launched after the tick's unpartitioned assets


@dataclass(frozen=True)
class Plan:
    steps: list[Step]
    notes: list[str]  # what the plan cannot say exactly, said once

    @property
    def ordered(self) -> list[Step]:
        """In the order the start command launches them (`GraphStart.run`)."""
        return sorted(self.steps, key=lambda s: (s.wave, s.sharded))  # stable: graph order, then row order

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.ordered]

    def lines(self) -> list[str]:
        if not self.steps:
            return ["plan: nothing to run: everything is made as the current settings and inputs would make it"]
        out = [f"plan: {len(self.steps)} to run, in the order the start command runs them (--plan runs nothing)"]
        for step in self.ordered:
            what = "redo" if step.made_before else "make"
            out.append(f"  {step.label}: {what} ({step.reason}); {step.cost.describe()}")
        out.append("total: " + self.total())
        return out + [f"note: {n}" for n in self.notes]

    @property
    def seconds(self) -> float:
        """The measured seconds of every step (those with no past run count nothing: `unmeasured`)."""
        return sum(s.cost.seconds or 0 for s in self.steps)

    @property
    def unmeasured(self) -> int:
        return sum(1 for s in self.steps if s.cost.seconds is None)

    @property
    def digest(self) -> str:
        """What it runs and why, in order: a plan with another step or another reason is another plan."""
        return bytes_digest(json.dumps([[s.label, s.reason] for s in self.ordered]).encode())

    def total(self) -> str:
        costs = [s.cost for s in self.steps]
        rows = sum(c.rows or 0 for c in costs)
        shards = sum(c.shards or 0 for c in costs)
        nbytes = sum(c.bytes or 0 for c in costs)
        steps = sum(c.steps or 0 for c in costs)
        text = (
            f"{rows:,} rows to generate, {shards:,} shard{'s' if shards != 1 else ''} (~{size(nbytes)}) to extract, ~{steps:,} optimizer steps; "
            f"~{duration(self.seconds)} measured from past runs"
        )
        return text + (f", {self.unmeasured} step(s) with {NO_PAST}" if self.unmeasured else "")


# --- approval: a plan over `approval.limit_s` waits under the daemon for a person -----------------------------

APPROVAL_FILE = "approval/plan.json"  # in the store, beside the artifacts the plan makes
LIMIT_FIELD = "approval.limit_s"
APPROVE = "python -m eagle3_assets.start --approve"


def over_limit(plan: Plan, limit_s: float | None) -> str | None:
    """Why `plan` needs a person's approval, or None when it does not (no limit, nothing to run, measured under it)."""
    if limit_s is None or not plan.steps:
        return None
    cost = f"plan ~{duration(plan.seconds)} ({len(plan.steps)} to run)"
    if plan.seconds > limit_s:
        return f"{cost} over the limit of {duration(limit_s)} ({LIMIT_FIELD})"
    if plan.unmeasured:
        return (
            f"{cost} and {plan.unmeasured} step(s) with {NO_PAST}: not known to be under the limit of "
            f"{duration(limit_s)} ({LIMIT_FIELD})"
        )
    return None


class ApprovalUnreadable(Eagle3Error):
    """`APPROVAL_FILE` is not an approval; the message names it."""


@dataclass(frozen=True)
class Approval:
    """A person's approval of a plan (`APPROVE`, or the `approve_plan` job). It holds while the graph is being made
    toward what the plan was made for (`toward`: the settings each asset reads, the code, the prompt file and the
    target) and what is due stays among the steps it approved: as the plan runs, its steps leave it and the reasons
    of the rest change ("input made again" becomes "made from other inputs"), and that is the same plan, in
    progress. Another setting, another prompt file, or a step it did not list is a new plan: approved again."""

    digest: str  # the plan approved (`Plan.digest`)
    toward: str  # what it makes the graph from
    labels: tuple[str, ...]
    total: str
    by: str
    at: float

    @classmethod
    def of(cls, plan: Plan, toward: str, by: str) -> Approval:
        return cls(plan.digest, toward, tuple(plan.labels), plan.total(), by, time.time())

    def covers(self, plan: Plan, toward: str) -> bool:
        # The shards a `tokenized` made again cuts are known once it is made: `hidden_states[…]` approved them.
        later = LATER in self.labels
        return toward == self.toward and all(
            s.label in self.labels or (later and s.label.startswith("hidden_states[")) for s in plan.steps
        )

    def save(self, store: ArtifactStore) -> None:
        store.write_json(APPROVAL_FILE, asdict(self))  # atomic: a reader sees the old approval or the new one

    @classmethod
    def read(cls, store: ArtifactStore) -> Approval | None:
        """The approval in the store, None when there is none; `ApprovalUnreadable` naming the file when it is not one
        (edited by hand, written by another version)."""
        if not store.exists(APPROVAL_FILE):
            return None
        try:
            body = store.read_json(APPROVAL_FILE)
            return cls(**{**body, "labels": tuple(body["labels"])})
        except (ValueError, TypeError, KeyError) as e:
            raise ApprovalUnreadable(
                f"{store.url_of(APPROVAL_FILE)} is not an approval ({type(e).__name__}: {e}): approve again with "
                f"`{APPROVE}`, which replaces it"
            ) from None
