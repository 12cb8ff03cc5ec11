"""Extraction through vLLM (CPU build): the states equal HF's in one norm convention, shards extracted
through one long-lived server load the model once and pass the integrity check, the same server
serves generation too, and a server killed mid-shard fails the shard naming it while the rerun
resumes from the rows already written.

The module's server is the documented long-lived one: `python -m eagle3_assets.vllm_server --serve`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from eagle3_assets.generation.hf import HFGenerator
from eagle3_assets.generation.vllm import VLLMGenerator
from eagle3_assets.hidden_states import ExtractionRequest, extract_in_order, open_extractor
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.integrity import check_shard, check_shards
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.hidden_states.vllm_extractor import VLLMExtractor
from eagle3_assets.processes import group_members
from eagle3_assets.sample_file import decode_hidden, manifest_path, sample_path
from eagle3_assets.settings import ExtractionSettings, GenerationSettings, Settings, VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vllm_server.client import VllmServerError
from eagle3_assets.vllm_server.server import MODEL_LOAD_MARKER, VllmServer

from .helpers import kill_group, vllm_test_settings
from .vllm_helpers import AUX, MAX_MODEL_LEN, MAX_NEW_TOKENS, confident_target, conversations, prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

H = 64
MODEL_NAME = "tiny-vllm-target"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    path = confident_target(tiny_target_dir, tmp_path_factory.mktemp("vllm-hs") / "target")
    return TargetModel.read(path, aux_layer_ids=AUX)


def request_files(storage: Path) -> list[str]:
    """Hidden-state files (and locks) the server wrote that nobody collected."""
    return sorted(p.name for p in storage.iterdir() if ".safetensors" in p.name)


class LongLivedServer:
    def __init__(self, url: str, workdir: Path, process: subprocess.Popen, output: Path, root: Path):
        self.url, self.workdir, self.process, self.output = url, workdir, process, output
        self.root = root  # $EAGLE3_ROOT of the command: the store it may write sample files into

    @property
    def storage(self) -> Path:
        return self.workdir / "hidden_states"


@pytest.fixture(scope="module")
def server(target: TargetModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LongLivedServer]:
    """The documented command, as an operator runs it on the GPU node (here with --role both)."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("vllm-server")
    vllm = vllm_test_settings()
    config = {
        "target_model": str(target.path),
        "aux_layer_ids": AUX,
        "draft_vocab_size": 64,
        "vllm": json.loads(vllm.model_dump_json()),
    }
    (tmp / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {
        **os.environ,
        "EAGLE3_CONFIG": str(tmp / "config.yaml"),
        "EAGLE3_ROOT": str(tmp / "root"),
    }
    workdir, output = tmp / "work", tmp / "serve.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.vllm_server", "--serve", "--role", "both", "--workdir", str(workdir)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = None
    deadline = time.monotonic() + 600
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1)
        url = next((ln[4:] for ln in output.read_text().splitlines() if ln.startswith("URL=")), None)
    try:
        assert url == f"http://{vllm.host}:{vllm.port}", output.read_text()[-3000:]
        yield LongLivedServer(url, workdir, proc, output, tmp / "root")
        # Ctrl-C / SIGTERM to the command stops the server and everything it started.
        ready = next(ln for ln in output.read_text().splitlines() if ln.startswith("vLLM server ready at "))
        assert ready.startswith(
            f"vLLM server ready at {url} (role both, extracting layers [1, 2, 3, 4]; writes sample files under "
            f"['{tmp / 'root'}']; process group "
        )
        group = int(ready.rsplit(" ", 1)[1].rstrip(")"))
        assert len(group_members(group)) >= 3  # supervisor, API server, engine core (and its worker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, output.read_text()[-3000:]
        assert output.read_text().splitlines()[-1] == "vLLM server stopped"
        assert group_members(group) == []
    finally:
        kill_group(proc.pid)
        proc.wait()


