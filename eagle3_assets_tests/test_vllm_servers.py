"""Several extraction servers: two long-lived CPU vLLM servers, two shard runs from the CLI at once,
each holding one server for its duration, each row extracted once, straight into the store.

The servers are started with the documented command (`python -m eagle3_assets.vllm_server
--serve --role extract`), the runs with `dagster asset materialize`, as on a node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.defs.shards.server_slots import slot_key
from eagle3_assets.hidden_states.integrity import check_shard
from eagle3_assets.settings import ExtractionSettings, VllmSettings
from eagle3_assets.shards import Shard
from eagle3_assets.tokenized import TokenizedSet

from .helpers import REPO, Operator, kill_group, vllm_test_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]


def start_server(op: Operator, vllm: VllmSettings, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    output = workdir.with_suffix(".out")
    env = op.env
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.vllm_server", "--serve", "--role", "extract",
             "--port", str(vllm.port), "--workdir", str(workdir)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return proc, f"http://{vllm.host}:{vllm.port}", output


def wait_ready(proc: subprocess.Popen, output: Path, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if f"URL={url}" in output.read_text():
            return
        assert proc.poll() is None, output.read_text()[-3000:]
        time.sleep(1)
    raise AssertionError(f"{url} not ready:\n{output.read_text()[-3000:]}")


HOLDER = "held-by-the-test"


def wait_until_both_wait_for_a_server(instance, runs: dict[str, subprocess.Popen], *, deadline: float) -> None:
    """Until each shard run's step has logged that every server is held."""
    while time.monotonic() < deadline:
        waiting = set()
        for record in instance.get_run_records():
            key = record.dagster_run.tags.get("dagster/partition")
            if key in runs and any("vLLM servers are held" in e.message for e in instance.all_logs(record.dagster_run.run_id)):
                waiting.add(key)
        if waiting == set(runs):
            return
        for key, proc in runs.items():
            assert proc.poll() is None, f"{key} ended before waiting for a server:\n{proc.communicate()[0][-4000:]}"
        time.sleep(1)
    raise AssertionError("the shard runs did not both reach the server lease")


def test_two_servers_extract_two_shards_at_once_each_row_once(tmp_path, tiny_target_dir):
    pytest.importorskip("vllm")
    engines = [vllm_test_settings(max_concurrency=4) for _ in range(2)]
    urls = [f"http://{v.host}:{v.port}" for v in engines]
    op = Operator(
        tmp_path, tiny_target_dir,
        extraction=ExtractionSettings(backend="vllm", progress_interval_s=0.01),
        vllm=engines[0].model_copy(update={"server_urls": urls}),
    )  # fmt: skip
    op.data_assets()
    servers = [start_server(op, v, tmp_path / f"server{i}") for i, v in enumerate(engines)]
    try:
        deadline = time.monotonic() + 600
        for proc, url, output in servers:
            wait_ready(proc, output, url, deadline)
        # Both servers held here first, so both runs are in their steps at once whatever the
        # machine's pace (on a loaded machine one run could otherwise finish before the other
        # starts); each then waits, naming the holder, until the servers are handed back.
        with op.instance() as instance:
            storage = instance.event_log_storage
            for url in urls:
                storage.set_concurrency_slots(slot_key(url), 1)
                assert storage.claim_concurrency_slot(slot_key(url), HOLDER, url).is_claimed
            runs = {key: op.materialize("hidden_states", key) for key in ("rows_0-20", "rows_20-40")}
            wait_until_both_wait_for_a_server(instance, runs, deadline=time.monotonic() + 900)
            for url in urls:
                storage.free_concurrency_slot_for_step(HOLDER, url)
        outputs = {key: proc.communicate(timeout=900)[0] for key, proc in runs.items()}
        for key, proc in runs.items():
            assert proc.returncode == 0, outputs[key][-4000:]
    finally:
        for proc, _, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in servers:
            try:
                proc.wait(timeout=120)
            finally:
                kill_group(proc.pid)

    # The pool let both run at once; each extracted through a server once they were free
    # (which one depends on the pace: a run that finishes first hands its server back).
    for key, out in outputs.items():
        assert f"all 2 vLLM servers are held ({{'{urls[0]}': ['{HOLDER}'], '{urls[1]}': ['{HOLDER}']}})" in out, key
        used = re.findall(r"extracting through the vLLM server at (\S+)", out)
        assert len(used) == 1 and used[0] in urls, (key, used)
    with op.instance() as instance:
        records = {r.dagster_run.tags["dagster/partition"]: r for r in instance.get_run_records()
                   if "dagster/partition" in r.dagster_run.tags}  # fmt: skip
        a, b = (records[k] for k in ("rows_0-20", "rows_20-40"))
        assert a.start_time < b.end_time and b.start_time < a.end_time, "the two shard runs did not overlap"
        assert instance.event_log_storage.get_concurrency_info("gpu").slot_count == 2  # the pool follows the servers
        assert all(not instance.event_log_storage.get_concurrency_info(f"vllm-server:{u}").claimed_slots for u in urls)
    tokenized = TokenizedSet.load(op.project.store)
    target = op.project.target()
    for key, out in outputs.items():
        assert "vllm backend wrote each file itself (one write per sample)" in out
        shard = Shard.parse(key)
        report = check_shard(
            op.project.store, tokenized, shard, hidden_size=target.hidden_size, aux_layer_ids=target.aux_layer_ids,
            dtype="bfloat16", last_hidden_state_norm="pre_norm",
        )  # fmt: skip
        assert report.ok and report.rows_ok == 20, report.summary()
        manifest = op.project.store.read_json(f"hidden_states/{key}/_SUCCESS.json")
        assert (manifest["rows_computed"], manifest["rows_skipped"]) == (20, 0)  # every row extracted once
    for _, _, output in servers:  # one model load per server for the phase
        log = (output.parent / output.stem / "server.log").read_text()
        assert log.count("Starting to load model") == 1
    assert os.listdir(tmp_path / "server0" / "hidden_states") == ["eagle3_server.json"]  # nothing left behind
