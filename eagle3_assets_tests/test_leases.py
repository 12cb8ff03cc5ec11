"""One owner per artifact: the lease in the store, taken by one process at a time, and a holder that
lost it writing nothing more."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eagle3_assets.leases import Lease, LeaseHeld, LeaseLost
from eagle3_assets.storage import ArtifactStore

from .helpers import REPO, Operator

FAST = dict(expiry_s=2.0, heartbeat_s=0.5, settle_s=0.2)

HOLDER = textwrap.dedent(
    """
    import sys, time
    from eagle3_assets.leases import Lease
    from eagle3_assets.storage import ArtifactStore
    store = ArtifactStore(sys.argv[1])
    lease = Lease(store, "drafter", "run-a", expiry_s=2.0, heartbeat_s=0.5, settle_s=0.2).acquire()
    owned = store.guarded(lease.check)
    print("held", flush=True)
    i = 0
    while True:
        owned.write_text(f"drafter/ticks/{i:06d}", "a")
        i += 1
        time.sleep(0.05)
    """
)


def test_one_holder_at_a_time_and_a_dead_holder_is_taken_over_at_once(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    with Lease(store, "drafter", "run-a", **FAST) as first:
        with pytest.raises(LeaseHeld, match=r"/store/drafter is held by another process \(host .*, pid "
                           rf"{os.getpid()}, run run-a, since .* UTC; renewed 0s ago\): stop that one, or wait 2s"):
            Lease(store, "drafter", "run-b", **FAST).acquire()
        time.sleep(1.2)  # heartbeats keep it
        first.check()
        assert store.read_json("drafter/_LEASE.json")["renewed"] > first.me.since
    assert not store.exists("drafter/_LEASE.json")
    # A holder of this machine whose process is gone (a SIGKILL): no expiry to wait out.
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    gone = next(pid for pid in range(pid_max - 1, 1, -1) if not os.path.exists(f"/proc/{pid}"))
    now = time.time()
    left = Lease(store, "drafter", "run-dead", expiry_s=600, heartbeat_s=10)
    store.write_json("drafter/_LEASE.json", {**left.me.__dict__, "pid": gone, "since": now, "renewed": now})
    with Lease(store, "drafter", "run-c", **FAST):
        assert store.read_json("drafter/_LEASE.json")["run_id"] == "run-c"


@pytest.mark.slow  # starts a process
def test_a_holder_frozen_past_the_expiry_is_taken_over_and_writes_nothing_after_waking(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "store")], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        time.sleep(0.5)
        with pytest.raises(LeaseHeld) as held:  # while it lives, nobody else
            Lease(store, "drafter", "run-b", **FAST).acquire()
        assert f"is held by another process (host {os.uname().nodename}, pid {holder.pid}, run run-a, since " in str(held.value)
        os.kill(holder.pid, signal.SIGSTOP)
        before = set(store.listdir("drafter/ticks"))
        time.sleep(2.5)  # past the expiry
        taker = Lease(store, "drafter", "run-b", **FAST).acquire()
        os.kill(holder.pid, signal.SIGCONT)
        out = holder.communicate(timeout=30)[0]
    finally:
        holder.kill()
    assert holder.returncode == 1
    assert "lost its lease: its last renewal was " in out and "it writes nothing more" in out
    # At most the one write that was past its check when the holder froze; nothing it began after waking.
    assert len(set(store.listdir("drafter/ticks")) - before) <= 1
    taker.check(read=True)  # a renewal the holder had in flight when it froze may have landed since: taken back
    assert store.read_json("drafter/_LEASE.json")["run_id"] == "run-b"
    taker.release()
    assert not store.exists("drafter/_LEASE.json")


def test_a_renewal_in_flight_when_the_holder_froze_lands_after_the_takeover_and_is_taken_back(tmp_path, capsys):
    store = ArtifactStore(tmp_path / "store")
    frozen = Lease(store, "drafter", "run-a", **FAST)
    stale = {**frozen.me.__dict__, "renewed": time.time() - 3.0}  # built before it froze, 3s ago: past the expiry
    store.write_json("drafter/_LEASE.json", stale)
    taker = Lease(store, "drafter", "run-b", **FAST).acquire()
    try:
        store.write_json("drafter/_LEASE.json", stale)  # the frozen holder's write lands now
        taker.check(read=True)
        assert store.read_json("drafter/_LEASE.json")["run_id"] == "run-b"
        assert "a renewal of host " in capsys.readouterr().err
        # The same holder's lease, but fresh: it may still be writing, so the taker has lost.
        store.write_json("drafter/_LEASE.json", {**stale, "renewed": time.time()})
        with pytest.raises(LeaseLost, match=r"lost its lease: taken over by host .*, run run-a, since .*; it writes nothing more"):
            taker.check(read=True)
    finally:
        taker.release()
    assert store.read_json("drafter/_LEASE.json")["run_id"] == "run-a"  # a lost holder removes nothing


@pytest.mark.slow  # the tiny graph, then two trainers at once
def test_two_trainers_on_one_drafter_directory_one_trains_the_other_refuses_naming_it(tmp_path, tiny_target_dir):
    op = Operator(tmp_path, tiny_target_dir)
    assert op.start("--through", "hidden_states").returncode == 0
    # Two launchers that share only the store: plain `python -m eagle3_assets.drafter`, two run ids.
    trainers = [
        subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.drafter"], cwd=REPO, env={**op.env, "EAGLE3_RUN_ID": run},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for run in ("run-one", "run-two")
    ]
    outs = [t.communicate(timeout=600)[0] for t in trainers]
    codes = sorted(t.returncode for t in trainers)
    assert codes == [0, 3], outs  # 3: refused, never retried
    winner, loser = (0, 1) if trainers[0].returncode == 0 else (1, 0)
    assert (
        f"is held by another process (host {os.uname().nodename}, pid {trainers[winner].pid}, "
        f"run run-{('one', 'two')[winner]}, since "
    ) in outs[loser]
    assert "drafter: exported to " in outs[winner]
    assert not op.project.store.exists("drafter/_LEASE.json")  # released at the end


@pytest.mark.slow  # two start commands
def test_two_start_commands_on_one_store_the_second_refuses_naming_the_first(tmp_path, tiny_target_dir):
    from .helpers import kill_group, wait_until_stalled

    op = Operator(tmp_path, tiny_target_dir)
    both = [op.spawn("--through", "hidden_states", stall_at="extracted:rows_0-20:1") for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in both) and time.monotonic() < deadline:
            time.sleep(0.2)
        (refused,) = [p for p in both if p.poll() is not None]
        assert refused.returncode == 1
        first = both[1 - both.index(refused)]
        out = refused.communicate()[0]
        assert (
            f"error: file://{op.root}/start is held by another process (host {os.uname().nodename}, pid {first.pid}, "
            "run python -m eagle3_assets.start, since "
        ) in out
        assert "[start] prompts" not in out  # it did nothing
        wait_until_stalled(first, "extracted:rows_0-20:1")
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
        assert first.returncode == 128 + signal.SIGTERM
    finally:
        for p in both:
            kill_group(p.pid)
    assert not op.project.store.exists("start/_LEASE.json")  # released on the way out


@pytest.mark.slow  # a start command
def test_a_start_command_refused_by_the_lease_leaves_a_fresh_dagster_home_untouched(tmp_path, tiny_target_dir):
    """The lease comes before anything opens $DAGSTER_HOME: two commands creating a fresh instance's tables at once
    corrupt them (alembic: "more than one head"), which is what a second command racing the first did when it
    loaded the definitions, and their pool check opened the instance, before it asked for the lease."""
    from eagle3_assets.start import START_LEASE_DIR

    op = Operator(tmp_path, tiny_target_dir)
    with Lease(op.project.store, START_LEASE_DIR, "held by the test", **FAST):
        refused = op.start("--through", "hidden_states")
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert f"error: file://{op.root}/start is held by another process (host {os.uname().nodename}, pid {os.getpid()}, " in refused.stderr
    assert sorted(p.name for p in op.home.iterdir()) == ["dagster.yaml"]  # no instance opened, no table made


@pytest.mark.slow  # the tiny data assets, then three extraction processes
def test_two_extractions_of_one_shard_one_extracts_the_other_refuses_naming_it(tmp_path, tiny_target_dir):
    """Two instances (two nodes' $DAGSTER_HOMEs) sharing one store: the `gpu` pool orders only one instance's runs."""
    import shutil

    from dagster import DagsterInstance

    from eagle3_assets.defs.partitions import registered_shard_keys, shard_partitions

    from .helpers import kill_group, wait_until_stalled

    op = Operator(tmp_path, tiny_target_dir)
    op.data_assets()
    other = tmp_path / "other-home"
    other.mkdir()
    shutil.copy(op.home / "dagster.yaml", other / "dagster.yaml")
    with op.instance() as instance, DagsterInstance.from_config(str(other)) as second:
        second.add_dynamic_partitions(shard_partitions.name, registered_shard_keys(instance))
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "eagle3_assets.definitions",
           "--select", "hidden_states", "--partition", "rows_0-20"]  # fmt: skip
    env = {**op.env, "DAGSTER_HOME": str(other)}
    store, lease = op.project.store, "hidden_states/_leases/rows_0-20/_LEASE.json"

    first = op.spawn("--shard", "rows_0-20", stall_at="extracted:rows_0-20:1")
    try:
        wait_until_stalled(first, "extracted:rows_0-20:1")
        holder = store.read_json(lease)
        samples = sorted(store.listdir("hidden_states/rows_0-20"))
        refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0
        assert (
            f"shard rows_0-20: file://{op.root}/hidden_states/_leases/rows_0-20 is held by another process "
            f"(host {os.uname().nodename}, pid {holder['pid']}, run {holder['run_id']}, since "
        ) in refused.stdout + refused.stderr
        with DagsterInstance.from_config(str(other)) as second:
            (run,) = second.get_runs()
            assert run.tags["dagster/will_retry"] == "false"  # a refusal: never retried
        with op.instance() as instance:
            assert instance.get_run_by_id(holder["run_id"]).tags["dagster/partition"] == "rows_0-20"
        assert sorted(store.listdir("hidden_states/rows_0-20")) == samples  # it wrote nothing
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        kill_group(first.pid)
    assert not store.exists(lease)  # released on the way out
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert store.exists("hidden_states/rows_0-20/_SUCCESS.json") and not store.exists(lease)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_start_lease_settles_ends_cleanly_and_leaves_no_lease_file(tmp_path, tiny_target_dir, sig):
    """Issue 44, item 7: the lease file is written, then the command waits a moment to see it stays its own. A signal
    there (the command held at that point) ends the command as any stop does (128 + the signal, the line that
    resumes), and the file goes with it."""
    from .helpers import kill_group, wait_until_stalled

    op = Operator(tmp_path, tiny_target_dir)
    lease_file = op.root / "start" / "_LEASE.json"
    proc = op.spawn("--through", "hidden_states", stall_at="lease:start/_LEASE.json:settling")
    try:
        wait_until_stalled(proc, "lease:start/_LEASE.json:settling")
        assert lease_file.exists()
        os.kill(proc.pid, sig)
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out and f"[start] stopped by {sig.name}: nothing more was launched" in out
    assert not lease_file.exists()


def test_a_lease_that_cannot_be_released_does_not_hide_the_stop_that_left_it(tmp_path, capsys):
    from eagle3_assets.stopping import Stopped

    store = ArtifactStore(tmp_path)
    lease = Lease(store, "drafter", "run-a", **FAST)
    with pytest.raises(Stopped):
        with lease:
            def broken(rel: str, *, recursive: bool = False) -> None:
                raise OSError(5, "Input/output error", rel)

            store.remove = broken  # the store stops answering as the stop leaves
            raise Stopped(signal.SIGTERM)
    assert capsys.readouterr().err == (
        f"lease {store.url_of('drafter')}: not released ([Errno 5] Input/output error: 'drafter/_LEASE.json'); it expires "
        "2s after its last renewal\n"
    )


def test_a_live_holder_in_another_pid_namespace_of_the_same_host_is_not_taken_for_dead(tmp_path):
    """Issue 44, item 3: containers with host networking share the host name and the boot but not the pids. The probe
    took such a live lease in 2 s: its holder's pid meant another process here. It now waits out the expiry."""
    import shlex
    import shutil
    from pathlib import Path

    from eagle3_assets.leases import LeaseHeld

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"]).returncode:
        pytest.fail("this test needs `unshare --pid` (util-linux, and the right to make a pid namespace)")
    # Inside, the holder runs as pid 100000, which no process of this namespace has: it looks dead from here.
    inner = f"echo 99999 > /proc/sys/kernel/ns_last_pid && {shlex.join([sys.executable, '-c', HOLDER, str(tmp_path)])}"
    assert not Path("/proc/100000").exists()
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", inner],
        stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=r"is held by another process \(host .*, pid \d+, run run-a"):
            Lease(ArtifactStore(tmp_path), "drafter", "run-b", **FAST).acquire()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)


