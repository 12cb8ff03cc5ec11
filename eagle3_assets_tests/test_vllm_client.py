"""The vLLM backends' client side, without a vLLM server (fast): the `vllm serve` flags per role,
splitting a server's file into our sample, waiting for a file still being written, errors that
name the server, the port check, and the supervisor that stops an orphaned server.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle3_assets.demo.tokenizer import train_tokenizer
from eagle3_assets.generation import open_generator
from eagle3_assets.hidden_states import open_extractor
from eagle3_assets.hidden_states.vllm_extractor import VllmExtractionError, split_hidden_states
from eagle3_assets.processes import group_members
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.settings import ExtractionSettings, GenerationSettings, Settings, VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.client import (
    RequestRejectedError,
    ServerUnreachableError,
    VllmServerError,
    free_port,
    http_json,
)
from eagle3_assets.vllm_server.command import serve_args
from eagle3_assets.vllm_server.protocol import ServerPlan
from eagle3_assets.vllm_server.protocol import (
    SampleParams,
    lock_path,
    mask_from_spans,
    mask_spans,
    raw_hidden_states_file,
)
from eagle3_assets.vllm_server.server import VllmServer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the client side reads of a target: its config and its tokenizer (no weights needed)."""
    path = tmp_path_factory.mktemp("client-target")
    config = LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32)
    config.save_pretrained(path)
    train_tokenizer(["What does Kamivel eat? It eats plums."] * 20, 320).save_pretrained(path)
    return path


def kimi(aux: list[int] = [2, 30, 58], *, remote_code: bool = False) -> TargetModel:  # noqa: B006
    config = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64}
    return TargetModel.from_config(config, path="/models/kimi", aux_layer_ids=tuple(aux), trust_remote_code=remote_code)


def test_serve_args_per_role():
    vllm = VllmSettings(
        tensor_parallel_size=8, dtype="bfloat16", max_model_len=32768, gpu_memory_utilization=0.92,
        extra_args=["--enable-prefix-caching"],
    )  # fmt: skip
    common = [
        "/models/kimi", "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "8", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.92", "--disable-uvicorn-access-log", "--trust-remote-code",
        "--max-model-len", "32768",
    ]  # fmt: skip
    target = kimi(remote_code=True)
    gen = serve_args(target, vllm, ServerPlan.for_target(target, "generate"), host="0.0.0.0", port=8000)
    assert gen == [*common, "--enable-prefix-caching"]
    plan = ServerPlan.for_target(target, "extract")
    assert (plan.layer_ids, plan.aux_layer_ids) == ([2, 30, 58, 61], [2, 30, 58])  # aux ids + layer N, sorted
    ext = serve_args(target, vllm, plan, host="0.0.0.0", port=8000, storage_dir="/nvme/hs", write_roots=["/data/eagle3"])
    assert ext[: len(common)] == common and ext[-1] == "--enable-prefix-caching"
    spec = json.loads(ext[ext.index("--speculative-config") + 1])
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}},
    }
    kv = json.loads(ext[ext.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "SampleFileConnector",
        "kv_connector_module_path": "eagle3_assets.vllm_server.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": "/nvme/hs", "allow_custom_save_path": True, "write_roots": ["/data/eagle3"],
        },
    }  # fmt: skip
    assert "--trust-remote-code" not in serve_args(kimi(), vllm, ServerPlan.for_target(kimi(), "generate"), host="h", port=1)
    # Kimi-K2.5 as it ships: the text model inside a vision-language wrapper, served text-only.
    k25 = TargetModel.from_config({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": kimi().config,
                                   "vision_config": {}}, path="/models/kimi-k2.5", aux_layer_ids=(2, 30, 58))  # fmt: skip
    assert k25.wrapped and not target.wrapped
    # An MLA target on the CPU build: the native rotary, vLLM's CPU kernel mis-rotating MLA's multi-head query.
    mla = TargetModel.from_config({**kimi().config, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, path="/models/k2")
    mla_args = serve_args(mla, vllm, ServerPlan.for_target(mla, "generate"), host="h", port=1)
    assert json.loads(mla_args[mla_args.index("--compilation-config") + 1]) == {"custom_ops": ["-rotary_embedding"]}
    assert "--compilation-config" not in gen
    assert serve_args(k25, vllm, ServerPlan.for_target(k25, "generate"), host="0.0.0.0", port=8000) == [
        "/models/kimi-k2.5", *common[1:-3], "--language-model-only", "--max-model-len", "32768", "--enable-prefix-caching"
    ]
    with pytest.raises(ValueError, match="an extraction server needs a storage directory"):
        serve_args(target, vllm, plan, host="h", port=1)


def test_sample_parameters_travel_with_the_request_and_come_back_equal():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1], dtype=np.uint8)
    assert mask_spans(mask) == [[2, 5], [6, 8]] and mask_from_spans([[2, 5], [6, 8]], 8).tolist() == mask.tolist()
    assert mask_spans(np.zeros(3, np.uint8)) == [] and mask_spans(np.ones(3, np.uint8)) == [[0, 3]]
    spec = SampleSpec(7168, (2, 30, 58), "float8_e4m3fn", "kimi", "pre_norm")
    params = SampleParams("/data/eagle3/hidden_states/rows_0-2000/17.safetensors", 17, mask_spans(mask), spec)
    wire = json.loads(json.dumps(params.to_kv_transfer_params()))
    assert wire["hidden_states_path"] == params.path
    assert SampleParams.from_kv_transfer_params(wire) == params
    assert SampleParams.from_kv_transfer_params({"hidden_states_path": "/x"}) is None  # a raw-file request
    assert lock_path(params.path) == "/data/eagle3/hidden_states/rows_0-2000/.17.safetensors.tmp-lock"


