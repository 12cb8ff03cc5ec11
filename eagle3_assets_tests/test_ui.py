"""The UI as a person meets it: `make ui`'s webserver and daemon on a free loopback port, driven
through GraphQL (launch, crash, backfill) and looked at with headless Chromium.

Screenshots and page text land in test-artifacts/ui/ (git-ignored), with the server logs.
The unpartitioned assets are materialized in-process first (seconds, on a tiny demo
config), so the shard keys exist before the servers start.
"""

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import pytest
import yaml
from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    build_run_status_sensor_context,
    build_sensor_context,
)
from dagster_graphql import DagsterGraphQLClient

from eagle3_assets.definitions import build_definitions
from eagle3_assets.defs.ops.sensors import (
    STALL_TAG,
    build_shard_stall_sensor,
    pids_are_local,
    run_failure_alert_sensor,
    run_worker_pid,
)
from eagle3_assets.project import Project
from eagle3_assets.settings import AlertSettings, load_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.ui import REPO_ROOT, UiConfig, UiError, server_info, start_ui, wait_until_serving
from eagle3_assets_tests.conftest import tiny_settings
from eagle3_assets_tests.test_alerts import WebhookServer
from eagle3_assets_tests.test_pipeline import DATA_ASSETS, seed_demo_target

pytestmark = pytest.mark.slow

