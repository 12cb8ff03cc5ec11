"""Past one machine.

PostgreSQL instance storage: a local server started here (Debian's `postgresql`), a
`dagster.yaml` with `storage: postgres`, and a shard materialized by a separate process, as on
another machine, then seen by this process, the webserver and the daemon.

Kubernetes: what can be checked without a cluster. The step executor's config against
dagster-k8s itself (and the pods it builds from it), the manifests against the Kubernetes
models, the pipeline settings, names that must agree across files, and the definitions
loading with the k8s executor.
"""

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from glob import glob
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance
from dagster_graphql import DagsterGraphQLClient

from eagle3_assets.definitions import build_definitions
from eagle3_assets.defs.ops.sensors import pids_are_local
from eagle3_assets.project import Project
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.ui import REPO_ROOT, UiConfig, start_ui, wait_until_serving
from eagle3_assets_tests.conftest import tiny_settings
from eagle3_assets_tests.test_pipeline import seed_demo_target

PASSWORD_ENV = "EAGLE3_TEST_PG_PASSWORD"
DB = "dagster"
# Enough to register the shard keys; the shard run needs nothing downstream.
UP_TO_TOKENIZED = ["prompts", "target_model", "responses", "tokenized"]


def postgres_bin() -> Path:
    found = sorted(glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.fail(
            "PostgreSQL server binaries are missing (/usr/lib/postgresql/*/bin): run scripts/install_ui_deps.sh"
        )
    return Path(found[-1]).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_yaml(port: int) -> str:
    """The repo's instance settings with PostgreSQL storage (docs/OPERATING.md shows the same block)."""
    config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    config["storage"] = {
        "postgres": {
            "postgres_db": {
                "username": "postgres",
                "password": {"env": PASSWORD_ENV},
                "hostname": "127.0.0.1",
                "db_name": DB,
                "port": port,
            }
        }
    }
    config["nux"] = {"enabled": False}
    config["run_retries"] = {"enabled": False}
    return yaml.safe_dump(config)


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1:<free port>, as a non-root user (initdb refuses root)."""
    bindir = postgres_bin()
    # Outside pytest's tmp tree: its root-only parent directories would lock the server user out.
    base = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    data, log = base / "data", base / "server.log"
    as_user: dict = {}
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres") if _has_user("postgres") else pwd.getpwnam("nobody")
        os.chown(base, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    port = free_port()
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8", "HOME": str(base)}

    def pg(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(bindir / args[0]), *args[1:]], cwd=base, env=env, capture_output=True, text=True, timeout=180,
            **as_user, **kw,
        )  # fmt: skip

    try:
        init = pg("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        assert init.returncode == 0, init.stderr
        options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
        start = pg("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "120", "start")
        assert start.returncode == 0, start.stderr + (log.read_text() if log.exists() else "")
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DB}")
        conn.close()
        yield port
    finally:
        if data.exists():
            pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.mark.slow
def test_a_shard_runs_against_postgres_and_every_process_sees_it(postgres, tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "unused-with-trust-auth")
    home, root = tmp_path / "dagster_home", tmp_path / "store"
    home.mkdir()
    (home / "dagster.yaml").write_text(postgres_yaml(postgres))
    settings = tiny_settings(extraction=tiny_settings().extraction.model_copy(update={"backfill_cron": "0 0 1 1 *"}))
    config = tmp_path / "eagle3.yaml"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    project = Project(settings, ArtifactStore(str(root)))
    seed_demo_target(project.store, tiny_target_dir)

    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        # Runs may come from other machines: pids mean nothing here, stalls are still watched.
        assert not pids_are_local(instance)
        job = build_definitions(project).resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in UP_TO_TOKENIZED]).success
        shard_keys = sorted(instance.get_dynamic_partitions("hidden_state_shards"))
        assert shard_keys == ["rows_0-20", "rows_20-40", "rows_40-45"]

        # Another process (another machine, as far as it knows): only the database and the store are shared.
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "EAGLE3_CONFIG": str(config),
            "EAGLE3_ROOT": str(root),
            "OMP_NUM_THREADS": "1",
        }
        cli = subprocess.run(
            [
                str(Path(sys.executable).parent / "dagster"), "asset", "materialize",
                "-m", "eagle3_assets.definitions", "--select", "hidden_states", "--partition", "rows_40-45",
            ],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr[-3000:]

        event = instance.get_latest_materialization_event(AssetKey("hidden_states"))
        assert event.asset_materialization.partition == "rows_40-45"
        meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        assert (meta["samples_done"], meta["samples_total"], meta["rows_total"]) == (5, 5, 5)
        assert instance.fetch_observations(AssetKey("hidden_states"), limit=100).records
        assert project.store.exists("hidden_states/rows_40-45/_SUCCESS.json")
        run = instance.get_run_by_id(event.run_id)
        assert run.status.value == "SUCCESS" and run.tags["dagster/partition"] == "rows_40-45"

        # The webserver and the daemon on the same database show it, and the daemon heartbeats into it.
        port = free_port()
        ui = start_ui(UiConfig(home, REPO_ROOT / "workspace.yaml", "127.0.0.1", port), env, tmp_path / "logs")
        try:
            wait_until_serving(ui, timeout_s=300)
            client = DagsterGraphQLClient("127.0.0.1", port_number=port, timeout=120)
            statuses = _wait_for_statuses(client)
            assert statuses == {
                "materializedPartitions": ["rows_40-45"],
                "failedPartitions": [],
                "unmaterializedPartitions": ["rows_0-20", "rows_20-40"],
                "materializingPartitions": [],
            }
            heartbeats = _wait_for_heartbeats(instance)
            assert {"QUEUED_RUN_COORDINATOR", "BACKFILL", "SENSOR"} <= heartbeats
        finally:
            ui.stop()


def _wait_for_statuses(client) -> dict:
    deadline = time.monotonic() + 300
    while True:
        node = client._execute(
            """{ assetNodeOrError(assetKey: {path: ["hidden_states"]}) { __typename ... on AssetNode {
                 assetPartitionStatuses { ... on DefaultPartitionStatuses {
                   materializedPartitions failedPartitions unmaterializedPartitions materializingPartitions } } } } }"""
        )["assetNodeOrError"]
        if node["__typename"] == "AssetNode":
            return {k: sorted(v) for k, v in node["assetPartitionStatuses"].items()}
        if time.monotonic() > deadline:
            raise AssertionError(f"hidden_states never appeared in the webserver: {node}")
        time.sleep(2)


def _wait_for_heartbeats(instance: DagsterInstance) -> set[str]:
    deadline = time.monotonic() + 300
    while True:
        beats = {str(k) for k in instance.get_daemon_heartbeats()}
        if {"QUEUED_RUN_COORDINATOR", "BACKFILL", "SENSOR"} <= beats or time.monotonic() > deadline:
            return beats
        time.sleep(2)


# --- past one machine: Kubernetes ----------------------------------------------------------------

K8S = REPO_ROOT / "deploy" / "k8s"


def _manifests(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _step_pod(config: dict, op: str) -> dict:
    """The pod spec dagster-k8s builds for step `op`, merged as K8sStepHandler merges it."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, construct_dagster_k8s_job
    from kubernetes.client import ApiClient

    context = K8sContainerContext(
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(config.get("step_k8s_config", {}))
    ).merge(
        K8sContainerContext(
            run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(config["per_step_k8s_config"].get(op, {}))
        )
    )
    job = construct_dagster_k8s_job(
        DagsterK8sJobConfig(job_image="registry.example.com/eagle3-assets:0.1.0", dagster_home="/opt/dagster"),
        args=["dagster", "api", "execute_step"],
        job_name=f"dagster-step-{op.replace('_', '-')}",
        user_defined_k8s_config=context.run_k8s_config,
    )
    return ApiClient().sanitize_for_serialization(job)["spec"]["template"]["spec"]


def test_the_step_executor_config_is_valid_and_puts_gpus_where_they_belong():
    pytest.importorskip("dagster_k8s", reason="dagster-k8s==0.29.27 (extra `k8s`) validates the executor config")
    from dagster._config import validate_config
    from dagster_k8s import k8s_job_executor

    from eagle3_assets.defs.ops.k8s import load_executor_config

    config = load_executor_config(K8S / "executor.yaml", definition_ops())
    checked = validate_config(k8s_job_executor.config_schema.config_type, config)
    assert checked.success, [e.message for e in checked.errors]

    gpus = {}
    for op in ["prompts", "tokenized", "vocab_map", "responses", "hidden_states", "drafter", "drafter_eval"]:
        pod = _step_pod(config, op)
        (container,) = pod["containers"]
        limits = container["resources"].get("limits", {})
        gpus[op] = (limits.get("nvidia.com/gpu"), pod.get("nodeSelector"))
        assert container["resources"]["requests"]["cpu"], op
    assert gpus == {
        "prompts": (None, None),
        "tokenized": (None, None),
        "vocab_map": (None, None),
        "responses": (None, None),  # a client of the vLLM server
        "hidden_states": (None, None),  # a client of the vLLM servers, on any CPU node
        "drafter": ("8", {"nvidia.com/gpu.present": "true"}),  # every GPU of the node: torchrun, auto
        "drafter_eval": ("8", {"nvidia.com/gpu.present": "true"}),
    }
    # The shard pod reads the servers' files from the shared store, not from a server's node.
    shards = _step_pod(config, "hidden_states")
    assert "affinity" not in shards and "tolerations" not in shards
    assert (shards["volumes"], shards["containers"][0]["volumeMounts"]) == ([], [])


def definition_ops() -> set[str]:
    """Every op the definitions run: the assets, their checks and the verify_shards op."""
    defs = build_definitions(Project(tiny_settings(), ArtifactStore("memory://eagle3-k8s-ops")))
    jobs = [defs.resolve_implicit_global_asset_job_def(), defs.resolve_job_def("verify_shards")]
    return {node.name for job in jobs for node in job.graph.node_defs}


def test_a_misspelt_step_or_field_in_the_executor_config_is_refused(tmp_path):
    pytest.importorskip("dagster_k8s", reason="dagster-k8s==0.29.27 (extra `k8s`) validates the executor config")
    from dagster_k8s.job import UserDefinedDagsterK8sConfig

    from eagle3_assets.defs.ops.k8s import K8sConfigError, load_executor_config

    bad = tmp_path / "executor.yaml"
    bad.write_text("per_step_k8s_config:\n  hidden_state: {}\n")
    with pytest.raises(K8sConfigError, match=r"per_step_k8s_config names unknown ops \['hidden_state'\]"):
        load_executor_config(bad, definition_ops())
    with pytest.raises(Exception, match=r"Unexpected keys in model class V1PodSpec: \{'nodeSelectr'\}"):
        UserDefinedDagsterK8sConfig.from_dict({"pod_spec_config": {"nodeSelectr": {"a": "b"}}})


def test_the_definitions_load_with_the_k8s_executor(monkeypatch):
    pytest.importorskip("dagster_k8s", reason="dagster-k8s==0.29.27 (extra `k8s`) provides the executor")
    from eagle3_assets.settings import load_settings

    settings = load_settings({"EAGLE3_CONFIG": str(K8S / "eagle3.yaml")})
    project = Project(settings, ArtifactStore("memory://eagle3-k8s-test"))
    assert build_definitions(project).resolve_implicit_global_asset_job_def().executor_def.name == (
        "multi_or_in_process_executor"
    )
    monkeypatch.setenv("EAGLE3_K8S_EXECUTOR", str(K8S / "executor.yaml"))
    defs = build_definitions(project)
    job = defs.resolve_implicit_global_asset_job_def()
    # The k8s executor, wrapped so that every run sweeps dead runs off the gpu pool first.
    assert job.executor_def.name == "eagle3_k8s_executor"
    assert sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()) == sorted(
        ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map", "hidden_states", "drafter",
         "drafter_eval", "drafter_release"]
    )  # fmt: skip
    assert definition_ops() == {
        "prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map", "hidden_states", "drafter",
        "drafter_eval", "drafter_release", "tokenized_reasoning_coverage", "vocab_map_vocab_map_invariant", "hidden_states_shard_integrity",
        "verify_all_shards",
    }  # fmt: skip