def server_file(T: int, H: int, ids: list[int]) -> dict[str, torch.Tensor]:
    # Layer l of token t holds 1000*l + t everywhere: every value says where it came from.
    layer = torch.arange(4).view(1, 4, 1) * 1000.0
    token = torch.arange(T).view(T, 1, 1).float()
    return {"hidden_states": (layer + token).expand(T, 4, H).contiguous(), "token_ids": torch.tensor(ids)}


def split(tensors, ids, hidden_size: int = 2):
    config = {"num_hidden_layers": 4, "hidden_size": hidden_size, "vocab_size": 16, "num_attention_heads": 1}
    target = TargetModel.from_config(config, path="/m", aux_layer_ids=(1, 2, 3))
    return split_hidden_states(
        tensors, row=7, input_ids=np.array(ids, dtype=np.int32), target=target, where="the vLLM server at http://h:1"
    )


def test_a_server_file_splits_into_aux_and_last_states():
    aux, last = split(server_file(3, 2, [5, 6, 7]), [5, 6, 7])
    # aux = layers 1, 2, 3 side by side (file positions 0, 1, 2); last = layer 4 (position 3)
    assert aux.tolist() == [
        [0, 0, 1000, 1000, 2000, 2000],
        [1, 1, 1001, 1001, 2001, 2001],
        [2, 2, 1002, 1002, 2002, 2002],
    ]
    assert last.tolist() == [[3000, 3000], [3001, 3001], [3002, 3002]]


def test_a_server_file_for_other_tokens_is_refused():
    with pytest.raises(VllmExtractionError) as e:
        split(server_file(3, 2, [5, 9, 7]), [5, 6, 7])
    assert str(e.value) == (
        "row 7: the vLLM server at http://h:1 ran other tokens than the row "
        "(1 of 3 token ids differ, first at position 1)"
    )
    with pytest.raises(VllmExtractionError) as e:
        split(server_file(2, 2, [5, 6]), [5, 6, 7])
    assert str(e.value) == (
        "row 7: the vLLM server at http://h:1 ran other tokens than the row (2 token ids for a row of 3)"
    )
    with pytest.raises(VllmExtractionError) as e:
        split(server_file(3, 2, [5, 6, 7]), [5, 6, 7], hidden_size=4)
    assert str(e.value) == (
        "row 7: hidden_states from the vLLM server at http://h:1 has shape [3, 4, 2], expected [3, 4, 4] "
        "(layers [1, 2, 3, 4], hidden 4)"
    )
    with pytest.raises(VllmExtractionError, match=r"holds \['hidden_states'\], expected hidden_states and token_ids"):
        split({"hidden_states": torch.zeros(3, 4, 2)}, [5, 6, 7])


def test_a_file_still_being_written_is_read_once_complete_then_removed(tmp_path: Path):
    path = tmp_path / "req-1.safetensors"
    lock = Path(lock_path(path))
    # As the stock GPU connector does: the lock is held before the client gets the path.
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def writer() -> None:
        time.sleep(0.3)
        save_file(server_file(3, 2, [5, 6, 7]), str(path))
        os.close(fd)  # releases the lock

    t = threading.Thread(target=writer)
    t.start()
    with raw_hidden_states_file(str(path)) as p:
        tensors = load_file(str(p))
    t.join()
    assert tensors["token_ids"].tolist() == [5, 6, 7] and tensors["hidden_states"].shape == (3, 4, 2)
    assert sorted(os.listdir(tmp_path)) == []  # the server never deletes its files: the reader does


def test_an_unreachable_server_url_is_named(model_dir: Path):
    url = f"http://127.0.0.1:{free_port()}"
    settings = Settings(
        aux_layer_ids=[1, 2, 3], extraction=ExtractionSettings(backend="vllm"), vllm=VllmSettings(server_url=url)
    )
    expected = (
        f"vllm.server_url: the vLLM server at {url} is not answering /health; start it "
        "(python -m eagle3_assets.vllm_server --serve --role extract|generate) or unset vllm.server_url to let "
        "each run start its own"
    )
    target = TargetModel.read(model_dir, aux_layer_ids=[1, 2, 3])
    with pytest.raises(VllmServerError) as e:
        open_extractor(settings, target)
    assert str(e.value) == expected
    with pytest.raises(VllmServerError) as e:
        open_generator(target, GenerationSettings(backend="vllm"), settings.vllm)
    assert str(e.value) == expected
    with pytest.raises(ServerUnreachableError, match=rf"^{url}/v1/models: no answer \("):
        http_json(f"{url}/v1/models", timeout=5)