def random_rows(lengths: list[int], seed: int = 0) -> TokenizedSet:
    rng = np.random.default_rng(seed)
    rows = [(rng.integers(7, 320, size=n).tolist(), rng.integers(0, 2, size=n).tolist()) for n in lengths]
    return TokenizedSet.from_rows(rows, list(range(len(rows))))


def shard_settings(**vllm_fields) -> Settings:
    return Settings(
        aux_layer_ids=AUX,
        draft_vocab_size=64,
        extraction=ExtractionSettings(backend="vllm", progress_interval_s=0.01),
        vllm=vllm_test_settings(**vllm_fields),
    )


def test_extraction_equals_hf_in_the_same_norm_convention(server: LongLivedServer, target: TargetModel):
    tset = random_rows([5, 17, 40, 3, 64, 1, 120])
    requests = [ExtractionRequest(row=r, input_ids=tset.row(r)[0]) for r in range(tset.num_rows)]
    hf = HFExtractor(target, batch_tokens=1, device="cpu")
    vx = VLLMExtractor(target, VllmSettings(server_url=server.url))
    assert (vx.backend, vx.last_hidden_state_norm, vx.hidden_size, vx.num_layers) == ("vllm", "pre_norm", H, 4)
    assert hf.last_hidden_state_norm == "pre_norm"  # both backends store the same convention
    assert (vx.aux_layer_ids, vx.max_context, vx.server.owned) == ((1, 2, 3), 255, False)
    want, got = extract_in_order(hf, requests), extract_in_order(vx, requests)
    for w, g in zip(want, got, strict=True):
        T = len(w.input_ids)
        assert g.row == w.row and np.array_equal(g.input_ids, w.input_ids)
        assert g.aux_hidden_states.shape == (T, 3 * H) and g.last_hidden_state.shape == (T, H)
        torch.testing.assert_close(g.aux_hidden_states, w.aux_hidden_states, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g.last_hidden_state, w.last_hidden_state, atol=1e-4, rtol=1e-4)
    vx.close()
    hf.close()
    assert VllmServer(server.url).is_healthy()  # closing a reused server's client leaves it running
    assert request_files(server.storage) == []  # every file the server wrote was read and deleted


def test_two_shards_through_one_server_load_the_model_once(server: LongLivedServer, target: TargetModel):
    store = ArtifactStore(f"memory://vllm-two-shards-{uuid.uuid4().hex[:8]}")
    tset = random_rows([int(n) for n in np.random.default_rng(1).integers(1, 60, size=30)])
    settings = shard_settings(server_url=server.url)
    shards = plan_shards(tset.num_rows, 15)
    for shard in shards:  # each like its own Dagster run: open the backend, extract, close
        extractor = open_extractor(settings, target)
        assert isinstance(extractor, VLLMExtractor) and not extractor.server.owned
        result = extract_shard(store, tset, shard, extractor, settings.extraction, model_name=MODEL_NAME)
        extractor.close()
        assert (result.rows_computed, result.rows_skipped) == (15, 0)
        assert (result.manifest.backend, result.manifest.last_hidden_state_norm) == ("vllm", "pre_norm")
        assert result.notes[-1].startswith("disk preflight skipped")  # a memory store: the client writes each file
    reports = check_shards(
        store, tset, shards, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16", model=MODEL_NAME,
        last_hidden_state_norm="pre_norm",
    )  # fmt: skip
    assert [(r.shard, r.ok, r.rows_ok) for r in reports] == [("rows_0-15", True, 15), ("rows_15-30", True, 15)]
    log = (server.workdir / "server.log").read_text()
    # One server process started, one model load, for both shards (and every other test of the module).
    assert sum(1 for line in log.splitlines() if line.startswith("$ ")) == 1
    assert log.count(MODEL_LOAD_MARKER) == 1
    assert request_files(server.storage) == []