def test_the_manifests_are_valid_kubernetes_objects():
    pytest.importorskip("kubernetes", reason="the kubernetes client (with dagster-k8s) checks the manifests")
    import kubernetes.client as k8s
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

    kinds = {
        "StatefulSet": k8s.V1StatefulSet,
        "Service": k8s.V1Service,
        "ConfigMap": k8s.V1ConfigMap,
        "PersistentVolumeClaim": k8s.V1PersistentVolumeClaim,
        "Secret": k8s.V1Secret,
    }
    seen = []
    for name in ["vllm.yaml", "drafter.yaml", "config.yaml", "secrets.example.yaml"]:
        for doc in _manifests(name):
            model = kinds[doc["kind"]]
            # Strict: an unknown or misspelt field raises, naming the model class.
            k8s_model_from_dict(model, k8s_snake_case_dict(model, doc))
            seen.append((doc["kind"], doc["metadata"]["name"]))
    assert sorted(seen) == [
        ("ConfigMap", "eagle3-env"),
        ("PersistentVolumeClaim", "eagle3-models"),
        ("PersistentVolumeClaim", "eagle3-store"),
        ("Secret", "dagster-postgresql-secret"),
        ("Secret", "eagle3-secrets"),
        ("Service", "eagle3-drafter-pods"),
        ("Service", "eagle3-vllm"),
        ("Service", "eagle3-vllm-pods"),
        ("StatefulSet", "eagle3-drafter"),
        ("StatefulSet", "eagle3-vllm"),
    ]