def test_a_busy_port_is_refused_before_anything_starts(model_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(VllmServerError) as e:
            VllmServer.start(TargetModel.read(model_dir, aux_layer_ids=[1, 2, 3]), VllmSettings(port=port), "generate")
    url = f"http://127.0.0.1:{port}"
    assert str(e.value) == (
        f"cannot start a vLLM server at {url}: the port is already in use (another server? set vllm.server_url "
        f"to {url} to reuse it, or choose another vllm.port)"
    )


def test_an_http_error_keeps_the_servers_message():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.dumps({"error": {"message": "Token id 999 is out of vocabulary", "code": 400}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{httpd.server_port}/v1/completions"
    try:
        with pytest.raises(RequestRejectedError) as e:
            http_json(url, {"prompt": [999]}, timeout=5)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (e.value.status, e.value.message, str(e.value)) == (
        400, "Token id 999 is out of vocabulary", f"{url}: HTTP 400: Token id 999 is out of vocabulary",
    )  # fmt: skip


def test_a_request_a_healthy_server_never_answers_fails_its_row_alone(model_dir: Path):
    """Issue 52, item 4: a request that always times out failed the whole `responses` run, every time. On a server
    that still answers /health, it fails its own row (retried up to `generation.max_row_attempts` times); the
    other rows are generated."""
    from eagle3_assets.generation.vllm import VLLMGenerator

    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self.answer({})
            else:
                self.answer({"data": [{"id": "target", "max_model_len": 64}]})

        def do_POST(self):  # noqa: N802
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            if prompt == [7, 7]:
                release.wait()  # never within the request's timeout
                return
            self.answer({"choices": [{"finish_reason": "stop", "token_ids": [5]}]})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    target = TargetModel.read(model_dir, aux_layer_ids=[1, 2, 3])
    try:
        gen = VLLMGenerator(target, GenerationSettings(backend="vllm"), VllmSettings(), server=VllmServer(url),
                            request_timeout_s=0.5)  # fmt: skip
        out = gen.generate([[1, 2], [7, 7], [3]])
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()
    assert [(g.completion_token_ids, g.finish_reason) for g in out] == [([5], "stop"), ([], "error"), ([5], "stop")]
    assert out[1].error is not None and out[1].error.startswith(
        f"no answer from the vLLM server at {url}, which is healthy, within the request timeout of 0.5 s "
        f"({url}/v1/completions: no answer ("
    )


def test_a_reused_server_is_never_stopped():
    server = VllmServer("http://127.0.0.1:1/")
    assert (server.url, server.owned, server.log_path, server.storage_dir) == ("http://127.0.0.1:1", False, None, None)
    server.stop()  # nothing to do: not ours
    with pytest.raises(VllmServerError) as e:
        server.model_loads()
    assert str(e.value) == "no log of the vLLM server at http://127.0.0.1:1: it was not started here"


def test_the_supervisor_stops_the_server_when_its_starter_dies(tmp_path: Path):
    """A run killed without closing its backend must not leave a server behind, even when
    the run ignores SIGTERM (inherited through exec, it once made the server deaf to it)."""
    starter = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-m', 'eagle3_assets.vllm_server', '--supervise', str(os.getpid()),"
        " '--', 'sleep', '300'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", starter], cwd=REPO, stdout=subprocess.PIPE, text=True)
    group = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while len(group_members(group)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(group_members(group)) == 2  # supervisor + "server"
        proc.send_signal(signal.SIGKILL)  # the run dies without stopping anything
        proc.wait()
        deadline = time.monotonic() + 30
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(group) == []
    finally:
        proc.kill()
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_cpu_server_that_cannot_reserve_its_kv_cache_names_the_setting(tmp_path):
    from eagle3_assets.vllm_server.server import memory_hint

    # This vLLM's CPU worker logs the cause, then ~150 lines of engine teardown (issue 34).
    cause = (
        "ValueError: Available memory on node 0 (3.12/23.54 GiB) on kv cache allocation is less than requested memory "
        "for kv (4.00 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by "
        "other processes."
    )
    teardown = [f"(EngineCore_DP0 pid=4242) ERROR   File \"/vllm/v1/engine/core.py\", line {n}, in run" for n in range(149)]
    log = tmp_path / "server.log"
    log.write_text("\n".join(["INFO loading", cause, *teardown, "RuntimeError: Engine core initialization failed."]))
    assert memory_hint(log) == (
        ": the CPU build could not reserve its KV cache (by default most of the machine's RAM); "
        "set vllm.cpu_kv_cache_gib (e.g. 4) to bound it"
    )
    # The older build's wording, at startup.
    log.write_text(
        "ValueError: Available memory on node 0 (15.58/23.54 GiB) on startup is less than desired CPU memory "
        "utilization (0.9, 21.19 GiB).\n"
    )
    assert memory_hint(log).startswith(": the CPU build could not reserve its KV cache")
    log.write_text("INFO VLLM_CPU_KVCACHE_SPACE not set, using the default\nOSError: model not found\n")
    assert memory_hint(log) == "" and memory_hint(None) == ""