def test_the_server_writes_each_sample_file_itself_into_a_store_it_can_see(
    server: LongLivedServer, target: TargetModel
):
    store = ArtifactStore(server.root / f"store-{uuid.uuid4().hex[:8]}")  # under the server's write root
    tset = random_rows([int(n) for n in np.random.default_rng(3).integers(1, 60, size=12)])
    for dtype in ("bfloat16", "float8_e4m3fn"):
        settings = shard_settings(server_url=server.url).model_copy(
            update={"extraction": ExtractionSettings(backend="vllm", storage_dtype=dtype, progress_interval_s=0.01)}
        )
        shard = Shard(0, 12)
        store.remove("hidden_states", recursive=True)
        extractor = open_extractor(settings, target, write_root=server.root)
        result = extract_shard(store, tset, shard, extractor, settings.extraction, model_name=MODEL_NAME)
        extractor.close()
        assert result.notes[-1] == "vllm backend wrote each file itself (one write per sample)"
        assert (result.rows_computed, result.manifest.dtype) == (12, dtype)
        report = check_shard(store, tset, shard, hidden_size=H, aux_layer_ids=AUX, dtype=dtype, model=MODEL_NAME,
                             last_hidden_state_norm="pre_norm")  # fmt: skip
        assert report.ok, report.summary()
        assert result.bytes_written == report.bytes
        assert request_files(server.storage) == []  # nothing went through the server's own directory
        # The states HF computes, in the storage dtype.
        want = extract_in_order(HFExtractor(target, batch_tokens=1, device="cpu"), [ExtractionRequest(3, tset.row(3)[0])])[0]
        got = st_load(store.read_bytes(sample_path(shard.key, 3)))
        tol = 0.07 if dtype == "float8_e4m3fn" else 0.01  # e4m3 keeps 3 mantissa bits; bf16 8
        aux = decode_hidden(got, "aux_hidden_states").float()
        assert (aux - want.aux_hidden_states).norm() / want.aux_hidden_states.norm() < tol


def test_the_extraction_server_generates_like_hf_too(server: LongLivedServer, target: TargetModel):
    gen_settings = GenerationSettings(backend="vllm", max_new_tokens=MAX_NEW_TOKENS)
    gen = VLLMGenerator(target, gen_settings, VllmSettings(server_url=server.url))
    prompts = [prompt_ids(target.path, m) for m in conversations()]
    got = gen.generate(prompts)
    gen.close()
    hf = HFGenerator(target, gen_settings.model_copy(update={"backend": "hf"}), device=torch.device("cpu"))
    assert got == hf.generate(prompts)
    assert request_files(server.storage) == []  # each request's hidden states were deleted
    assert VllmServer(server.url).is_healthy()


class KillServerAfter:
    """The backend, except that its server is killed (SIGKILL, whole group) after `n` samples."""

    def __init__(self, inner: VLLMExtractor, n: int):
        self.inner, self.n = inner, n

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def extract(self, requests, spec=None):
        for i, sample in enumerate(self.inner.extract(requests, spec)):
            yield sample
            if i + 1 == self.n:
                kill_group(self.inner.server.process.pid)


