"""`python -m eagle3_assets.start` (`make run`): the whole graph from one command, without the daemon.

It has no schedule of its own. It ticks the automation conditions the daemon's sensors tick, over the same
definitions (`evaluate_automation_conditions`), launches what a tick requests and ticks again until nothing more
is requested: what is due, what waits for what, what a content-equal parent spares, are the daemon's decisions
(docs/DESIGN.md §9). Where a person's command must do more than the daemon, its definitions carry conditions of
their own beside the others (`defs/provenance.py: StartDoor`): what was never materialized is made (the daemon
leaves the roots to a person), an unusable shard is extracted again at once (the daemon waits for its cron), and
`--from ASSET` redoes ASSET and what follows. Each asset (or shard) runs at most once per command: a failure is
reported, not retried in a loop; the same command again retries it.

Each tick's assets run as one run, each shard in a run of its own (its own retries, its own `gpu` slot), every run
recorded in $DAGSTER_HOME as if launched from the UI. In rolling mode (`training.mode: rolling`) each family's drafter
(`drafter`, `drafter_dflash`: `settings.drafters`) trains in a process of its own, all of them at once, while later
ticks extract each shard the window admits (a shard leaves it once every family consumed it). The same command after a crash or a
kill resumes: runs left by a dead process are failed first (their slots freed), and finished work is not redone.

With a `vllm` backend and no server configured, each phase that has work shares one vLLM server, started when
the phase starts and stopped when it ends (generation for `responses`, extraction for the shards): the model
loads once per phase, not once per run. A server named in `vllm.server_url(s)` is used and left alone.
`drafter_eval` loads its own engines (each pass serves another drafter setting).

The first Ctrl-C or SIGTERM ends the run in flight and everything this command started, launches nothing more,
and exits 128 + the signal, naming the command that resumes (`stopping.py`). One such command runs per store at a
time (`leases.py`).

    python -m eagle3_assets.start                    # start, or resume
    python -m eagle3_assets.start --list-shards      # the shard keys and where each stands
    python -m eagle3_assets.start --plan             # what the next start would run, why, at what cost; runs nothing
    python -m eagle3_assets.start --approve          # approve what is due for the daemon (approval.limit_s); runs nothing
    python -m eagle3_assets.start --shard rows_0-2000 [--shard …]   # (re)extract the named shards only
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from dagster import (
    AssetKey,
    AssetSelection,
    DagsterInstance,
    Definitions,
    evaluate_automation_conditions,
)

from eagle3_assets.defs.drafter.assets import DRAFTER_RELEASE, drafter_key, eval_key
from eagle3_assets.defs.ops.runs import MAX_RETRIES_TAG, process_tags, sweep_dead_runs
from eagle3_assets.defs.partitions import (
    UnknownShardKey,
    registered_shard_keys,
    require_shard_keys,
)
from eagle3_assets.defs.plan import approve, next_start
from eagle3_assets.defs.provenance import Staleness, StartDoor, why_due
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.defs.shards.checks import unusable_shards
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.families import FAMILIES, family_spec
from eagle3_assets.leases import Lease
from eagle3_assets.plan import APPROVE, Plan
from eagle3_assets.processes import STOP_GRACE_S, stop_groups, terminate_with_parent
from eagle3_assets.project import Project
from eagle3_assets.settings import CONFIG_ENV, ROOT_ENV
from eagle3_assets.stopping import Stopped, StopSignals

if TYPE_CHECKING:
    from eagle3_assets.vllm_server.command import Role

LAUNCHED_BY = "eagle3/launched_by"
STOPPED_BY = "eagle3/stopped_by"  # the signal that stopped the run: a person or the cluster, not a fault
RESPONSES = AssetKey("responses")
ROLLING_POLL_S = 2.0
# A start through these runs a drafter_eval.
EVALUATED = frozenset({*(eval_key(f) for f in FAMILIES.values()), DRAFTER_RELEASE})
START_LEASE_DIR = "start"

Log = Callable[[str], None]
Request = tuple[AssetKey, str | None]  # an asset and its partition (a shard key), None when unpartitioned


def _say(line: str) -> None:
    print(f"[start] {line}", flush=True)


def _label(requests: Sequence[Request]) -> str:
    return ", ".join(k.to_user_string() + (f"[{p}]" if p else "") for k, p in requests)


def shard_states(instance: DagsterInstance, project: Project) -> dict[str, str]:
    """Every registered shard key, in row order, with `done` or why it must run."""
    keys = registered_shard_keys(instance)
    bad = unusable_shards(instance, project, keys)
    staleness = Staleness(project)
    return {key: why_due(instance, staleness, HIDDEN_STATES, key) or bad.get(key, "done") for key in keys}


class GraphStart:
    """The start command's definitions (`build(project, door)`), its instance and project; `run()` takes the graph
    as far as `through`."""

    def __init__(
        self,
        instance: DagsterInstance,
        project: Project,
        *,
        build: Callable[[Project, StartDoor], Definitions],
        door: StartDoor | None = None,
        owned: Callable[[], None] = lambda: None,
        log: Log = _say,
        stop: StopSignals | None = None,
    ):
        """`build` makes the definitions, also for a project whose settings name a phase's shared server; `stop`
        says when a stop signal came (none come to one that is not installed); `owned` raises when this command no
        longer holds the store's start lease (`Lease.check`): it launches nothing after that."""
        self.instance, self.project, self.build, self.log, self.owned = instance, project, build, log, owned
        self.door = door or StartDoor(since=time.time())
        self.stop = stop or StopSignals()
        self.defs = build(project, self.door)
        self.job = self.defs.resolve_implicit_global_asset_job_def()

    # --- what the conditions request -------------------------------------------------------------

    def ticks(self, selection: AssetSelection) -> Iterator[list[Request]]:
        """The requests of each tick of the automation conditions over `selection`, in graph order."""
        order = self.defs.resolve_asset_graph().toposorted_asset_keys
        cursor = None
        while True:
            result = evaluate_automation_conditions(
                self.defs, self.instance, asset_selection=selection,
                evaluation_time=datetime.datetime.now(datetime.UTC), cursor=cursor,
            )  # fmt: skip
            cursor = result.cursor
            yield [(k, p) for k in order for p in sorted(result.get_requested_partitions(k), key=str)]

    def why(self, request: Request, staleness: Staleness) -> str:
        key, partition = request
        if key in self.door.redo:
            return "redo asked (--from)"
        if why := why_due(self.instance, staleness, key, partition):
            return why
        if key == HIDDEN_STATES:
            return unusable_shards(self.instance, self.project, [partition]).get(partition, "requested")
        return "requested"

    def left(self, selection: AssetSelection) -> list[str]:
        """What in `selection` is not made as the settings would make it now, each with why."""
        graph, staleness, out = self.defs.resolve_asset_graph(), Staleness(self.project), []
        selected = selection.resolve(graph)
        for key in [k for k in graph.toposorted_asset_keys if k in selected]:
            if key == HIDDEN_STATES:
                out += [f"hidden_states[{k}]: {s}" for k, s in shard_states(self.instance, self.project).items() if s != "done"]
            elif why := why_due(self.instance, staleness, key):
                out.append(f"{key.to_user_string()}: {why}")
        return out

    def checks_failed(self, selection: AssetSelection) -> list[str]:
        """The blocking checks in `selection` that did not pass on their asset's latest materialization: the asset
        is not made again for it (its children wait), as under the daemon."""
        graph = self.defs.resolve_asset_graph()
        checks = [c for k in selection.resolve(graph) if k != HIDDEN_STATES for c in graph.get(k).check_keys if graph.get(c).blocking]
        executions = self.instance.event_log_storage.get_latest_asset_check_execution_by_key(checks)
        return [
            f"{c.asset_key.to_user_string()}: its check {c.name} {executions[c].status.value.lower()}"
            for c in checks
            if c in executions and executions[c].status.value != "SUCCEEDED"
        ]

    # --- running ---------------------------------------------------------------------------------

    def launch(self, keys: list[AssetKey], partition: str | None = None) -> bool:
        self.owned()  # paused past the lease's expiry (SIGSTOP, a frozen VM), another command may have taken over
        label = _label([(k, partition) for k in keys]) if partition else ",".join(k.to_user_string() for k in keys)
        started = time.monotonic()
        self.log(f"{label}: starting")
        # execute_in_process does not use the job's executor: the run names its process itself,
        # so a later sweep (this command again, the daemon) can fail it if this process is killed.
        # This command retries its own runs (run it again): the instance's run_retries relaunching
        # one from the daemon would put a second owner beside it.
        run_id = str(uuid.uuid4())  # known before the run starts: its process tags name it
        result = self.job.execute_in_process(
            instance=self.instance,
            asset_selection=keys,
            partition_key=partition,
            run_id=run_id,
            tags={LAUNCHED_BY: "start", MAX_RETRIES_TAG: "0", **process_tags(run_id)},
            raise_on_error=False,
        )
        if (sig := self.stop.received()) is not None:
            self.instance.add_run_tags(run_id, {STOPPED_BY: sig.name})
            self.log(f"{label}: stopped by {sig.name} in {time.monotonic() - started:.1f}s (run {result.run_id})")
            self.stop.check()
        status = "ok" if result.success else "FAILED"
        self.log(f"{label}: {status} in {time.monotonic() - started:.1f}s (run {result.run_id})")
        return result.success

    @contextmanager
    def engine(self, role: Role) -> Iterator[None]:
        """The phase's runs share one vLLM server, started here and stopped when the phase ends; nothing
        when the phase's backend is not vllm or a server is configured."""
        settings = self.project.settings
        backend = settings.generation.backend if role == "generate" else settings.extraction.backend
        if backend != "vllm" or settings.vllm.extraction_urls:
            yield
            return
        from eagle3_assets.vllm_server.server import VllmServer

        local_root = self.project.store.local_path("")
        self.log(f"vLLM ({role}): starting one server for this phase")
        job = self.job
        with VllmServer.start(
            self.project.target(), settings.vllm, role, write_roots=[str(local_root)] if local_root else []
        ) as server:
            self.log(f"vLLM ({role}): ready at {server.url}; every run of this phase uses it")
            shared = settings.model_copy(update={"vllm": settings.vllm.model_copy(update={"server_url": server.url})})
            self.job = self.build(Project(shared, self.project.store), self.door).resolve_implicit_global_asset_job_def()
            try:
                yield
            finally:
                self.job = job
        self.log(f"vLLM ({role}): stopped")

    @staticmethod
    def selection(through: AssetKey) -> AssetSelection:
        # Nothing after `through` runs: `--through hidden_states` is the whole data build, vocab map included.
        return AssetSelection.all() - AssetSelection.assets(through).downstream(include_self=False)

    def plan(self, *, through: AssetKey = DRAFTER_RELEASE) -> Plan:
        """What `run(through=through)` would launch, in its order, why, and at what cost (`defs/plan.py`); it
        launches, writes and sweeps nothing."""
        return next_start(self.instance, self.project, self.defs, self.door, self.selection(through))

    def run(self, *, through: AssetKey = DRAFTER_RELEASE) -> bool:
        """Tick, launch what is requested, tick again, until nothing more is; False when a run failed or something
        in the graph up to `through` is left unmade (each is named)."""
        self.log(f"{len(sweep_dead_runs(self.instance))} run(s) of dead processes failed and their slots freed")
        selection = self.selection(through)
        settings = self.project.settings
        # Rolling: every family's trainer, each in a process of its own, all at once (each shard is released once
        # every family consumed it, so one waiting for another to finish would wait for ever).
        rolling_trainers = {drafter_key(family_spec(f)) for f in settings.drafters} if settings.training.rolling else set()
        # Each request runs once per provenance: again in this command only when what it is made from moved since it
        # ran (a release makes another family's eval due, then the release is decided again); a failed one, and a
        # trainer in its own process, not again (the same command, run again, resumes them).
        ran: dict[Request, set[str] | None] = {}
        failed: list[str] = []
        with ExitStack() as stack:
            phase = stack.enter_context(self._phases())
            trainers: dict[AssetKey, subprocess.Popen] = {}
            for requests in self.ticks(selection):
                self.stop.check()
                staleness = Staleness(self.project)
                new = [r for r in requests if self._again(r, ran, staleness)]
                for key, trainer in list(trainers.items()):
                    if trainer.poll() is not None:
                        ok = trainer.returncode == 0
                        self.log(f"{key.to_user_string()}: {'ok' if ok else 'FAILED'} in its own process")
                        failed += [] if ok else [key.to_user_string()]
                        del trainers[key]
                if not new:
                    if not trainers:
                        break
                    time.sleep(ROLLING_POLL_S)
                    continue
                made = {r: self._made_from(r, staleness) for r in new}
                for request in new:
                    self.log(f"{_label([request])}: to run ({self.why(request, staleness)})")
                assets = [k for k, p in new if p is None and k not in rolling_trainers]
                if assets:
                    phase("generate" if RESPONSES in assets else "extract" if trainers else None)
                    ok = self.launch(assets)
                    self._ran(ran, {(k, None): made[(k, None)] for k in assets}, ok)
                    if not ok:
                        failed.append(",".join(k.to_user_string() for k in assets))
                for key in [k for k, p in new if p is None and k in rolling_trainers]:
                    ran[(key, None)] = None
                    trainers[key] = stack.enter_context(self._process(key))
                shards = [p for k, p in new if k == HIDDEN_STATES]
                if shards:
                    phase("extract")
                for key in shards:
                    ok = self.launch([HIDDEN_STATES], key)
                    self._ran(ran, {(HIDDEN_STATES, key): made[(HIDDEN_STATES, key)]}, ok)
                    if not ok:
                        failed.append(f"hidden_states[{key}]")
                        if trainers:
                            self._waits_for(key)
        if failed:
            self.log(f"failed: {', '.join(failed)}; run the same command again to resume them")
            return False
        if failed_checks := self.checks_failed(selection):
            self.log("not made again for its own check, what follows it waits: " + "; ".join(failed_checks))
        if left := self.left(selection):
            self.log("not made, each waiting on an input not current or not checked sound: " + "; ".join(left))
            return False
        return True

    @staticmethod
    def _made_from(request: Request, staleness: Staleness) -> str | None:
        """What `request` would be made from now (`Provenance.made_from`); None when that cannot be said."""
        key, partition = request
        try:
            return staleness.expected(key.to_user_string(), partition).made_from
        except Eagle3Error:  # an outside file gone: `why` names it, and it is not run again in this command
            return None

    def _again(self, request: Request, ran: dict[Request, set[str] | None], staleness: Staleness) -> bool:
        """Whether a request the conditions make is launched: never run in this command, or run and succeeded from
        other inputs than it would be made from now. A finite graph's provenances are finite, so the ticks end."""
        if request not in ran:
            return True
        seen = ran[request]
        return seen is not None and (made := self._made_from(request, staleness)) is not None and made not in seen

    @staticmethod
    def _ran(ran: dict[Request, set[str] | None], made: dict[Request, str | None], ok: bool) -> None:
        for request, made_from in made.items():
            seen = ran.get(request, set())
            ran[request] = None if not ok or made_from is None or seen is None else seen | {made_from}

    def _waits_for(self, key: str) -> None:
        wait = self.project.settings.training.shard_wait_s
        self.log(
            f"{key} failed; {'the drafter' if len(self.project.settings.drafters) == 1 else 'each drafter'} waits for "
            f"it up to training.shard_wait_s={wait:g}s. Repair it from another "
            f"shell (`python -m eagle3_assets.start --shard {key}`), or stop this command: running it again resumes"
        )

    @contextmanager
    def _phases(self) -> Iterator[Callable[[Role | None], None]]:
        """`phase(role)`: the vLLM server of `role` from now on (the one before stopped), none for None."""
        held: list[tuple[Role | None, ExitStack]] = [(None, ExitStack())]

        def phase(role: Role | None) -> None:
            if held[0][0] == role:
                return
            held[0][1].close()
            stack = ExitStack()
            held[0] = (role, stack)
            if role is not None:
                stack.enter_context(self.engine(role))

        try:
            yield phase
        finally:
            held[0][1].close()

    @contextmanager
    def _process(self, key: AssetKey) -> Iterator[subprocess.Popen]:
        """`key` materialized by `dagster asset materialize` in a process of its own, into this instance. Not a
        thread: two runs executing in one process at once can deadlock Dagster's compute-log capture. The
        process gets SIGTERM if this one dies, so a killed command leaves no trainer beside the next one's;
        in a session of its own, it is stopped here (SIGTERM, then SIGKILL to its group) when the block is
        left before it ended: a stop signal, an error."""
        self.owned()
        with tempfile.TemporaryDirectory(prefix="eagle3-start-") as tmp:
            config = Path(tmp) / "settings.yaml"
            config.write_text(yaml.safe_dump(self.project.settings.model_dump(mode="json")))
            env = {
                **os.environ, CONFIG_ENV: str(config), ROOT_ENV: self.project.store.url,
                "DAGSTER_HOME": self.instance.root_directory,
            }  # fmt: skip
            cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "eagle3_assets.definitions",
                   "--select", key.to_user_string()]  # fmt: skip
            self.log(f"{key.to_user_string()}: starting, in its own process")
            process = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=terminate_with_parent(), start_new_session=True
            )  # fmt: skip
            try:
                yield process
            finally:
                if process.poll() is None:
                    self.log(f"{key.to_user_string()}: stopping its process")
                    # the trainer's own stop gives torchrun its grace (defs/drafter/launch.py); this one waits that, and more
                    stop_groups([process], 2 * STOP_GRACE_S)

    def run_shards(self, keys: Sequence[str]) -> bool:
        require_shard_keys(self.instance, list(keys))
        with self.engine("extract"):
            return all([self.launch([HIDDEN_STATES], key) for key in keys])  # every one, even after a failure


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.start",
        description="Run the whole graph (data, every shard, drafter, drafter_eval, drafter_release) into $DAGSTER_HOME; "
        "run it again to resume. Settings from $EAGLE3_CONFIG (the demo without it), artifacts under $EAGLE3_ROOT.",
    )
    parser.add_argument("--list-shards", action="store_true", help="print every shard key and its state, then exit")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what the start would run (with --from/--through as given), why, and at what cost, then exit; "
        "runs, writes and locks nothing",
    )
    parser.add_argument(
        "--approve",
        action="store_true",
        help="approve the plan of what is due (as --plan prints it) for the daemon, which waits for a person when it is "
        "over approval.limit_s, then exit; starts nothing. This command itself never waits: running it is approval",
    )
    parser.add_argument("--shard", action="append", default=[], metavar="KEY", help="(re)extract only this shard")
    parser.add_argument("--through", default=DRAFTER_RELEASE.to_user_string(), metavar="ASSET", help="stop after this asset")
    parser.add_argument("--from", dest="redo_from", metavar="ASSET", help="redo ASSET and everything after it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: finished work would be forgotten and redone", file=sys.stderr)
        return 2
    whole_graph = not (args.shard or args.list_shards)
    if args.plan and not whole_graph:
        print("--plan plans the whole graph: not with --shard or --list-shards", file=sys.stderr)
        return 2
    if args.approve and (args.plan or not whole_graph or args.redo_from):
        print(
            "--approve approves what is due for the daemon: not with --plan, --shard, --list-shards, --from",
            file=sys.stderr,
        )
        return 2
    try:
        project = Project.from_environment()
        if AssetKey(args.through) in EVALUATED and whole_graph:
            project.settings.check_evaluable()  # refused now, not after the drafter trained
    except Eagle3Error as e:  # settings refused as they load: the message names the field
        print(f"error: {e}", file=sys.stderr)
        return 2
    # One whole-graph command per store, whichever instance it records into; `--shard` repairs a shard beside it
    # (the rolling loop asks for that) and takes no lease. The lease comes first, before anything opens
    # $DAGSTER_HOME (loading the definitions does: the code location's pool check): two commands opening a fresh
    # one at once race to create its tables, and the second must only refuse, touching nothing.
    # `--plan` only reads: it takes no lease, and plans beside a running start (what that one runs is in its log).
    leased = whole_graph and not (args.plan or args.approve)  # `--approve` writes its record alone, atomically
    lease = Lease(project.store, START_LEASE_DIR, "python -m eagle3_assets.start") if leased else nullcontext()
    began = time.monotonic()
    try:
        # The signals first: a stop while the lease settles leaves no lease file and ends as any stop does.
        with StopSignals().installed() as stop, lease:
            try:
                from eagle3_assets.definitions import build_definitions, defs
            except Eagle3Error as e:  # refused as the definitions load (a setting checked against the target)
                print(f"error: {e}", file=sys.stderr)
                return 2
            graph = defs.resolve_asset_graph()
            keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
            for flag, name in (("--from", args.redo_from), ("--through", args.through)):
                if name is not None and name not in keys:
                    print(f"{flag} {name}: no such asset; the assets are: {', '.join(sorted(keys))}", file=sys.stderr)
                    return 2
            redo = frozenset() if args.redo_from is None else AssetSelection.assets(args.redo_from).downstream().resolve(graph)
            door = StartDoor(redo=frozenset(redo), since=time.time())
            with DagsterInstance.get() as instance:
                start = GraphStart(
                    instance, defs.resources["project"], build=build_definitions, door=door, stop=stop,
                    owned=lease.check if isinstance(lease, Lease) else lambda: None,
                )  # fmt: skip
                if args.list_shards:
                    for key, state in shard_states(instance, start.project).items():
                        print(f"{key}\t{state}")
                    return 0
                if args.plan:
                    print("\n".join(start.plan(through=AssetKey(args.through)).lines()))
                    return 0
                if args.approve:
                    by = f"`{APPROVE}` (user {os.environ.get('USER', 'unknown')})"
                    print("\n".join(approve(instance, start.project, graph, by)))
                    return 0
                ok = start.run_shards(args.shard) if args.shard else start.run(through=AssetKey(args.through))
    except Eagle3Error as e:  # a wrong shard key, a phase server that did not start, another start command
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UnknownShardKey) else 1
    except Stopped as e:
        again = shlex.join(["python", "-m", "eagle3_assets.start", *argv])
        _say(f"stopped by {e.signal.name}: nothing more was launched. Run the same command to resume: {again}")
        return e.exit_status
    if not ok:
        return 1
    _say(f"finished in {time.monotonic() - began:.0f}s; artifacts in $EAGLE3_ROOT, runs in $DAGSTER_HOME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
