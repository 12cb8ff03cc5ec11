"""The store on a real S3-compatible server (moto's, on 127.0.0.1, started and stopped here).

memory:// has no listing cache; s3fs caches every directory listing for the life of the process. Each test
here reads from this process, a long-lived one like the daemon, the start command or a trainer waiting for its
next shard, while another process writes: what it wrote or removed must be seen at once (issue 52, item 3).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_assets.crash_points import CRASH_ENV, STALL_ENV, STALLED
from eagle3_assets.provenance import target_files
from eagle3_assets.sample_file import manifest_path, sample_path, shard_dir
from eagle3_assets.shard_window import Window, check_verdict, read_consumed, sample_files
from eagle3_assets.shards import Shard

from eagle3_assets.storage import TMP_MARK, ArtifactStore

KEYS = ["rows_0-2", "rows_2-4", "rows_4-6"]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1, in a thread of this process; stopped (and joined) at the end."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            env.setenv(name, value)
        try:
            yield endpoint
        finally:
            server.stop()
    assert server._thread is not None and not server._thread.is_alive()


@pytest.fixture()
def bucket(s3_endpoint: str) -> str:
    import boto3

    name = f"eagle3-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def in_another_process(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python process with `env` added, as another node or command would."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


WORKER = """
import sys, traceback
scope = {}
for line in sys.stdin:
    try:
        exec(line.encode().decode("unicode_escape"), scope)
        print("ok", flush=True)
    except Exception:
        print(repr(traceback.format_exc()), flush=True)
"""


class OtherProcess:
    """Another process writing to the store (an extractor, a trainer), taking one statement after another: its
    imports are paid once."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, code: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(textwrap.dedent(code).strip().encode("unicode_escape").decode() + "\n")
        self.proc.stdin.flush()
        assert (answer := self.proc.stdout.readline().strip()) == "ok", answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture()
def other() -> Iterator[OtherProcess]:
    worker = OtherProcess()
    try:
        yield worker
    finally:
        worker.close()