def test_a_server_killed_mid_shard_fails_naming_it_and_the_rerun_resumes(server: LongLivedServer, target: TargetModel):
    store = ArtifactStore(f"memory://vllm-killed-{uuid.uuid4().hex[:8]}")
    tset = random_rows([int(n) for n in np.random.default_rng(2).integers(1, 80, size=24)])
    shard = Shard(0, 24)
    settings = shard_settings()  # no server_url: the run starts its own server
    extractor = open_extractor(settings, target)
    assert extractor.server.owned
    url, pid, workdir = extractor.url, extractor.server.process.pid, extractor.server.workdir
    try:
        with pytest.raises(VllmServerError) as e:
            extract_shard(store, tset, shard, KillServerAfter(extractor, 3), settings.extraction, model_name=MODEL_NAME)
        message = str(e.value)
        assert message.startswith(f"the vLLM server at {url} (started by this run, pid {pid}) ")
        assert "rows finished before are kept, and a rerun of the shard resumes from them" in message
    finally:
        extractor.close()
        shutil.rmtree(workdir, ignore_errors=True)  # kept after a crash, for its log
    assert group_members(pid) == []

    partial = check_shard(
        store, tset, shard, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16", model=MODEL_NAME,
        last_hidden_state_norm="pre_norm", require_manifest=False,
    )  # fmt: skip
    done = partial.rows_ok
    assert 3 <= done < 24 and not store.exists(manifest_path(shard.key))

    # The rerun, on the long-lived server: rows written before the kill are skipped, not recomputed.
    rerun = shard_settings(server_url=server.url)
    extractor = open_extractor(rerun, target)
    result = extract_shard(store, tset, shard, extractor, rerun.extraction, model_name=MODEL_NAME)
    extractor.close()
    assert (result.rows_skipped, result.rows_computed) == (done, 24 - done)
    report = check_shard(
        store, tset, shard, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16", model=MODEL_NAME,
        last_hidden_state_norm="pre_norm",
    )  # fmt: skip
    assert report.ok and report.rows_ok == 24, report.summary()


def test_max_model_len_is_the_extractor_context(server: LongLivedServer, target: TargetModel):
    vx = VLLMExtractor(target, VllmSettings(server_url=server.url))
    try:
        assert vx.max_context == MAX_MODEL_LEN - 1  # one position for the one generated token
        ok = ExtractionRequest(row=0, input_ids=np.full(MAX_MODEL_LEN - 1, 9, dtype=np.int32))
        assert [s.row for s in vx.extract([ok])] == [0]
    finally:
        vx.close()


def test_the_asset_graph_runs_on_the_vllm_backends(server: LongLivedServer, target: TargetModel, tmp_path: Path):
    """`responses` and a `hidden_states` shard through Dagster with both backends on vLLM: the rest of
    the graph (tokenized, vocab map, the shard's blocking check) does not care which backend ran."""
    from dagster import AssetKey
    from dagster._core.test_utils import instance_for_test

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project

    from .conftest import TINY_DEMO, tiny_settings

    settings = tiny_settings(
        generation=GenerationSettings(backend="vllm", max_new_tokens=8, rows_per_part=16),
        extraction=ExtractionSettings(backend="vllm", progress_interval_s=0.01),
        vllm=VllmSettings(server_url=server.url, max_concurrency=4),
    )
    project = Project(settings, ArtifactStore(tmp_path / "store"))
    # The demo target the `target_model` asset would build, cached: here the model the server serves.
    project.store.put_dir(target.path, DEMO_MODEL_DIR)
    project.store.write_json(DEMO_MODEL_SETTINGS, TINY_DEMO.model_dump())
    job = build_definitions(project).resolve_implicit_global_asset_job_def()

    def run(keys: list[str], partition: str | None = None):
        return job.execute_in_process(
            instance=instance, asset_selection=[AssetKey(k) for k in keys], partition_key=partition,
            raise_on_error=False,
        )  # fmt: skip

    def metadata(key: str) -> dict:
        event = instance.get_latest_materialization_event(AssetKey(key))
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}

    with instance_for_test() as instance:
        assert run(["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]).success
        responses = metadata("responses")
        assert (responses["backend"], responses["rows"], responses["rows_failed"]) == ("vllm", 45, 0)
        result = run(["hidden_states"], "rows_40-45")
        assert result.success
        checks = [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
        assert [(c.event_specific_data.check_name, c.event_specific_data.passed) for c in checks] == [
            ("shard_integrity", True)
        ]
        shard = metadata("hidden_states")
        assert (shard["backend"], shard["rows_computed"]) == ("vllm", 5)
    manifest = project.store.read_json("hidden_states/rows_40-45/_SUCCESS.json")
    assert (manifest["backend"], manifest["last_hidden_state_norm"]) == ("vllm", "pre_norm")
    assert VllmServer(server.url).is_healthy() and request_files(server.storage) == []