def test_a_start_command_that_lost_its_lease_launches_nothing_more(tmp_path):
    """Issue 44, item 3: paused past the expiry (SIGSTOP, a frozen VM), the command another took over from must not
    launch beside it. It asks its lease before every launch; taken over, it stops naming the new holder."""
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.leases import LeaseLost
    from eagle3_assets.project import Project
    from eagle3_assets.start import START_LEASE_DIR, GraphStart

    from .conftest import tiny_settings
    from .helpers import gpu_instance

    store = ArtifactStore(tmp_path / "root")
    # A long expiry of its own: under load, building the definitions outlasts FAST's 2 s, and the command would then
    # stop on its own stale renewal before it ever read the lease (also lost, but not what this test shows).
    mine = Lease(store, START_LEASE_DIR, "this command", **(FAST | {"expiry_s": 600.0})).acquire()
    mine.release()  # stands for a heartbeat that stopped while the command was frozen
    taker = Lease(store, START_LEASE_DIR, "the command that took over", **FAST).acquire()
    try:
        with gpu_instance() as instance:
            start = GraphStart(
                instance, Project(tiny_settings(), store), build=build_definitions, owned=mine.check, log=lambda _: None
            )
            with pytest.raises(LeaseLost, match=r"lost its lease: taken over by host .*run the command that took over"):
                start.run()
            assert instance.get_runs() == []  # nothing launched
    finally:
        taker.release()