def wait_until_blocked_on_a_lock(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until /proc/locks lists `proc` as waiting for a lock (its `->` lines are the waiters)."""
    deadline = time.monotonic() + timeout_s
    while not any(line.split()[5] == str(proc.pid) for line in Path("/proc/locks").read_text().splitlines() if "->" in line):
        assert proc.poll() is None and time.monotonic() < deadline, f"{proc.args[-1]} never waited for the lock"
        time.sleep(0.05)


def test_a_long_lived_store_sees_what_another_process_writes_and_removes(bucket: str, other: OtherProcess):
    url = f"s3://{bucket}/root"
    store = ArtifactStore(url)
    store.write_json("drafter/window/rows_0-2.json", {"n": 1})
    assert store.listdir("drafter/window") == ["rows_0-2.json"] and not store.exists("drafter/window/rows_2-4.json")
    other.run(f"""
        from eagle3_assets.storage import ArtifactStore
        store = ArtifactStore({url!r})
        store.write_json("drafter/window/rows_2-4.json", {{"n": 2}})
        store.write_text("drafter/window/rows_0-2.json", "0123456789")
    """)
    assert store.listdir("drafter/window") == ["rows_0-2.json", "rows_2-4.json"]
    assert store.exists("drafter/window/rows_2-4.json") and store.read_json("drafter/window/rows_2-4.json") == {"n": 2}
    assert store.sizes("drafter/window") == {"rows_0-2.json": 10, "rows_2-4.json": 13}
    assert store.size("drafter/window/rows_0-2.json") == 10
    other.run('store.remove("drafter/window/rows_0-2.json")')
    assert store.listdir("drafter/window") == ["rows_2-4.json"] and not store.exists("drafter/window/rows_0-2.json")


def test_a_promotion_killed_after_its_intent_is_settled_by_the_long_lived_process(bucket: str, tmp_path: Path):
    url = f"s3://{bucket}/root"
    store = ArtifactStore(url)
    old, new = tmp_path / "old", tmp_path / "new"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "model.safetensors").write_text(text)
    store.put_dir(old, "drafter/release")
    assert store.listdir("drafter") == ["release"]  # what the long-lived process last saw of drafter/
    killed = in_another_process(
        f"""
        from eagle3_assets.storage import ArtifactStore
        ArtifactStore({url!r}).put_dir({str(new)!r}, "drafter/release")
        """,
        env={CRASH_ENV: "put_dir:drafter/release:intent"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert store.settle("drafter/release") is True
    assert store.read_text("drafter/release/model.safetensors") == "new"
    hidden = [p for p in store.fs.ls(store.path("drafter"), detail=False) if p.rsplit("/", 1)[-1].startswith(".")]
    assert store.listdir("drafter") == ["release"] and hidden == []


def test_a_rolling_pass_seen_from_the_long_lived_process_moves_on_as_shards_land_and_are_released(
    bucket: str, other: OtherProcess
):
    """The daemon's view of the window (what it admits for extraction) and a trainer's view of the next shard
    (its check), while an extractor and a trainer in other processes work on the shards."""
    url = f"s3://{bucket}/root"
    store = ArtifactStore(url)

    def extract(key: str, check: bool) -> str:
        samples = [sample_path(key, row) for row in Shard.parse(key).rows]
        checked = f"write_check_record(store, {key!r}, passed=True, problems=0)" if check else ""
        return f"""
            for rel in {samples!r}:
                store.write_bytes(rel, b"x" * 10)
            store.write_json({manifest_path(key)!r}, {{"shard": {key!r}}})
            {checked}
        """

    def consume(key: str, step: int) -> str:
        return f"release(store, record_consumed(store, {key!r}, step={step}, checkpoint='drafter/checkpoints/step_{step}'))"

    other.run(f"""
        from eagle3_assets.storage import ArtifactStore
        from eagle3_assets.shard_window import record_consumed, release, write_check_record
        store = ArtifactStore({url!r})
    """)
    other.run(extract(KEYS[0], check=False))
    assert check_verdict(store, KEYS[0]) == "unchecked"
    assert sample_files(store, KEYS[0]) == [f"{shard_dir(KEYS[0])}/0.safetensors", f"{shard_dir(KEYS[0])}/1.safetensors"]
    assert Window.read(store, KEYS, 1).admitted() == [KEYS[0]]
    other.run(f"write_check_record(store, {KEYS[0]!r}, passed=True, problems=0)")
    assert check_verdict(store, KEYS[0]) == "passed"  # the trainer waiting for it starts on it
    other.run(consume(KEYS[0], 3))
    assert sample_files(store, KEYS[0]) == [] and read_consumed(store)[KEYS[0]].released
    assert Window.read(store, KEYS, 1).admitted() == [KEYS[1]]  # the daemon extracts the next one
    other.run(extract(KEYS[1], check=True))
    other.run(consume(KEYS[1], 6))
    assert Window.read(store, KEYS, 1).admitted() == [KEYS[2]]
    assert sorted(read_consumed(store)) == KEYS[:2]


def test_ranks_copying_a_remote_target_at_once_copy_it_once_without_original_and_sweep_a_dead_copy(
    bucket: str, tmp_path: Path, tiny_target_dir: Path
):
    """Ranks of one node load an s3:// target at once: the copy is made under a lock; a copier killed mid-copy
    leaves a temporary copy the next one removes; `original/` (not part of the identity) is not copied."""
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    (model / "original").mkdir()
    (model / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    remote = ArtifactStore(f"s3://{bucket}/targets")
    remote.put_dir(model, "model")
    code = f"""
        from eagle3_assets.project import _local_copy
        from eagle3_assets.storage import ArtifactStore
        print(_local_copy(ArtifactStore({remote.url!r}, cache_dir={str(tmp_path / "cache")!r}), "model"))
    """
    env = {**os.environ, **{STALL_ENV: "local_copy:model:copied"}}
    first = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stderr=subprocess.PIPE, text=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert first.stderr is not None
        line = first.stderr.readline()
        while line and STALLED not in line:
            line = first.stderr.readline()
        assert STALLED in line, "the first copier never reached the end of its copy"
        # It holds the lock with its whole copy made: the second waits, then finds that copy dead and removed.
        second = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        wait_until_blocked_on_a_lock(second)
        first.kill()
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
    finally:
        first.kill()
        first.wait()
    copy = Path(out.strip())
    held = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert held == sorted(target_files(str(tiny_target_dir)))  # what the model is made of, no more
    assert not (copy / "original").exists()
    assert [p.name for p in copy.parent.iterdir() if TMP_MARK in p.name] == []
