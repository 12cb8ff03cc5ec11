"""CPU servers that share a host: each vLLM CPU engine we start runs on cores of its own.

The registry's rules with real processes and real locks (fast), then two real vLLM CPU
servers started at once through `VllmServer.start`, each serving at a fair share of the
rate it reaches alone (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import pytest
from pydantic import ValidationError

from eagle3_assets.errors import Refusal
from eagle3_assets.settings import VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server import cores
from eagle3_assets.vllm_server.client import http_json
from eagle3_assets.vllm_server.cores import BIND_ENV, CORES_ENV, claim_cores, engine_claim, pin_to_claim
from eagle3_assets.vllm_server.server import VllmServer

from .helpers import vllm_test_settings

ALLOWED = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores this process may use")


@two_cores
def test_engines_started_one_after_another_get_disjoint_cores(tmp_path: Path):
    first = claim_cores(None, registry=tmp_path)  # every free core but one: that one for the next engine
    second = claim_cores(None, registry=tmp_path)  # the one left
    try:
        assert first.cores == tuple(ALLOWED[:-1]) and not first.shared
        assert second.cores == (ALLOWED[-1],) and not second.shared
        assert first.env() == {CORES_ENV: ",".join(map(str, ALLOWED[:-1]))}
        third = claim_cores(None, registry=tmp_path)  # nothing free: the least-claimed core, shared
        assert (third.cores, third.shared) == ((ALLOWED[0],), True)
        assert third.describe() == (
            f"vLLM CPU engine on cores {ALLOWED[0]} (shared with other engines: no core was free; claim {third.path})"
        )
        third.release()
        assert sorted(p.name for p in tmp_path.glob("*.claim")) == sorted([first.path.name, second.path.name])
    finally:
        first.release()
        second.release()
    assert claim_cores(1, registry=tmp_path).cores == (ALLOWED[0],)  # released: free again


@two_cores
def test_the_engines_first_process_pins_itself_and_its_children_to_the_claim(tmp_path: Path):
    claim = claim_cores(1, registry=tmp_path)
    code = (
        "import os, subprocess, sys; from eagle3_assets.vllm_server.cores import pin_to_claim; pin_to_claim(); "
        "print(sorted(os.sched_getaffinity(0)), subprocess.check_output([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'], text=True).strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **claim.env()}, capture_output=True, text=True)
    claim.release()
    assert out.stdout.strip() == f"{[ALLOWED[0]]} {[ALLOWED[0]]}", out.stderr
    pin_to_claim()  # without a claim in the environment: nothing changes
    assert sorted(os.sched_getaffinity(0)) == ALLOWED


def test_drafter_evals_engine_interpreter_pins_itself_before_torch_loads():
    """`python -m eagle3_assets.drafter.vllm_eval` pins itself (`main`) after importing its module: torch loaded before
    the pin ran drafter_eval's passes 2.6x slower on a one-core claim (BENCHMARKS.md `eval engine pinning`)."""
    code = "import sys, eagle3_assets.drafter.vllm_eval; print(sorted({'torch', 'numpy', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


@two_cores
def test_a_claim_lasts_as_long_as_the_process_holding_it(tmp_path: Path):
    claim = claim_cores(1, registry=tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(claim.fd,))
    try:
        os.close(claim.fd)  # the starter is gone; its server's supervisor still holds the claim
        beside = claim_cores(1, registry=tmp_path)
        assert beside.cores == (ALLOWED[1],)
    finally:
        holder.kill()
        holder.wait()
    # Killed outright: the kernel dropped the lock, and the next claimer removes the stale file.
    again = claim_cores(1, registry=tmp_path)
    assert again.cores == (ALLOWED[0],) and not again.shared
    assert not claim.path.exists()
    beside.release()
    again.release()


@pytest.mark.skipif(ALLOWED != list(range(ALLOWED[0], ALLOWED[0] + len(ALLOWED))), reason="cores not contiguous")
def test_too_many_cores_are_refused_naming_the_setting(tmp_path: Path):
    n = len(ALLOWED)
    with pytest.raises(Refusal) as e:
        claim_cores(n + 1, registry=tmp_path)
    cores = f"{ALLOWED[0]}-{ALLOWED[-1]}" if n > 1 else str(ALLOWED[0])
    assert str(e.value) == (
        f"vllm.cpu_cores: {n + 1} cores per vLLM CPU engine, but this process may use only {n} ({cores}); set "
        f"vllm.cpu_cores to at most {n}, or leave it unset to take the free cores"
    )
    with pytest.raises(ValidationError, match="cpu_cores\n  Input should be greater than or equal to 1"):
        VllmSettings(cpu_cores=0)