ARTIFACTS = REPO_ROOT / "test-artifacts" / "ui"
ALL_ASSETS = DATA_ASSETS + ["hidden_states", "drafter", "drafter_eval", "drafter_release"]
SHARDS = ["rows_0-20", "rows_20-40", "rows_40-45"]
WEBHOOK_ENV = "EAGLE3_TEST_UI_WEBHOOK"
# Edges of the docs/DESIGN.md §1 graph: asset -> what it depends on.
LINEAGE = {
    "prompts": [],
    "target_model": [],
    "responses": ["prompts", "target_model"],
    "tokenized": ["responses", "target_model"],
    "token_freq": ["target_model", "tokenized"],
    "vocab_map": ["token_freq"],
    "hidden_states": ["target_model", "tokenized"],
    "drafter": ["hidden_states", "target_model", "vocab_map"],
    "drafter_eval": ["drafter"],
    "drafter_release": ["drafter_eval"],
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--window-size=1600,1000",
    # Virtual time only advances while the page is idle: it waits for the UI's GraphQL fetches.
    "--virtual-time-budget=30000",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def instance_yaml() -> str:
    """The repo's dagster.yaml, without the community pop-up (it would cover the screenshots) and
    without automatic run retries: here the backfill is what relaunches a failed shard."""
    config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    config["nux"] = {"enabled": False}
    config["run_retries"] = {"enabled": False}
    return yaml.safe_dump(config)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def wait_for(what: str, check, timeout_s: float, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Ui:
    """The running UI of this module, with a GraphQL client and the instance it writes to."""

    def __init__(self, url: str, port: int, instance: DagsterInstance, project: Project, hook: WebhookServer):
        self.url = url
        self.client = DagsterGraphQLClient("127.0.0.1", port_number=port, timeout=120)
        self.instance = instance
        self.project = project
        self.hook = hook

    def query(self, text: str, variables: dict | None = None) -> dict:
        return self.client._execute(text, variables)

    def partition_statuses(self) -> dict[str, list[str]]:
        node = self.query(
            """{ assetNodeOrError(assetKey: {path: ["hidden_states"]}) { ... on AssetNode {
                 assetPartitionStatuses { ... on DefaultPartitionStatuses {
                   materializedPartitions failedPartitions unmaterializedPartitions materializingPartitions } } } } }"""
        )["assetNodeOrError"]["assetPartitionStatuses"]
        return {k: sorted(v) for k, v in node.items()}


@pytest.fixture(scope="module")
def ui(tmp_path_factory, tiny_target_dir):
    """Tiny demo materialized up to `tokenized` + shard rows_40-45, then webserver + daemon on a free port."""
    base = tmp_path_factory.mktemp("ui")
    home, root = base / "dagster_home", base / "store"
    home.mkdir()
    (home / "dagster.yaml").write_text(instance_yaml())
    settings = tiny_settings(
        # A cron tick during the test would request shards on its own and race the backfill.
        extraction=tiny_settings().extraction.model_copy(update={"backfill_cron": "0 0 1 1 *"}),
        alerts=tiny_settings().alerts.model_copy(update={"webhook_env": WEBHOOK_ENV}),
    )
    config = base / "eagle3.yaml"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    assert load_settings({"EAGLE3_CONFIG": str(config)}) == settings
    project = Project(settings, ArtifactStore(str(root)))
    seed_demo_target(project.store, tiny_target_dir)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*"):
        old.unlink()
    with DagsterInstance.from_config(str(home)) as instance, WebhookServer() as hook:
        job = build_definitions(project).resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in DATA_ASSETS]).success
        assert job.execute_in_process(
            instance=instance, asset_selection=[AssetKey("hidden_states")], partition_key="rows_40-45"
        ).success

        port = free_port()
        env = {
            **os.environ,
            "EAGLE3_CONFIG": str(config),
            "EAGLE3_ROOT": str(root),
            WEBHOOK_ENV: hook.url,
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        processes = start_ui(UiConfig(home, REPO_ROOT / "workspace.yaml", "127.0.0.1", port), env, ARTIFACTS)
        try:
            wait_until_serving(processes, timeout_s=300)
            handle = Ui(processes.config.url, port, instance, project, hook)
            wait_for("the code location to load", lambda: _location_loaded(handle), timeout_s=300)
            wait_for("the daemon to report healthy", lambda: _daemons_healthy(handle), timeout_s=300, poll_s=2)
            # Once the backfill below completes every shard, `pipeline` would start the drafter and its
            # evaluation: work these tests do not look at, on the same two cores.
            stop_sensor(handle, "pipeline")
            yield handle
        finally:
            processes.stop()


def _location_loaded(ui: Ui) -> bool:
    entries = ui.query(
        """{ workspaceOrError { ... on Workspace {
             locationEntries { name loadStatus locationOrLoadError { __typename } } } } }"""
    )["workspaceOrError"]["locationEntries"]
    loaded = [e for e in entries if e["loadStatus"] == "LOADED"]
    if loaded and loaded[0]["locationOrLoadError"]["__typename"] != "RepositoryLocation":
        raise AssertionError(f"code location failed to load: {entries}")
    return bool(loaded)


def _daemons_healthy(ui: Ui) -> bool:
    statuses = ui.query(
        "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"
    )["instance"]["daemonHealth"]["allDaemonStatuses"]
    needed = {s["daemonType"]: s["healthy"] for s in statuses if s["required"]}
    return {"QUEUED_RUN_COORDINATOR", "BACKFILL"} <= needed.keys() and all(needed.values())


def test_the_asset_graph_lists_every_asset_with_its_lineage_and_shards(ui):
    nodes = ui.query(
        """{ assetNodes { assetKey { path } groupName dependencyKeys { path } isPartitioned
             partitionDefinition { name type } partitionKeys } }"""
    )["assetNodes"]
    graph = {n["assetKey"]["path"][0]: n for n in nodes}
    assert sorted(graph) == sorted(ALL_ASSETS)
    assert {k: sorted(d["path"][0] for d in n["dependencyKeys"]) for k, n in graph.items()} == LINEAGE
    assert {k: n["groupName"] for k, n in graph.items()} == {
        **{k: "data" for k in DATA_ASSETS},
        "hidden_states": "shards",
        "drafter": "drafter",
        "drafter_eval": "drafter",
        "drafter_release": "drafter",
    }
    assert [k for k, n in graph.items() if n["isPartitioned"]] == ["hidden_states"]
    shards = graph["hidden_states"]
    assert shards["partitionDefinition"] == {"name": "hidden_state_shards", "type": "DYNAMIC"}
    assert shards["partitionKeys"] == SHARDS


def signal_tree(pid: int, sig: signal.Signals) -> list[int]:
    """Send `sig` to a process and everything below it; returns the pids signalled."""
    os.kill(pid, signal.SIGSTOP)  # no new children while we list them
    victims = [pid, *descendants(pid)]
    for p in victims:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return victims


def stop_sensor(ui: Ui, name: str) -> None:
    selector = {"repositoryLocationName": "eagle3_assets", "repositoryName": "__repository__", "sensorName": name}
    state = ui.query(
        "query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { ... on Sensor { sensorState { id } } } }",
        {"s": selector},
    )["sensorOrError"]["sensorState"]
    stopped = ui.query(
        """mutation($id: String!) { stopSensor(id: $id) { __typename
             ... on StopSensorMutationResult { instigationState { status } } ... on PythonError { message } } }""",
        {"id": state["id"]},
    )["stopSensor"]
    assert stopped.get("instigationState", {}).get("status") == "STOPPED", stopped


def launch_shard_run(ui: Ui, partition: str) -> str:
    launched = ui.query(
        """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
             ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {
            "p": {
                "selector": {
                    "repositoryLocationName": "eagle3_assets",
                    "repositoryName": "__repository__",
                    "jobName": "__ASSET_JOB",
                    "assetSelection": [{"path": ["hidden_states"]}],
                    "assetCheckSelection": [{"assetKey": {"path": ["hidden_states"]}, "name": "shard_integrity"}],
                },
                "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]},
                "runConfigData": {},
            }
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def evaluate_sensors(ui: Ui, project: Project, run_id: str | None = None) -> str:
    """What the daemon does every minute, here and now: the stall sensor, then the failure alert for `run_id`."""
    env = project.settings.alerts.webhook_env
    os.environ[env] = ui.hook.url
    try:
        result = build_shard_stall_sensor(check_pids=True)(
            build_sensor_context(instance=ui.instance, resources={"project": project})
        )
        if run_id is not None:
            run = ui.instance.get_run_by_id(run_id)
            failure = ui.instance.all_logs(run_id, of_type=DagsterEventType.RUN_FAILURE)[0].dagster_event
            context = build_run_status_sensor_context(
                sensor_name="run_failure_alert",
                dagster_event=failure,
                dagster_instance=ui.instance,
                dagster_run=run,
                resources={"project": project},
            ).for_run_failure()
            run_failure_alert_sensor(context)
        return result.skip_message
    finally:
        del os.environ[env]


def test_a_hung_then_killed_shard_run_is_alerted_and_failed(ui):
    # `make ui`'s instance (SQLite, default launcher): run workers are processes of this machine.
    assert pids_are_local(ui.instance)
    run_id = launch_shard_run(ui, "rows_20-40")
    # Freeze the run worker as soon as it reports its pid (it is still loading the code then):
    # alive, but silent, like a hung collective.
    pid, _ = wait_for("the run worker's pid", lambda: run_worker_pid(ui.instance, run_id), 300, poll_s=0.2)
    frozen = signal_tree(pid, signal.SIGSTOP)
    try:
        impatient = Project(
            ui.project.settings.model_copy(update={"alerts": AlertSettings(stall_after_s=2, webhook_env=WEBHOOK_ENV)}),
            ui.project.store,
        )
        time.sleep(2)
        assert evaluate_sensors(ui, impatient) == "1 running shard run(s): 1 newly stalled, 0 with their process gone"
        run = ui.instance.get_run_by_id(run_id)
        assert run.status in (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED)  # left running
        assert run.tags[STALL_TAG] == "stalled"
        assert evaluate_sensors(ui, impatient) == "1 running shard run(s): 0 newly stalled, 0 with their process gone"
        assert [(p["alert"]["kind"], p["alert"]["run_id"]) for p in ui.hook.received] == [("shard_stalled", run_id)]
        assert ui.hook.received[0]["text"].startswith(
            f"[eagle3] shard rows_20-40 (run {run_id}): stalled, no progress reported in the "
        )
    finally:
        # Now the machine dies: the worker and its step processes are killed.
        killed = signal_tree(pid, signal.SIGKILL)
    wait_for("the killed processes to go", lambda: not any(alive(p) for p in killed + frozen), 60, poll_s=0.2)

    # Whoever sees it first fails the run: the code server that started the worker (when it
    # still runs) or the stall sensor; either way an alert goes out.
    evaluate_sensors(ui, ui.project)
    wait_for("the run to fail", lambda: ui.instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE, 60)
    evaluate_sensors(ui, ui.project, run_id)
    kinds = [p["alert"]["kind"] for p in ui.hook.received]
    # (The daemon may run the same sensors, so the crash can be reported by more than one.)
    assert kinds[0] == "shard_stalled" and kinds[1:] and set(kinds[1:]) <= {"shard_process_gone", "run_failed"}, kinds
    assert {p["alert"]["run_id"] for p in ui.hook.received} == {run_id}
    assert ui.instance.event_log_storage.get_concurrency_run_ids() == set()
    statuses = wait_for(
        "the killed shard to show as failed",
        lambda: (s := ui.partition_statuses())["failedPartitions"] == ["rows_20-40"] and s,
        60,
    )
    assert statuses["materializedPartitions"] == ["rows_40-45"]
    # "Unmaterialized" counts every shard without a materialization, failed ones included.
    assert statuses["unmaterializedPartitions"] == ["rows_0-20", "rows_20-40"]


def test_a_backfill_of_missing_and_failed_shards_finishes(ui):
    before = ui.partition_statuses()
    todo = sorted(set(before["unmaterializedPartitions"]) | set(before["failedPartitions"]))
    assert todo == ["rows_0-20", "rows_20-40"]  # rows_40-45 was materialized in-process
    launched = ui.query(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) { __typename
             ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
        {"p": {"partitionNames": todo, "assetSelection": [{"path": ["hidden_states"]}], "title": "missing and failed"}},
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]

    def finished():
        b = ui.query(
            """query($id: String!) { partitionBackfillOrError(backfillId: $id) { ... on PartitionBackfill {
                 status isAssetBackfill partitionNames runs { runId status tags { key value } } } } }""",
            {"id": backfill_id},
        )["partitionBackfillOrError"]
        return b if b["status"] not in ("REQUESTED", "CANCELING", "FAILING") else None

    backfill = wait_for("the backfill to finish", finished, timeout_s=900, poll_s=3)
    assert backfill["status"] == "COMPLETED_SUCCESS", backfill
    assert backfill["isAssetBackfill"] and sorted(backfill["partitionNames"]) == todo
    # One run per shard, each successful.
    runs = backfill["runs"]
    assert sorted({t["value"] for r in runs for t in r["tags"] if t["key"] == "dagster/partition"}) == todo
    assert len(runs) == 2 and {r["status"] for r in runs} == {"SUCCESS"}

    after = ui.partition_statuses()
    assert after == {
        "materializedPartitions": SHARDS,
        "failedPartitions": [],
        "unmaterializedPartitions": [],
        "materializingPartitions": [],
    }
    # Every shard shows its figures: the materialization's metadata, and the progress observations.
    latest = ui.query(
        """query($p: [String!]) { assetNodeOrError(assetKey: {path: ["hidden_states"]}) { ... on AssetNode {
             latestMaterializationByPartition(partitions: $p) { partition
               metadataEntries { label ... on IntMetadataEntry { intValue } ... on FloatMetadataEntry { floatValue } } }
             assetObservations(partitions: $p) { partition } } } }""",
        {"p": SHARDS},
    )["assetNodeOrError"]
    figures = {
        m["partition"]: {e["label"]: e.get("intValue", e.get("floatValue")) for e in m["metadataEntries"]}
        for m in latest["latestMaterializationByPartition"]
    }
    rows = {"rows_0-20": 20, "rows_20-40": 20, "rows_40-45": 5}
    assert {k: (f["samples_done"], f["samples_total"], f["rows_total"]) for k, f in figures.items()} == {
        k: (n, n, n) for k, n in rows.items()
    }
    assert all(f["bytes"] > 0 and f["samples_per_s"] > 0 for f in figures.values())
    assert {o["partition"] for o in latest["assetObservations"]} == set(SHARDS)


def page_text(html: str) -> str:
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html))).strip()


def browse(url: str, name: str, profile_root: Path) -> str:
    """The page's rendered text (--dump-dom) and its screenshot, test-artifacts/ui/<name>.png and .html."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's `chromium` is not installed: run scripts/install_ui_deps.sh"
    png = ARTIFACTS / f"{name}.png"
    profile = profile_root / name  # a fresh profile per page: no state carried between pages
    shot = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}", "--dump-dom", url],
        capture_output=True,
        timeout=240,
    )
    assert shot.returncode == 0, shot.stderr.decode()[-2000:]
    html = shot.stdout.decode()
    (ARTIFACTS / f"{name}.html").write_text(html)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1600, 1000)
    assert len(data) > 20_000, f"{png} is {len(data)} bytes: a blank page?"
    return page_text(html)