# --- one settler (issue 52, item 2): on an object store, and on a local disk without RENAME_EXCHANGE ------------------

QUICK = dict(expiry_s=1.0, heartbeat_s=0.25, settle_s=0.1)
RELEASE, PROMOTION = "drafter/release", "drafter/promotion"


def _replacing_store(tmp_path, monkeypatch, where: str) -> ArtifactStore:
    """A store where a directory is replaced through its intent: memory://, or a local disk without the exchange."""
    import uuid

    from eagle3_assets import storage

    if where == "memory":
        return ArtifactStore(f"memory://settle-{uuid.uuid4().hex[:8]}")
    monkeypatch.setattr(storage, "exchange", lambda a, b: False)  # as on NFS, Lustre, some FUSE mounts
    return ArtifactStore(tmp_path / "root")


@pytest.mark.parametrize("where", ["memory", "local-no-exchange"])
def test_a_promoter_paused_past_its_lease_mid_replacement_never_overwrites_the_release_made_after_it(
    tmp_path, monkeypatch, where
):
    """The guard ran once, before the intent: a promoter frozen after it woke and went on with its roll-forward, deleting
    the release the one that took over had made meanwhile, and leaving `drafter/` empty."""
    from eagle3_assets import storage
    from eagle3_assets.leases import LeaseLost

    from .test_storage import _put_dirs

    old, new = _put_dirs(tmp_path)
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "release.json").write_text("newer")
    store = _replacing_store(tmp_path, monkeypatch, where)
    store.put_dir(old, RELEASE)
    paused = Lease(store, PROMOTION, "run-paused", **QUICK).acquire()
    took_over: list[str] = []

    def freeze(name: str) -> None:
        if name == f"put_dir:{RELEASE}:intent" and not took_over:
            took_over.append(name)
            paused._stop.set()  # frozen as by SIGSTOP: no heartbeat either
            paused._beat.join()
            time.sleep(QUICK["expiry_s"] + 0.1)
            with Lease(store, PROMOTION, "run-taker", **QUICK) as taker:  # settles the paused one's, then replaces it
                store.guarded(taker.check).put_dir(newer, RELEASE)

    monkeypatch.setattr(storage, "crash_point", freeze)
    with pytest.raises(LeaseLost, match=r"lost its lease: its last renewal was \d+s ago, past the 1s expiry"):
        store.guarded(paused.check).put_dir(new, RELEASE)
    paused.release()
    assert took_over and store.listdir(RELEASE) == ["release.json"]
    assert store.read_text(f"{RELEASE}/release.json") == "newer"


