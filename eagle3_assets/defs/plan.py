"""The plan of the next start (`python -m eagle3_assets.start --plan`), read from the instance and the store alone.

What runs is what the start command's ticks would request (docs/DESIGN.md §9), told without ticking them: an asset
(or a shard) runs when `why_due` finds it due (a setting, an input or the code changed; never materialized), when
`--from` asks it redone, when a shard is unusable, or when an input it records (`artifacts.py`: its `parents`) runs
before it, since staleness does not propagate by itself (docs/DESIGN.md §7) and what is redone is the downstream
closure of what is due. It runs in the tick after the last of its planned ancestors (the Dagster graph's: the
conditions wait for every ancestor, `AncestorDue`). Two things the plan cannot know before they run, and says:
an input made again with equal content spares what follows it (listed all the same), and which shards a `tokenized`
made again cuts with other rows (`hidden_states[…]`, counted at most every shard of the prompt set).

Nothing is written: no run, no record, no lease; only materializations, run records and store files are read.

Under the daemon the same plan gates what is due (`PlanApproved`, in `defs/due.py: stale`): over
`approval.limit_s` it waits until a person approves it (`approve`: `--approve`, the `approve_plan` job), which
writes one record, the approval, and runs nothing.
"""

from __future__ import annotations

import json
from typing import ClassVar, NamedTuple

import fsspec
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    AssetSelection,
    AutomationCondition,
    AutomationContext,
    AutomationResult,
    DagsterInstance,
    Definitions,
    EventLogRecord,
)
from dagster._core.definitions.assets.graph.base_asset_graph import BaseAssetGraph

from eagle3_assets.artifacts import ARTIFACTS
from eagle3_assets.defs.partitions import registered_shard_keys
from eagle3_assets.defs.provenance import Staleness, StartDoor, code_version, why_due
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.defs.shards.checks import unusable_shards
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.families import FAMILIES
from eagle3_assets.figures import duration, size
from eagle3_assets.plan import APPROVE, LATER, NO_PAST, Approval, Cost, Plan, Rate, Step, over_limit
from eagle3_assets.project import Project
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, PROMPTS_FILE, Prompt, decode_prompts, parse_prompts
from eagle3_assets.provenance import ProvenanceError, data_version, digest
from eagle3_assets.responses import RowStamps, made_by, rows_to_generate
from eagle3_assets.shard_window import read_consumed
from eagle3_assets.shards import Shard
from eagle3_assets.target import load_tokenizer
from eagle3_assets.traffic import TRAFFIC_PROMPTS_FILE, TrafficBuild, kept_lines, prompt_set_now, read_prompt_set
from eagle3_assets.traffic_log import read_log

FAMILY_OF = {f.drafter_asset: f for f in FAMILIES.values()}  # by its drafter asset
DRAFTERS = frozenset(FAMILY_OF)
PAST_RUNS = 200  # materializations a rate is measured over, at most