def test_the_browser_shows_the_asset_graph_and_the_shard_partitions(ui, tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    lineage = f"{ui.url}/assets/drafter_release?view=lineage&lineageScope=upstream&lineageDepth=10"
    graph = browse(lineage, "asset-graph", profiles)
    for asset in ALL_ASSETS:
        assert asset in graph, f"{asset} is not on the rendered asset graph: {graph[:1500]}"
    for group in ["data", "shards", "drafter"]:
        assert group in graph

    statuses = ui.partition_statuses()
    parts = browse(f"{ui.url}/assets/hidden_states?view=partitions", "shard-partitions", profiles)
    for key in SHARDS:
        assert key in parts
    counts = {k: len(statuses[f"{k.lower()}Partitions"]) for k in ["Failed", "Materialized", "Materializing"]}
    for label, n in counts.items():
        assert f"{label} ({n})" in parts, f"{label} ({n}) not on the partitions page: {parts[:1500]}"

    shard = browse(f"{ui.url}/assets/hidden_states?view=partitions&partition=rows_40-45", "shard-rows_40-45", profiles)
    for figure in ["samples_done", "samples_per_s", "eta_s", "bytes_per_token", "rows_total"]:
        assert figure in shard, f"{figure} not shown for rows_40-45: {shard[:1500]}"
    (ARTIFACTS / "pages.json").write_text(json.dumps({"graph": graph, "partitions": parts, "shard": shard}, indent=1))


def _reload(ui: Ui) -> None:
    ui.query('mutation { reloadRepositoryLocation(repositoryLocationName: "eagle3_assets") { __typename } }')
    wait_for("the code location to load again", lambda: _location_loaded(ui), timeout_s=300)


def _staleness(ui: Ui, keys: list[str]) -> dict[str, dict]:
    nodes = ui.query(
        """query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) {
             assetKey { path } staleStatus staleCauses { key { path } category reason dependency { path } }
             metadataEntries { label ... on TextMetadataEntry { text } } } }""",
        {"keys": [{"path": [k]} for k in keys]},
    )["assetNodes"]
    return {n["assetKey"]["path"][0]: n for n in nodes}


def test_a_changed_setting_shows_the_assets_it_made_stale_with_the_setting_named(ui):
    config = Path(ui.project.store.url).parent / "eagle3.yaml"
    original = config.read_text()
    changed = ui.project.settings.model_copy(update={"draft_vocab_size": 32})
    try:
        config.write_text(yaml.safe_dump(changed.model_dump(mode="json")))
        _reload(ui)
        nodes = _staleness(ui, ["tokenized", "token_freq", "vocab_map"])
        vocab_map = nodes["vocab_map"]
        assert vocab_map["staleStatus"] == "STALE"
        assert {"key": {"path": ["vocab_map"]}, "category": "CODE", "reason": "has a new code version", "dependency": None} in vocab_map["staleCauses"]
        named = {e["label"]: e.get("text") for e in vocab_map["metadataEntries"]}
        assert named["eagle3/stale_because"] == "setting draft_vocab_size: 64 -> 32"
        # What does not read the setting is not stale, and names nothing.
        for key in ["tokenized", "token_freq"]:
            assert nodes[key]["staleStatus"] == "FRESH", nodes[key]
            assert "eagle3/stale_because" not in {e["label"] for e in nodes[key]["metadataEntries"]}
    finally:
        config.write_text(original)
        _reload(ui)
    assert _staleness(ui, ["vocab_map"])["vocab_map"]["staleStatus"] == "FRESH"


def test_make_ui_stops_webserver_daemon_and_code_servers_on_ctrl_c(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "EAGLE3_ROOT": str(tmp_path / "store"),
        "EAGLE3_UI_PORT": str(port),
    }
    env.pop("EAGLE3_CONFIG", None)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text(instance_yaml())
    log = (tmp_path / "ui.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_assets.ui"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    seen: set[int] = set()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("the webserver", lambda: server_info(url) or proc.poll() is not None, timeout_s=300)
        assert proc.poll() is None, (tmp_path / "ui.log").read_text()
        # Webserver, daemon, and the code server each of them starts.
        wait_for("the code servers", lambda: len(descendants(proc.pid)) >= 4, timeout_s=300)
        seen = set(descendants(proc.pid))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        wait_for("every child to exit", lambda: not any(alive(p) for p in seen), timeout_s=60, poll_s=0.5)
        assert server_info(url) is None
        assert "[ui] stopped" in (tmp_path / "ui.log").read_text()
    finally:
        log.close()
        for pid in [proc.pid, *seen]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _tables(db: Path) -> set[str]:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_make_ui_creates_a_fresh_instances_schema_once_before_webserver_and_daemon_start(tmp_path):
    # Both servers creating a fresh home's SQLite schema at once: one died of `table alembic_version already exists`.
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(instance_yaml())
    processes = start_ui(UiConfig(home, REPO_ROOT / "workspace.yaml", "127.0.0.1", free_port()), dict(os.environ), tmp_path)
    try:
        # Neither child has imported Dagster yet when start_ui returns: the schema is the one made before them.
        for db in ("history/runs.db", "history/runs/index.db", "schedules/schedules.db"):
            assert "alembic_version" in _tables(home / db), db
    finally:
        processes.stop()


def test_make_ui_refuses_an_instance_whose_storage_cannot_be_created_naming_the_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("run_storage:\n  module: no_such_module\n  class: Nothing\n")
    with pytest.raises(UiError, match=rf"cannot create the instance storage in {re.escape(str(home))}: `.*dagster "
                       r"instance migrate` exited with code 1:\n(.|\n)*no_such_module"):  # fmt: skip
        start_ui(UiConfig(home, REPO_ROOT / "workspace.yaml", "127.0.0.1", free_port()), dict(os.environ), tmp_path)