def test_the_deployment_files_agree_with_each_other_and_the_settings():
    from urllib.parse import urlsplit

    from eagle3_assets.settings import load_settings

    settings = load_settings({"EAGLE3_CONFIG": str(K8S / "eagle3.yaml")})
    executor = yaml.safe_load((K8S / "executor.yaml").read_text())
    values = yaml.safe_load((K8S / "values.yaml").read_text())
    servers, service, pods = _manifests("vllm.yaml")
    config = _manifests("config.yaml")
    env = next(d for d in config if d["kind"] == "ConfigMap")["data"]
    secrets = next(d for d in _manifests("secrets.example.yaml") if d["metadata"]["name"] == "eagle3-secrets")
    server_pod = servers["spec"]["template"]["spec"]
    (vllm,) = server_pod["containers"]

    def arg(name: str) -> str:
        return vllm["args"][vllm["args"].index(name) + 1]

    # Generation reaches every server through the Service, on the port the servers listen on.
    url = urlsplit(settings.vllm.server_url)
    assert (url.hostname, url.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert arg("--port") == str(url.port)
    # Extraction names each server of the StatefulSet by its pod's DNS name: one per replica.
    assert servers["spec"]["serviceName"] == pods["metadata"]["name"] and pods["spec"]["clusterIP"] == "None"
    names = [f"{servers['metadata']['name']}-{i}.{pods['metadata']['name']}" for i in range(servers["spec"]["replicas"])]
    assert [(urlsplit(u).hostname, urlsplit(u).port) for u in settings.vllm.server_urls] == [(n, url.port) for n in names]
    # One server per GPU node, each with the node's GPUs.
    anti = server_pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= servers["spec"]["template"]["metadata"]["labels"].items()
    assert int(vllm["resources"]["limits"]["nvidia.com/gpu"]) == settings.vllm.tensor_parallel_size
    # The servers write sample files into the store every pod mounts, at EAGLE3_ROOT.
    store_claim = next(d for d in config if d["metadata"]["name"] == "eagle3-store")
    assert store_claim["spec"]["accessModes"] == ["ReadWriteMany"]
    server_mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    server_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in server_pod["volumes"] if "persistentVolumeClaim" in v}
    assert arg("--write-root") == env["EAGLE3_ROOT"] == server_mounts["store"]
    assert server_claims["store"] == store_claim["metadata"]["name"]
    assert vllm["envFrom"] == [{"configMapRef": {"name": "eagle3-env"}}]
    # A pool slot per server: N shard runs at once.
    assert values["concurrency"]["pools"]["defaultLimit"] == len(settings.vllm.server_urls)
    # drafter_eval's GPUs match the tensor-parallel size it serves with.
    eval_gpus = executor["per_step_k8s_config"]["drafter_eval"]["container_config"]["resources"]["limits"]
    assert int(eval_gpus["nvidia.com/gpu"]) == settings.vllm.tensor_parallel_size
    # Training: the step pod and each training node hold every GPU of a GPU node; the training nodes run the
    # asset's torchrun command and meet at the rendezvous Service, with the store and models where the step pod has them.
    launch = settings.training.launch
    trainers, rendezvous = _manifests("drafter.yaml")
    train_pod = trainers["spec"]["template"]["spec"]
    (torchrun,) = train_pod["containers"]
    drafter_gpus = executor["per_step_k8s_config"]["drafter"]["container_config"]["resources"]["limits"]["nvidia.com/gpu"]
    assert torchrun["resources"]["limits"]["nvidia.com/gpu"] == drafter_gpus == vllm["resources"]["limits"]["nvidia.com/gpu"]
    assert launch.nproc_per_node == "auto" and launch.nnodes == servers["spec"]["replicas"]  # all GPU nodes
    assert torchrun["command"] + torchrun["args"] == [
        "python", "-m", "torch.distributed.run", f"--nproc-per-node={drafter_gpus}", "--max-restarts=0",
        f"--nnodes={launch.nnodes}", f"--rdzv-backend={launch.rdzv_backend}", f"--rdzv-endpoint={launch.rdzv_endpoint}",
        f"--rdzv-id={launch.rdzv_id}", "-m", "eagle3_assets.drafter",
    ]  # fmt: skip
    host, port = launch.rdzv_endpoint.split(":")
    assert host == f"{trainers['metadata']['name']}-0.{rendezvous['metadata']['name']}"
    assert trainers["spec"]["serviceName"] == rendezvous["metadata"]["name"] and rendezvous["spec"]["clusterIP"] == "None"
    assert rendezvous["spec"]["ports"][0]["port"] == int(port) == torchrun["ports"][0]["containerPort"]
    assert torchrun["envFrom"] == vllm["envFrom"]
    assert {m["name"]: m["mountPath"] for m in torchrun["volumeMounts"]}.items() >= {
        "store": env["EAGLE3_ROOT"], "models": server_mounts["models"], "eagle3-config": "/etc/eagle3"}.items()
    assert {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in train_pod["volumes"]}.items() >= {
        "store": "eagle3-store", "models": "eagle3-models"}.items()
    # Every pod gets the same env, settings file, executor file and model volume.
    code = values["dagster-user-deployments"]["deployments"][0]
    assert code["dagsterApiGrpcArgs"] == ["--module-name", "eagle3_assets.definitions"]
    assert [c["name"] for c in code["envConfigMaps"]] == ["eagle3-env"]
    assert [s["name"] for s in code["envSecrets"]] == [secrets["metadata"]["name"]]
    mounts = {m["name"]: m["mountPath"] for m in code["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in code["volumes"] if "persistentVolumeClaim" in v}
    assert (mounts["store"], claims["store"]) == (env["EAGLE3_ROOT"], "eagle3-store")
    assert server_mounts["models"] == mounts["models"]
    assert env["EAGLE3_CONFIG"] == mounts["eagle3-config"] + "/eagle3.yaml"
    assert env["EAGLE3_K8S_EXECUTOR"] == mounts["eagle3-config"] + "/executor.yaml"
    assert settings.target_model.startswith(mounts["models"] + "/")
    assert settings.alerts.webhook_env in secrets["stringData"]
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomize["configMapGenerator"][0]["files"] == ["eagle3.yaml", "executor.yaml"]
    # The instance matches the repo's dagster.yaml (but for the pool limit): four runs, run monitoring on.
    repo = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    assert values["concurrency"]["runs"]["maxConcurrentRuns"] == repo["concurrency"]["runs"]["max_concurrent_runs"]
    assert values["dagsterDaemon"]["runMonitoring"]["enabled"] and repo["run_monitoring"]["enabled"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
