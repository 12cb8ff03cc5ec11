"""`python -m eagle3_assets.start` (`make run`): the whole graph from one command, without the daemon.

Phase after phase, each run recorded in $DAGSTER_HOME as if launched from the UI: the data
assets (prompts … vocab_map) in one run, then every registered shard in a run of its own (its
own retries, its own `gpu` slot), then `drafter`, then `drafter_eval` and `drafter_release`. In rolling mode
(`training.mode: rolling`) `drafter` trains while the shards are extracted, each as the
window admits it. The same command after a
crash or a kill resumes: runs left by a dead process are failed first (their slots freed), and
finished work is skipped, never redone. What is due is decided by the rule the daemon's automation
follows too (`defs/provenance.py: why_due`): an asset runs when it was never materialized or when its
record in the store says it was made from other settings or inputs than the current ones (a changed
setting, target, prompt file or input version: the line says which), or its blocking checks did not
pass; a shard also when its files are incomplete or its check did not pass. Everything after an asset
that runs runs too; unchanged settings redo nothing. `--from ASSET` forces ASSET and what follows.

With a `vllm` backend and no server configured, each phase that has work shares one vLLM
server, started when the phase starts and stopped when it ends (generation for the data
assets, extraction for the shards): the model loads once per phase, not once per run. A
server named in `vllm.server_url(s)` is used and left alone. `drafter_eval` loads its own
engines (each pass serves another drafter setting).

The first Ctrl-C or SIGTERM ends the run in flight and everything this command started,
launches nothing more, and exits 128 + the signal, naming the command that resumes
(`stopping.py`). One such command runs per store at a time (`leases.py`).

    python -m eagle3_assets.start                    # start, or resume
    python -m eagle3_assets.start --list-shards      # the shard keys and where each stands
    python -m eagle3_assets.start --shard rows_0-2000 [--shard …]   # (re)extract the named shards only
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dagster import AssetKey, AssetRecordsFilter, AssetSelection, DagsterInstance, Definitions
from dagster._core.definitions.assets.graph.asset_graph import AssetGraph
from dagster._core.storage.tags import MAX_RETRIES_TAG
from dagster._core.utils import make_new_run_id

from eagle3_assets.defs.drafter.assets import unusable_shards
from eagle3_assets.defs.ops.runs import process_tags, sweep_dead_runs
from eagle3_assets.defs.partitions import UnknownShardKey, registered_shard_keys, require_shard_keys
from eagle3_assets.defs.provenance import Staleness, why_due
from eagle3_assets.defs.shards.assets import HIDDEN_STATES
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.leases import Lease
from eagle3_assets.processes import stop_groups, terminate_with_parent
from eagle3_assets.project import Project
from eagle3_assets.settings import CONFIG_ENV, ROOT_ENV
from eagle3_assets.shard_window import Window
from eagle3_assets.stopping import Stopped, StopSignals

if TYPE_CHECKING:
    from eagle3_assets.vllm_server.command import Role

LAUNCHED_BY = "eagle3/launched_by"
STOPPED_BY = "eagle3/stopped_by"  # the signal that stopped the run: a person or the cluster, not a fault
RESPONSES = AssetKey("responses")
DRAFTER = AssetKey("drafter")
AFTER_SHARDS = [DRAFTER, AssetKey("drafter_eval"), AssetKey("drafter_release")]
ROLLING_POLL_S = 2.0
THROUGH = ("hidden_states", "drafter", "drafter_eval", "drafter_release")
EVALUATED = THROUGH[THROUGH.index("drafter_eval") :]  # a start through these runs drafter_eval
# Assets whose blocking check is a verdict, not a fault: `drafter_release` refusing a worse drafter is a finished
# decision (the released drafter stays), made again only when what it was made from changes.
VERDICTS = {AssetKey("drafter_release")}
START_LEASE_DIR = "start"
TRAINER_STOP_GRACE_S = 60.0  # the trainer's own stop gives torchrun 30 s (defs/drafter/launch.py)

Log = Callable[[str], None]


def _say(line: str) -> None:
    print(f"[start] {line}", flush=True)


class GraphStart:
    """The graph, its instance and its project; `run()` takes it as far as `through`."""

    def __init__(
        self,
        defs: Definitions,
        instance: DagsterInstance,
        project: Project,
        *,
        build: Callable[[Project], Definitions] | None = None,
        log: Log = _say,
        stop: StopSignals | None = None,
    ):
        """`build` makes the definitions for a project whose settings name a phase's shared server; `stop`
        says when a stop signal came (none come to one that is not installed)."""
        self.defs, self.instance, self.project, self.build, self.log = defs, instance, project, build, log
        self.stop = stop or StopSignals()
        self.graph: AssetGraph = defs.resolve_asset_graph()
        self.job = defs.resolve_implicit_global_asset_job_def()

    # --- what is finished ------------------------------------------------------------------------

    def _latest(self, key: AssetKey):
        records = self.instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1).records
        return records[0] if records else None

    def unfinished(self, key: AssetKey, staleness: Staleness | None = None) -> str | None:
        """Why an unpartitioned asset must run; None when it is finished."""
        if why := why_due(self.instance, staleness or Staleness(self.project), key):
            return why
        latest = self._latest(key)
        if key in VERDICTS:
            return None
        checks = [c for c in self.graph.get(key).check_keys if self.graph.get(c).blocking]
        executions = self.instance.event_log_storage.get_latest_asset_check_execution_by_key(checks)
        for check in checks:
            record = executions.get(check)
            if record is None or record.run_id != latest.run_id or record.status.value != "SUCCEEDED":
                return f"its check {check.name} has not passed on its latest materialization"
        return None

    def shard_states(self) -> dict[str, str]:
        """Every registered shard key, in row order, with `done` or why it must run."""
        keys = registered_shard_keys(self.instance)
        bad = unusable_shards(self.instance, self.project, keys)
        staleness = Staleness(self.project)
        return {key: why_due(self.instance, staleness, HIDDEN_STATES, key) or bad.get(key, "done") for key in keys}

    # --- running ---------------------------------------------------------------------------------

    def launch(self, keys: list[AssetKey], partition: str | None = None) -> bool:
        label = ",".join(k.to_user_string() for k in keys) + (f"[{partition}]" if partition else "")
        started = time.monotonic()
        self.log(f"{label}: starting")
        # execute_in_process does not use the job's executor: the run names its process itself,
        # so a later sweep (this command again, the daemon) can fail it if this process is killed.
        # This command retries its own runs (run it again): the instance's run_retries relaunching
        # one from the daemon would put a second owner beside it.
        run_id = make_new_run_id()
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
        when the phase's backend is not vllm, a server is configured, or no `build` was given."""
        settings = self.project.settings
        backend = settings.generation.backend if role == "generate" else settings.extraction.backend
        if backend != "vllm" or settings.vllm.extraction_urls or self.build is None:
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
            self.job = self.build(Project(shared, self.project.store)).resolve_implicit_global_asset_job_def()
            try:
                yield
            finally:
                self.job = job
        self.log(f"vLLM ({role}): stopped")

    def _todo(self, keys: list[AssetKey], redo: set[AssetKey]) -> list[AssetKey]:
        """`keys` (in graph order) that must run: unfinished or forced, or after one that runs."""
        todo: list[AssetKey] = []
        staleness = Staleness(self.project)
        for key in keys:
            parents_run = self.graph.get(key).parent_keys & set(todo)
            why = "redo asked (--from)" if key in redo else (
                f"{parents_run.pop().to_user_string()} runs first" if parents_run else self.unfinished(key, staleness)
            )  # fmt: skip
            self.log(f"{key.to_user_string()}: " + (f"to run ({why})" if why else "finished, skipped"))
            if why:
                todo.append(key)
        return todo

    def run(self, *, through: str = "drafter_release", redo_from: AssetKey | None = None) -> bool:
        """Data assets, then each unfinished shard, then the drafter and its evaluation; False at the first failure."""
        self.log(f"{len(sweep_dead_runs(self.instance))} run(s) of dead processes failed and their slots freed")
        order = self.graph.toposorted_asset_keys
        redo = set() if redo_from is None else AssetSelection.assets(redo_from).downstream().resolve(self.graph)
        data = [k for k in order if k != HIDDEN_STATES and k not in AFTER_SHARDS]
        todo = self._todo(data, redo)
        if todo:
            with self.engine("generate") if RESPONSES in todo else nullcontext():
                if not self.launch(todo):
                    return False
        if self.project.settings.training.mode == "rolling" and through != "hidden_states":
            return self._run_rolling(AFTER_SHARDS[: AFTER_SHARDS.index(AssetKey(through)) + 1], redo)
        states = self.shard_states()
        shards = [k for k, state in states.items() if state != "done" or HIDDEN_STATES in redo]
        self.log(f"{len(states)} shards registered, {len(states) - len(shards)} finished, {len(shards)} to run")
        with self.engine("extract") if shards else nullcontext():
            failed = [key for key in shards if not self.launch([HIDDEN_STATES], key)]
        if failed:
            self.log(f"shards failed: {', '.join(failed)}; run the same command again to resume them")
            return False
        if through == "hidden_states":
            return True
        # A shard that ran made what its record says: the drafter runs when that changed what it trains on.
        todo = self._todo(AFTER_SHARDS[: AFTER_SHARDS.index(AssetKey(through)) + 1], redo)
        return not todo or self.launch(todo)

    def _run_rolling(self, after: list[AssetKey], redo: set[AssetKey]) -> bool:
        """Rolling mode: `drafter` trains in a process of its own while this one extracts each shard the window
        admits (README, "Training past the disk"); then `drafter_eval`."""
        todo = self._todo(after, redo)
        if DRAFTER not in todo:
            return not todo or self.launch(todo)
        training = self.project.settings.training
        tried: set[str] = set()
        with (
            self.engine("extract"),
            tempfile.TemporaryDirectory(prefix="eagle3-start-") as tmp,
            self._process(DRAFTER, Path(tmp)) as trainer,
        ):
            started = time.monotonic()
            while trainer.poll() is None:
                window = Window.read(self.project.store, registered_shard_keys(self.instance), training.window_shards)
                states = self.shard_states()
                # One run per shard and command (its own retries within): a refusal is never launched again.
                todo_shards = [k for k in window.admitted() if states[k] != "done" and k not in tried]
                if not todo_shards:
                    time.sleep(ROLLING_POLL_S)
                    continue
                key = todo_shards[0]
                tried.add(key)
                if not self.launch([HIDDEN_STATES], key):
                    self.log(
                        f"{key} failed; the drafter waits for it up to training.shard_wait_s="
                        f"{training.shard_wait_s:g}s. Repair it from another shell (`python -m eagle3_assets.start "
                        f"--shard {key}`), or stop this command: running it again resumes"
                    )
        ok = trainer.returncode == 0
        self.log(f"drafter: {'ok' if ok else 'FAILED'} in {time.monotonic() - started:.1f}s")
        return ok and (len(after) == 1 or self.launch(after[1:]))

    @contextmanager
    def _process(self, key: AssetKey, tmp: Path) -> Iterator[subprocess.Popen]:
        """`key` materialized by `dagster asset materialize` in a process of its own, into this instance. Not a
        thread: two runs executing in one process at once can deadlock Dagster's compute-log capture. The
        process gets SIGTERM if this one dies, so a killed command leaves no trainer beside the next one's;
        in a session of its own, it is stopped here (SIGTERM, then SIGKILL to its group) when the block is
        left before it ended: a stop signal, an error."""
        config = tmp / "settings.yaml"
        config.write_text(yaml.safe_dump(self.project.settings.model_dump(mode="json")))
        env = {
            **os.environ, CONFIG_ENV: str(config), ROOT_ENV: self.project.store.url,
            "DAGSTER_HOME": self.instance.root_directory,
        }  # fmt: skip
        cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "eagle3_assets.definitions",
               "--select", key.to_user_string()]  # fmt: skip
        self.log(f"{key.to_user_string()}: starting, in its own process")
        process = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=terminate_with_parent, start_new_session=True
        )  # fmt: skip
        try:
            yield process
        finally:
            if process.poll() is None:
                self.log(f"{key.to_user_string()}: stopping its process")
                stop_groups([process], TRAINER_STOP_GRACE_S)

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
    parser.add_argument("--shard", action="append", default=[], metavar="KEY", help="(re)extract only this shard")
    parser.add_argument("--through", choices=THROUGH, default="drafter_release", help="stop after this asset")
    parser.add_argument("--from", dest="redo_from", metavar="ASSET", help="redo ASSET and everything after it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: finished work would be forgotten and redone", file=sys.stderr)
        return 2
    whole_graph = not (args.shard or args.list_shards)
    try:
        project = Project.from_environment()
        if args.through in EVALUATED and whole_graph:
            project.settings.check_evaluable()  # refused now, not after the drafter trained
    except Eagle3Error as e:  # settings refused as they load: the message names the field
        print(f"error: {e}", file=sys.stderr)
        return 2
    # One whole-graph command per store, whichever instance it records into; `--shard` repairs a shard beside it
    # (the rolling loop asks for that) and takes no lease. The lease comes first, before anything opens
    # $DAGSTER_HOME (loading the definitions does: the code location's pool check): two commands opening a fresh
    # one at once race to create its tables, and the second must only refuse, touching nothing.
    lease = Lease(project.store, START_LEASE_DIR, "python -m eagle3_assets.start") if whole_graph else nullcontext()
    began = time.monotonic()
    try:
        with lease:
            try:
                from eagle3_assets.definitions import build_definitions, defs
            except Eagle3Error as e:  # refused as the definitions load (a setting checked against the target)
                print(f"error: {e}", file=sys.stderr)
                return 2
            keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
            if args.redo_from is not None and args.redo_from not in keys:
                print(f"--from {args.redo_from}: no such asset; the assets are: {', '.join(sorted(keys))}", file=sys.stderr)
                return 2
            with DagsterInstance.get() as instance, StopSignals().installed() as stop:
                start = GraphStart(defs, instance, defs.resources["project"], build=build_definitions, stop=stop)
                if args.list_shards:
                    for key, state in start.shard_states().items():
                        print(f"{key}\t{state}")
                    return 0
                ok = start.run_shards(args.shard) if args.shard else start.run(
                    through=args.through, redo_from=AssetKey.from_user_string(args.redo_from) if args.redo_from else None
                )  # fmt: skip
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