def test_an_operators_binding_is_left_alone(tmp_path: Path):
    assert engine_claim(None, environ={BIND_ENV: "3-5"}, registry=tmp_path) is None
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- two real servers

WINDOW_S = 5.0  # dozens of 4 x 16-token requests per server even under load: the 0.3x bar is far from noise
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def tokens_per_s(url: str, model: str, until: float) -> float:
    """Greedy completions back to back until `until`; the tokens of those that finished, per second."""
    started, tokens = time.monotonic(), 0
    while time.monotonic() < until:
        body = {"model": model, "prompt": [PROMPT] * 4, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        tokens += int(http_json(f"{url}/v1/completions", body, timeout=300)["usage"]["completion_tokens"])
    return tokens / (time.monotonic() - started)


def load(servers: list[VllmServer]) -> list[float]:
    """Each server's tokens/s while all of `servers` are loaded at once over the same window."""
    models = [s.served_model().model_id for s in servers]
    for s, m in zip(servers, models, strict=True):
        tokens_per_s(s.url, m, 0.0)  # warm: one request each
    until = time.monotonic() + WINDOW_S
    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(lambda s_m: tokens_per_s(s_m[0].url, s_m[1], until), zip(servers, models, strict=True)))


def group_affinities(server: VllmServer) -> set[tuple[int, ...]]:
    """The affinity of every thread of every process of the server (its process group: supervisor, API server, engine
    core with its worker, their OpenMP threads among them)."""
    assert server.process is not None
    group = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == server.process.pid:
            group.append(int(stat.parent.name))
    assert len(group) >= 3, group
    affinities = set()
    for tid in (int(t.name) for pid in group for t in Path(f"/proc/{pid}/task").glob("[0-9]*")):
        with suppress(ProcessLookupError):  # a thread that ended meanwhile
            affinities.add(tuple(sorted(os.sched_getaffinity(tid))))
    return affinities


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
@two_cores
def test_two_cpu_servers_started_at_once_each_get_cores_and_both_make_progress(tiny_target_dir, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    # A registry of their own: under `make test` the other worker's engines claim cores in the host's registry
    # (and rightly share them with these), while this test is about two servers claiming between themselves.
    monkeypatch.setattr(cores, "REGISTRY", tmp_path / "registry")
    target = TargetModel.read(tiny_target_dir, aux_layer_ids=[1, 2, 3])
    with ThreadPoolExecutor(2) as pool:
        # Started at once, as a phase's two servers or two `--serve` commands on one host would be.
        starting = [pool.submit(VllmServer.start, target, vllm_test_settings(), "generate") for _ in range(2)]
        servers = [f.result() for f in starting]
    try:
        # Each on cores of its own, all its processes and threads: vLLM's OpenMP threads and the busy-polling rest.
        claims = [s.cores for s in servers]
        assert sorted(c.cores for c in claims if c) == [tuple(ALLOWED[:-1]), tuple(ALLOWED[-1:])]
        for s in servers:
            assert s.cores is not None and s.log_path is not None
            assert group_affinities(s) == {s.cores.cores}
            assert s.cores.describe() in s.log_path.read_text()  # the log says which cores, and that they are its own
            assert "(its own; claim" in s.cores.describe()
        # Each serving alone (the other one idle), then both at once, twice: every round shows both
        # making progress (with only the OpenMP threads bound apart, one server fell to 1% of its rate).
        rounds = [([load([s])[0] for s in servers], load(servers)) for _ in range(2)]
        print(f"tokens/s (alone, both at once) per round: {rounds}")
        for alone, together in rounds:
            for a, t in zip(alone, together, strict=True):
                assert t >= 0.3 * a, rounds
    finally:
        for s in servers:
            s.stop()
    assert not any(s.cores.path.exists() for s in servers if s.cores)  # claims end with their servers