class Past:
    """Figures of the instance's past materializations."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance

    def records(self, key: AssetKey, limit: int = PAST_RUNS) -> list[EventLogRecord]:
        return list(self.instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=limit).records)

    def run_seconds(self, record: EventLogRecord) -> float | None:
        run = self.instance.get_run_record_by_id(record.run_id)
        if run is None or run.start_time is None or run.end_time is None:
            return None
        return run.end_time - run.start_time

    def seconds(self, record: EventLogRecord) -> float | None:
        """The asset's own time where its metadata holds one, else its run's."""
        own = record.asset_materialization.metadata.get("seconds")
        return float(own.value) if own is not None else self.run_seconds(record)

    def rate(self, key: AssetKey, amount: str, unit_field: str, unit: str) -> Rate | None:
        """`amount` (a metadata field, or `seconds`) per `unit_field` over its past materializations."""
        pairs = []
        for record in self.records(key):
            meta = record.asset_materialization.metadata
            units = meta.get(unit_field)
            value = self.seconds(record) if amount == "seconds" else (meta[amount].value if amount in meta else None)
            if units is not None and value is not None and float(units.value) > 0:
                pairs.append((float(value), float(units.value)))
        return Rate.measured(pairs, unit)


def _timed(rate: Rate | None, units: float, what: str) -> tuple[float | None, str]:
    if rate is None:
        return None, NO_PAST
    plural = "s" if rate.units != 1 else ""
    return rate.per_unit * units, f"{rate.per_unit:.3g}s per {rate.unit} over {rate.units:g} {rate.unit}{plural} {what}"


class Planner:
    """One look at the instance and the store: `plan()` is the next start's plan."""

    def __init__(self, instance: DagsterInstance, project: Project, graph: BaseAssetGraph, door: StartDoor):
        self.instance, self.project, self.graph, self.door = instance, project, graph, door
        self.staleness = Staleness(project)
        self.past = Past(instance)

    def plan(self, selection: AssetSelection) -> Plan:
        selected = selection.resolve(self.graph)
        order = [k for k in self.graph.toposorted_asset_keys if k in selected]
        steps: list[Step] = []
        waves: dict[AssetKey, int] = {}  # the last tick an asset (any of its shards) runs in
        notes: list[str] = []
        for key in order:
            wave = 1 + max((waves[a] for a in self._ancestors(key) if a in waves), default=-1)
            found = self._shards(waves) if key == HIDDEN_STATES else self._asset(key, waves)
            for label, reason, made_before in found:
                cost = self._cost(key, label)
                steps.append(Step(label, made_before, reason, cost, wave, sharded=key == HIDDEN_STATES))
                waves[key] = wave
        if any(s.label == LATER for s in steps):
            notes.append(
                f"{LATER}: which shards tokenized cuts with other rows is known once it is made; each of those is "
                "extracted again, counted here as at most every shard of the prompt set"
            )
        if self.project.settings.training.rolling and any(s.label.startswith("drafter") for s in steps):
            notes.append(
                "rolling: a drafter starts once one shard is checked and trains while the others are extracted; "
                "the order above is offline's"
            )
            notes += self._released_notes([s.label for s in steps if s.label in DRAFTERS])
        if any(s.reason.startswith(("input ", "inputs ")) for s in steps):
            notes.append(
                "a step run because an input is made again is spared when that input comes out with the same content "
                "(a content-equal parent stops the cascade, docs/DESIGN.md §7)"
            )
        return Plan(steps, notes)

    def _released_notes(self, drafters: list[str]) -> list[str]:
        """Rolling: the shards an earlier pass of each due drafter released, which its next pass extracts again
        unless it continues the release (`shard_window.start_over`; whether it continues is decided as it starts)."""
        notes = []
        for name in drafters:
            released = sorted(
                (k for k, c in read_consumed(self.project.store, FAMILY_OF[name].name).items() if c.released),
                key=lambda k: Shard.parse(k).start,
            )
            if released:
                shown = ", ".join(released[:5]) + (", …" if len(released) > 5 else "")
                notes.append(
                    f"rolling: {len(released)} shard(s) an earlier pass of {name} released ({shown}) are extracted "
                    f"again, as the window admits them, if {name} trains from scratch; a continuation of the release "
                    "trains the new shards only. Its log says which as it starts"
                )
        return notes

    # --- what runs, and why ---------------------------------------------------------------------

    def _ancestors(self, key: AssetKey) -> set[AssetKey]:
        todo, seen = list(self.graph.get(key).parent_keys), set()
        while todo:
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                todo.extend(self.graph.get(k).parent_keys)
        return seen

    def _made_again(self, asset: str, waves: dict[AssetKey, int]) -> str | None:
        """Why `asset` runs because an input it records runs before it, or None."""
        parents = [p for p in ARTIFACTS[asset].parents_under(self.project.settings) if AssetKey(p) in waves]
        if not parents:
            return None
        return (
            f"input {parents[0]} is made again" if len(parents) == 1 else f"inputs {', '.join(parents)} are made again"
        )

    def _asset(self, key: AssetKey, waves: dict[AssetKey, int]) -> list[tuple[str, str, bool]]:
        name = key.to_user_string()
        before = self.past.records(key, limit=1) != []
        if key in self.door.redo:
            return [(name, "redo asked (--from)", before)]
        reason = why_due(self.instance, self.staleness, key) or self._made_again(name, waves)
        return [(name, reason, before)] if reason else []

    def _shards(self, waves: dict[AssetKey, int]) -> list[tuple[str, str, bool]]:
        keys = registered_shard_keys(self.instance)
        bad = unusable_shards(self.instance, self.project, keys)
        again = self._made_again("hidden_states", waves)
        made = {r.partition_key for r in self._shard_records()}
        out = []
        for k in keys:
            asked = "redo asked (--from)" if HIDDEN_STATES in self.door.redo else None
            reason = asked or why_due(self.instance, self.staleness, HIDDEN_STATES, k) or bad.get(k) or again
            if reason:
                out.append((f"hidden_states[{k}]", reason, k in made))
        if AssetKey("tokenized") in waves and (len(out) < len(keys) or not keys):
            what = "the shards tokenized cuts with other rows, and new ones" if keys else "every shard tokenized cuts"
            out.append((LATER, f"{what}: known once tokenized is made", bool(made)))
        return out

    # --- what it costs --------------------------------------------------------------------------

    def _shard_records(self) -> list[EventLogRecord]:
        if not hasattr(self, "_shard_cache"):
            self._shard_cache = self.past.records(HIDDEN_STATES)
        return self._shard_cache

    def _cost(self, key: AssetKey, label: str) -> Cost:
        name = key.to_user_string()
        try:
            if key == HIDDEN_STATES:
                return self._shard_cost(label)
            if name == "responses":
                return self._responses_cost()
            if name in DRAFTERS:
                return self._drafter_cost(key)
        except (Eagle3Error, OSError, ValueError) as e:  # a prompt file gone: the plan says so, the start refuses
            return Cost(basis=f"not measured: {e}")
        latest = self.past.records(key, limit=1)
        seconds = self.past.seconds(latest[0]) if latest else None
        return Cost(seconds=seconds, basis=NO_PAST if seconds is None else "its last run")

    def _shard_cost(self, label: str) -> Cost:
        if label == LATER:
            rows = len(self._prompts_now())
            shards = -(-rows // self.project.settings.shard_size)
        else:
            rows, shards = len(Shard.parse(label.removeprefix("hidden_states[").removesuffix("]"))), 1
        per_row = Rate.measured(
            [(float(m["bytes"].value), float(m["rows_total"].value)) for m in self._shard_meta() if "bytes" in m and "rows_total" in m],
            "row",
        )  # fmt: skip
        seconds = Rate.measured(
            [(float(m["seconds"].value), float(m["rows_computed"].value)) for m in self._shard_meta() if "seconds" in m and "rows_computed" in m],
            "row",
        )  # fmt: skip
        at_most = "at most " if label == LATER else ""
        time, basis = _timed(seconds, rows, "of past shards")
        return Cost(
            shards=shards,
            bytes=per_row.per_unit * rows if per_row else None,
            seconds=time,
            basis=f"{at_most}{rows:,} rows; " + (f"{size_basis(per_row)}, {basis}" if per_row else basis),
        )

    def _shard_meta(self) -> list:
        return [r.asset_materialization.metadata for r in self._shard_records()]

    def _prompts_now(self) -> list[Prompt]:
        """The prompts `responses` will read: the source's when `prompts` runs first, else the store's copy; with
        `traffic` set, and the log's training prompts (the store's set, or the one `traffic_prompts` will write)."""
        settings, store = self.project.settings, self.project.store
        base = self._base_prompts_now()
        if settings.traffic is None:
            return base
        if why_due(self.instance, self.staleness, AssetKey("traffic_prompts")) is None and store.exists(TRAFFIC_PROMPTS_FILE):
            return read_prompt_set(store)
        target = self.project.target()
        eval_prompts = parse_prompts(store.read_text(EVAL_PROMPTS_FILE), EVAL_PROMPTS_FILE) if store.exists(EVAL_PROMPTS_FILE) else []
        judge = TrafficBuild(
            load_tokenizer(target), target.vocab_size, settings.generation.chat_template_kwargs, settings.max_seq_len,
            settings.traffic.heldout_share, settings.traffic.model, settings.generation.temperature,
        )  # fmt: skip
        result = judge.build(*read_log(settings.traffic.log), base, eval_prompts, kept_lines(store))
        return prompt_set_now(store, result, base)

    def _base_prompts_now(self) -> list[Prompt]:
        settings, store = self.project.settings, self.project.store
        if why_due(self.instance, self.staleness, AssetKey("prompts")) is None and store.exists(PROMPTS_FILE):
            return parse_prompts(store.read_text(PROMPTS_FILE), store.url_of(PROMPTS_FILE))
        if settings.prompts is None:
            from eagle3_assets.demo.prompts import demo_prompt_sets

            text = "".join(json.dumps(p) + "\n" for p in demo_prompt_sets(settings.demo)[0])  # as `prompts` writes them
            return parse_prompts(text, "embedded demo prompts")
        with fsspec.open(settings.prompts, "rb") as f:
            return parse_prompts(decode_prompts(f.read(), settings.prompts), settings.prompts)

    def _responses_cost(self) -> Cost:
        settings = self.project.settings
        prompts = self._prompts_now()
        want = self.staleness.expected("responses")
        target = want.inputs["target_model"]
        if why_due(self.instance, self.staleness, AssetKey("target_model")) is not None:
            made = self.staleness.expected("target_model")  # the version it will get (`defs/provenance.materialized`)
            target = data_version(made) or made.made_from
        stamps = RowStamps(settings.generation.chat_template_kwargs, made_by(want.settings, target, want.code))
        rows = rows_to_generate(
            self.project.store, prompts, stamps, settings.generation.rows_per_part, settings.generation.max_row_attempts
        )
        rate = self.past.rate(AssetKey("responses"), "seconds", "rows_generated", "row")
        seconds, basis = _timed(rate, rows, "generated before")
        return Cost(rows=rows, seconds=seconds, basis=f"of {len(prompts):,} prompts; {basis}")

    def _drafter_cost(self, key: AssetKey) -> Cost:
        family = FAMILY_OF[key.to_user_string()]
        training = self.project.settings.training_of(family)  # its own schedule, where its section holds one
        latest = self.past.records(key, limit=1)
        meta = latest[0].asset_materialization.metadata if latest else {}
        per_step = None
        if latest and (run := self.past.run_seconds(latest[0])) is not None and "step" in meta and meta["step"].value:
            per_step = Rate(run / float(meta["step"].value), float(meta["step"].value), "step")
        if training.steps is not None:
            steps, how = training.steps, "training.steps"
        elif "total_steps" in meta:
            then = meta["provenance"].value.get("settings", {}) if "provenance" in meta else {}
            # A family's own epochs are recorded within its section's value (`artifacts._drafter_reads`); rolling
            # mode passes each shard once, whatever they say (`Settings.training_of`).
            own = family.settings_section if "epochs" in family.recipe_fields and not training.rolling else None
            then_epochs = (then.get(own) or {}).get("epochs") if own else then.get("training.epochs")
            scale = (training.epochs / float(then_epochs or training.epochs)) * (
                float(then.get("training.batch_tokens", training.batch_tokens)) / training.batch_tokens
            )
            steps = max(1, round(int(meta["total_steps"].value) * scale))
            how = f"its last run's {int(meta['total_steps'].value):,} steps" + (
                f" scaled by epochs and batch_tokens (x{scale:.3g})" if scale != 1 else ""
            )
        else:
            tokenized = self.past.records(AssetKey("tokenized"), limit=1)
            if not tokenized or "tokens" not in tokenized[0].asset_materialization.metadata:
                return Cost(basis=NO_PAST)
            tokens = float(tokenized[0].asset_materialization.metadata["tokens"].value)
            steps = max(1, round(tokens * training.epochs / training.batch_tokens))
            how = f"{tokens:,.0f} tokens x {training.epochs:g} epochs / {training.batch_tokens:,} batch_tokens"
        seconds, basis = _timed(per_step, steps, "of its last run")
        return Cost(steps=steps, seconds=seconds, basis=f"{how}; {basis}")


def size_basis(rate: Rate) -> str:
    return f"{size(rate.per_unit)} per row over {rate.units:g} past rows"


def next_start(
    instance: DagsterInstance, project: Project, defs: Definitions, door: StartDoor, selection: AssetSelection
) -> Plan:
    """What the start command would run next over `selection`, why, and at what cost; changes nothing."""
    return Planner(instance, project, defs.resolve_asset_graph(), door).plan(selection)


# --- under the daemon, a plan over `approval.limit_s` waits for a person ----------------------------------------

ROOTS = ("prompts", "target_model")


def toward(project: Project, staleness: Staleness) -> str:
    """What the graph is being made from: each asset's settings and code (its code version) and the outside files the
    roots read (the prompt file, the target). An approval holds while this stays the same (`Approval.covers`)."""
    roots = {}
    # `traffic_prompts` reads the request log from outside: an append is another plan. Unset, nothing changes.
    for root in ROOTS + (("traffic_prompts",) if project.settings.traffic is not None else ()):
        try:
            roots[root] = staleness.expected(root).made_from
        except ProvenanceError as e:  # an outside file gone: the plan says so too, and a new one is another plan
            roots[root] = str(e)
    code = {a: code_version(a, project.settings) for a, art in ARTIFACTS.items() if art.in_graph(project.settings)}
    return digest({"code": code, "roots": roots})


class Verdict(NamedTuple):
    waits: bool
    said: str  # what the UI shows: why it waits, or why it may run


def verdict(instance: DagsterInstance, project: Project, graph: BaseAssetGraph) -> Verdict:
    """Whether what is due may start under the daemon: its plan (the start command's, `--from` aside) is under
    `approval.limit_s`, or a person approved it."""
    planner = Planner(instance, project, graph, StartDoor())
    try:
        plan = planner.plan(AssetSelection.all())
    except (Eagle3Error, OSError, ValueError) as e:  # not known to be under the limit: a person looks
        return Verdict(True, f"waits for approval: the plan could not be made ({e}); `--plan` says more")
    over = over_limit(plan, project.settings.approval.limit_s)
    if over is None:
        return Verdict(False, f"plan ~{duration(plan.seconds)}: under the limit")
    try:
        approval = Approval.read(project.store)
    except Eagle3Error as e:  # one tick's sensor must not fail on it: what is due waits, naming the file
        return Verdict(True, f"waits for approval: {over}; {e}")
    if approval is not None and approval.covers(plan, toward(project, planner.staleness)):
        return Verdict(False, f"{over}; approved by {approval.by}")
    return Verdict(True, f"waits for approval: {over}; approve with `{APPROVE}`")


class PlanApproved(AutomationCondition):
    """True while the plan of what is due is under `approval.limit_s` or approved by a person (`verdict`); made once
    per tick (the sensor's evaluation time), for every asset it gates, and only when something is due."""

    _shared: ClassVar[dict[int, tuple[object, Project, Verdict]]] = {}

    def __init__(self, project: Project):
        self.project = project
        self.said: str | None = None  # this tick's verdict, for the UI
        super().__init__()

    @property
    def description(self) -> str:
        limit = self.project.settings.approval.limit_s
        return self.said or (
            f"the plan of what is due is under {duration(limit or 0)} (approval.limit_s), or a person approved it "
            f"(`{APPROVE}`)"
        )

    @property
    def name(self) -> str:
        return "plan_approved"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        tick, project, seen = self._shared.get(id(self.project), (None, None, None))
        this_tick = seen is not None and project is self.project and tick == context.evaluation_time
        if not this_tick and context.candidate_subset.is_empty:  # nothing due here: no plan to make
            self.said = None
            return AutomationResult(context, context.candidate_subset)
        if not this_tick:
            seen = verdict(context.asset_graph_view.instance, self.project, context.asset_graph)
            self._shared[id(self.project)] = (context.evaluation_time, self.project, seen)
        self.said = seen.said  # one object may sit at two places of an asset's condition: both say this tick's
        return AutomationResult(context, context.get_empty_subset() if seen.waits else context.candidate_subset)


def approve(instance: DagsterInstance, project: Project, graph: BaseAssetGraph, by: str) -> list[str]:
    """Record a person's approval of the plan of what is due now (`APPROVE`, the `approve_plan` job) in the store,
    and say what was approved at what cost; starts nothing (the daemon does, at its next tick)."""
    planner = Planner(instance, project, graph, StartDoor())
    plan = planner.plan(AssetSelection.all())
    if not plan.steps:
        return ["nothing to approve: nothing is due; everything is made as the current settings and inputs make it"]
    approval = Approval.of(plan, toward(project, planner.staleness), by)
    approval.save(project.store)
    limit = project.settings.approval.limit_s
    why = over_limit(plan, limit) or (
        "under the limit: the daemon starts it without approval"
        if limit is not None
        else "approval.limit_s is not set: the daemon never waits"
    )
    return [
        f"approved plan {approval.digest} ({why}); the daemon starts it at its next tick. This command starts nothing",
        *plan.lines()[1:],
    ]
