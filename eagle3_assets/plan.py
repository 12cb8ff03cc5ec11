"""`python -m eagle3_assets.start --plan`: what the next start would run, why, and what it would cost.

A plan is a list of steps (an asset, or one shard of `hidden_states`), in the order the start command launches them:
tick after tick (`wave`), each tick's unpartitioned assets first, in graph order, then its shards in row order
(`start.py: GraphStart.run`). Each step says why it runs (the setting, input or code that changed, "never
materialized", or an input made again before it) and what it costs: rows to generate, shards and bytes to extract,
optimizer steps, and seconds, each measured from the store's own past materializations (`Rate`) where there are any;
where there are none it says so rather than guess.

Plain figures only here; `defs/plan.py` reads them from the Dagster instance and the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.figures import duration, size

NO_PAST = "no past run to measure from"


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

    def total(self) -> str:
        costs = [s.cost for s in self.steps]
        rows = sum(c.rows or 0 for c in costs)
        shards = sum(c.shards or 0 for c in costs)
        nbytes = sum(c.bytes or 0 for c in costs)
        steps = sum(c.steps or 0 for c in costs)
        seconds = sum(c.seconds or 0 for c in costs)
        unknown = sum(1 for c in costs if c.seconds is None)
        text = (
            f"{rows:,} rows to generate, {shards:,} shard{'s' if shards != 1 else ''} (~{size(nbytes)}) to extract, ~{steps:,} optimizer steps; "
            f"~{duration(seconds)} measured from past runs"
        )
        return text + (f", {unknown} step(s) with {NO_PAST}" if unknown else "")