@pytest.mark.parametrize("where", ["memory", "local-no-exchange"])
def test_a_reader_waits_while_the_owner_of_a_replacement_lives_and_settles_it_in_the_stead_of_a_killed_one(
    tmp_path, monkeypatch, where
):
    """`drafter_eval` and training rank 0 settled the release with no lease: beside a live promoter's roll-forward,
    two settlers raced. Now a reader settles only when it can hold the owner's lease; the intent names its writer."""
    from eagle3_assets import storage
    from eagle3_assets.leases import settled
    from eagle3_assets.storage import StoreError

    from .test_storage import Killed, _found, _put_dirs

    old, new = _put_dirs(tmp_path)
    store = _replacing_store(tmp_path, monkeypatch, where)
    store.put_dir(old, RELEASE)

    def kill_at(name: str) -> None:
        if name == f"put_dir:{RELEASE}:removed":
            raise Killed(name)

    monkeypatch.setattr(storage, "crash_point", kill_at)
    with Lease(store, PROMOTION, "run-killed", **QUICK) as killed, pytest.raises(Killed):
        store.guarded(killed.check, killed.me.describe()).put_dir(new, RELEASE)
    monkeypatch.setattr(storage, "crash_point", lambda name: None)
    assert not store.exists(RELEASE)
    with Lease(store, PROMOTION, "run-live", **QUICK):  # an owner lives: the reader touches nothing, and says whose
        with pytest.raises(StoreError, match=r"/drafter/release is still mid-replacement after 0s \(.*/drafter/"
                           r"\.release\.replacing\.json is there, written by host .*, pid \d+, run run-killed, since "
                           r".* UTC\): the process that owns it settles it before it reads"):  # fmt: skip
            settled(store, RELEASE, PROMOTION, timeout_s=0.0, poll_s=0.05, **QUICK)
        assert not store.exists(RELEASE)
    settled(store, RELEASE, PROMOTION, poll_s=0.05, **QUICK)  # nobody holds it: settled in the killed one's stead
    assert _found(store) == "new" and not store.exists(f"{PROMOTION}/_LEASE.json")
    settled(store, RELEASE, PROMOTION, **QUICK)  # nothing pending: no lease taken


def test_a_renewal_stuck_in_the_store_never_hangs_the_release_and_one_delayed_past_its_margin_is_not_written(
    tmp_path, capsys
):
    """Issue 52, item 11: `release()` joined the heartbeat with no timeout; and a renewal delayed between its read and
    its write landed over the lease of the process that had taken over meanwhile."""
    import threading

    from eagle3_assets.leases import LeaseLost, _clock

    store = ArtifactStore(tmp_path / "store")
    hung = threading.Event()
    lease = Lease(store, "drafter", "run-a", **FAST).acquire()
    lease.store = store.guarded(hung.wait)  # every write from now on hangs, as a request to a store that never answers
    time.sleep(FAST["heartbeat_s"] * 2)
    lease.release()
    assert capsys.readouterr().err == (
        f"lease {store.url_of('drafter')}: a renewal is still writing after 2s; not released, it expires 2s after it "
        "lands\n"
    )
    hung.set()

    late = Lease(store, "promotion", "run-b", **FAST).acquire()
    late._stop.set()  # its heartbeat stands still: the renewal below is the delayed one
    late._beat.join()
    late._renewed_at = _clock() - (FAST["expiry_s"] - FAST["settle_s"] / 2)
    before = store.read_json("promotion/_LEASE.json")
    with pytest.raises(LeaseLost, match=r"lost its lease: its renewal came 2s after the last, too late to write safely"):
        late._renew()
    assert store.read_json("promotion/_LEASE.json") == before
