import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from eagle3_assets.storage import TMP_MARK, ArtifactStore, StoreError, StoreRefusal


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore(tmp_path / "root")
    return ArtifactStore(f"memory://eagle3-test-{uuid.uuid4().hex}")


def test_write_read_list_roundtrip(store: ArtifactStore):
    assert store.write_bytes("a/b/x.bin", b"\x00\x01") == 2
    store.write_json("a/meta.json", {"rows": 3})
    store.write_text("a/b/y.txt", "hello")
    assert store.read_bytes("a/b/x.bin") == b"\x00\x01"
    assert store.read_json("a/meta.json") == {"rows": 3}
    assert store.listdir("a/b") == ["x.bin", "y.txt"]
    assert store.listdir("missing") == []
    assert store.size("a/b/y.txt") == 5
    store.remove("a/b/x.bin")
    assert not store.exists("a/b/x.bin")


def test_failed_write_leaves_nothing_and_keeps_old_content(store: ArtifactStore):
    store.write_text("f.txt", "old")
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_atomic("f.txt", "wb") as f:
            f.write(b"new but half")
            raise RuntimeError("boom")
    assert store.read_text("f.txt") == "old"
    assert store.listdir("") == ["f.txt"]
    assert store.remove_temporaries("") == 0


def test_missing_artifact_error_names_it(store: ArtifactStore):
    with pytest.raises(StoreError, match=r"artifact not found: .*nothing/here\.json"):
        store.read_json("nothing/here.json")


def test_put_dir_replaces_whole_directory(store: ArtifactStore, tmp_path: Path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"123")
    store.write_text("model/stale.txt", "old")
    store.put_dir(src, "model")
    assert store.listdir("model") == ["config.json", "sub"]
    assert store.read_bytes("model/sub/w.bin") == b"123"
    local = store.ensure_local_dir("model")
    assert (local / "sub" / "w.bin").read_bytes() == b"123"


def test_free_bytes_known_only_on_local_filesystems(tmp_path: Path):
    assert ArtifactStore(tmp_path).free_bytes() > 0
    assert ArtifactStore(f"memory://free-{uuid.uuid4().hex}").free_bytes() is None


def test_writer_killed_mid_write_leaves_no_file_that_looks_complete(tmp_path: Path):
    root = tmp_path / "root"
    script = textwrap.dedent(
        f"""
        import sys, time
        from eagle3_assets.storage import ArtifactStore
        store = ArtifactStore({str(root)!r})
        store.write_text("done.txt", "complete")
        with store.open_atomic("big.bin", "wb") as f:
            f.write(b"x" * 1000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
            f.write(b"y" * 1000)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    store = ArtifactStore(root)
    assert store.listdir("") == ["done.txt"]  # the temporary is hidden, big.bin absent
    assert not store.exists("big.bin")
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".big.bin.tmp-")]
    assert len(leftovers) == 1
    assert store.remove_temporaries("") == 1
    assert sorted(p.name for p in root.iterdir()) == ["done.txt"]


def test_read_only_store_error_names_the_path(tmp_path: Path):
    if os.geteuid() == 0:
        # root ignores permission bits; a path under a regular file is unwritable for anyone
        (tmp_path / "file").write_text("x")
        store = ArtifactStore(tmp_path / "file" / "root")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        store = ArtifactStore(tmp_path / "ro")
    with pytest.raises(StoreError, match=r"cannot (write|create directory) .*"):
        store.write_text("x/y.txt", "data")


def test_a_full_disk_and_a_read_only_store_are_refusals_naming_the_file(small_tmpfs: Path):
    from eagle3_assets.errors import Refusal

    store = ArtifactStore(small_tmpfs / "store")
    store.write_text("responses/parts/part-00000.jsonl", "kept\n")
    with pytest.raises(StoreError) as full:
        store.write_bytes("responses/parts/part-00001.jsonl", b"x" * 200_000)
    said = re.fullmatch(
        f"cannot write file://{small_tmpfs}/store/responses/parts/part-00001.jsonl: "
        r"\[Errno 28\] No space left on device; ([\d,]+) bytes free there",
        str(full.value),
    )
    assert said is not None and int(said[1].replace(",", "")) < 200_000, str(full.value)
    assert isinstance(full.value, Refusal)
    assert store.listdir("responses/parts") == ["part-00000.jsonl"]  # no temporary left, the finished part kept
    assert os.listdir(small_tmpfs / "store/responses/parts") == ["part-00000.jsonl"]
    # A checkpoint (a directory published by one rename) on the full disk: the same refusal, nothing left behind.
    local = small_tmpfs.parent / "checkpoint"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"x" * 200_000)
    with pytest.raises(StoreRefusal, match=r"^cannot write file://.*/store/drafter/checkpoints/step_5: \[Errno 28\] "
                       r"No space left on device: .*; [\d,]+ bytes free there$"):
        store.put_dir(local, "drafter/checkpoints/step_5")
    assert store.listdir("drafter/checkpoints") == []

    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(StoreError, match=r"^cannot write .*/store/responses/parts/\.write-probe.*Read-only file system") as ro:
        store.check_writable("responses/parts")
    assert isinstance(ro.value, Refusal)
    assert store.read_text("responses/parts/part-00000.jsonl") == "kept\n"


def test_a_remote_target_rewritten_in_place_is_loaded_fresh_and_its_old_copy_removed(tmp_path: Path, tiny_target_dir: Path):
    """The engines load the bytes whose identity the records hold (issue 42): the local copy of a `memory://` target is
    keyed by that identity, so a model rewritten at the same URL is copied again, and the old copy goes."""
    import torch
    from safetensors.torch import load_file

    from eagle3_assets.demo.target import build_demo_target
    from eagle3_assets.drafter.target_head import load_target_weights
    from eagle3_assets.project import Project
    from eagle3_assets.provenance import target_identity

    from .conftest import TINY_DEMO, tiny_settings

    url = f"memory://target-{uuid.uuid4().hex[:8]}/model"
    remote = ArtifactStore(url.rsplit("/", 1)[0])
    remote.put_dir(tiny_target_dir, "model")
    settings = tiny_settings(target_model=url)
    project = Project(settings, ArtifactStore(tmp_path / "root"))
    fs = remote.fs

    def loaded_embedding() -> torch.Tensor:
        return load_target_weights(project.target()).embed_tokens

    first_identity, first = target_identity(url), project.target_dir()
    assert first.name == f"model@{first_identity}" and torch.equal(
        loaded_embedding(), load_file(tiny_target_dir / "model.safetensors")["model.embed_tokens.weight"]
    )
    assert project.target_dir() == first  # not copied again while the target stays as it is

    other = tmp_path / "other"
    build_demo_target(other, TINY_DEMO.model_copy(update={"seed": 1}), log=lambda _: None)
    fs.rm(remote.path("model"), recursive=True)
    remote.put_dir(other, "model")  # the same URL, other bytes
    second_identity, second = target_identity(url), project.target_dir()
    assert second_identity != first_identity and second.name == f"model@{second_identity}"
    new = load_file(other / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(loaded_embedding(), new) and not torch.equal(new, load_file(tiny_target_dir / "model.safetensors")["model.embed_tokens.weight"])
    copies = sorted(p.name for p in second.parent.iterdir() if not p.name.startswith("."))  # not the lock
    assert not first.exists() and copies == [second.name]
    shutil.rmtree(second.parent)


# --- a directory replaced as one step (issue 44, item 1): killed at each step, a complete copy stays ------------

REPLACE_STEPS = {  # the step killed at -> which copy a reader finds once the owner settled it
    "uploaded": "old",  # the new copy is uploaded, nothing replaced yet
    "swapped": "new",  # (local, one renameat2 exchange) swapped, the old one not yet removed
    "intent": "new",  # (no exchange) the intent names the complete new copy
    "removed": "new",  # the old directory is gone, the new one not yet in place
    "copied": "new",  # in place, the intent not yet removed
}


def _put_dirs(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old", tmp_path / "new"
    for d, files in ((old, {"release.json": "old", "model.safetensors": "old weights"}), (new, {"release.json": "new", "model.safetensors": "new weights", "extra.txt": "x"})):  # fmt: skip
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
    return old, new


def _found(store: ArtifactStore) -> str:
    """Which complete copy `drafter/release` holds after its owner settled it ("old" or "new")."""
    store.settle("drafter/release")
    files = {n: store.read_text(f"drafter/release/{n}") for n in store.listdir("drafter/release")}
    if files == {"release.json": "old", "model.safetensors": "old weights"}:
        return "old"
    assert files == {"release.json": "new", "model.safetensors": "new weights", "extra.txt": "x"}, files
    return "new"


LOCAL_STEPS = [("uploaded", True), ("swapped", True), ("uploaded", False), ("intent", False), ("removed", False),
               ("copied", False)]  # fmt: skip


@pytest.mark.parametrize(("step", "exchange"), LOCAL_STEPS, ids=[f"{s}-{'renameat2' if e else 'no-exchange'}" for s, e in LOCAL_STEPS])
def test_a_local_directory_replacement_killed_at_any_step_leaves_a_complete_copy(tmp_path: Path, step: str, exchange: bool):
    old, new = _put_dirs(tmp_path)
    root = tmp_path / "root"
    ArtifactStore(root).put_dir(old, "drafter/release")
    script = textwrap.dedent(
        f"""
        from eagle3_assets import storage
        if not {exchange}:
            storage.exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE (NFS, some FUSE mounts)
        storage.ArtifactStore({str(root)!r}).put_dir({str(new)!r}, "drafter/release")
        """
    )
    env = {**os.environ, "EAGLE3_CRASH_AT": f"put_dir:drafter/release:{step}"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    store = ArtifactStore(root)
    assert _found(store) == REPLACE_STEPS[step]
    store.remove_temporaries("drafter")
    assert sorted(p.name for p in (root / "drafter").iterdir()) == ["release"]  # nothing left beside it


class Killed(BaseException):
    """Stands for SIGKILL in this process: a memory:// store lives only as long as it does."""


@pytest.mark.parametrize("step", ["uploaded", "intent", "removed", "copied"])
def test_an_object_store_directory_replacement_killed_at_any_step_leaves_a_complete_copy(tmp_path: Path, step: str, monkeypatch):
    from eagle3_assets import storage

    old, new = _put_dirs(tmp_path)
    url = f"memory://replace-{uuid.uuid4().hex[:8]}"
    ArtifactStore(url).put_dir(old, "drafter/release")

    def kill_at(name: str) -> None:
        if name == f"put_dir:drafter/release:{step}":
            raise Killed(name)

    monkeypatch.setattr(storage, "crash_point", kill_at)
    with pytest.raises(Killed):
        ArtifactStore(url).put_dir(new, "drafter/release")
    monkeypatch.undo()
    store = ArtifactStore(url)
    assert _found(store) == REPLACE_STEPS[step]
    store.remove_temporaries("drafter")
    assert store.fs.ls(store.path("drafter"), detail=False) == [store.path("drafter/release")]
    # the next writer finishes what was left, then replaces as usual
    store.put_dir(old, "drafter/release")
    assert _found(store) == "old"


def test_a_reader_that_does_not_own_a_directory_waits_for_its_owner_to_settle_it(tmp_path: Path, monkeypatch):
    """Ranks > 0 of a training job read the release while rank 0 settles it: two settlers at once could race, one
    removing the copy the other just moved in place. Only the owner settles; the others wait, then read it whole."""
    from eagle3_assets import storage

    old, new = _put_dirs(tmp_path)
    url = f"memory://wait-{uuid.uuid4().hex[:8]}"
    ArtifactStore(url).put_dir(old, "drafter/release")

    def kill_at(name: str) -> None:
        if name == "put_dir:drafter/release:removed":
            raise Killed(name)

    monkeypatch.setattr(storage, "crash_point", kill_at)
    with pytest.raises(Killed):
        ArtifactStore(url).put_dir(new, "drafter/release")
    monkeypatch.undo()
    reader, owner = ArtifactStore(url), ArtifactStore(url)
    with pytest.raises(StoreError, match=r"drafter/release is still mid-replacement after 0s \(.*/drafter/\.release\.replacing\.json is there, written by host .*, pid \d+\): the process that owns it"):
        reader.wait_settled("drafter/release", timeout_s=0.3, poll_s=0.05)
    assert not reader.exists("drafter/release")  # the reader touched nothing

    settler = threading.Timer(0.3, owner.settle, args=["drafter/release"])
    settler.start()
    reader.wait_settled("drafter/release", timeout_s=30, poll_s=0.05)
    settler.join()
    assert _found(reader) == "new"


def test_ranks_copying_a_remote_directory_at_once_all_get_the_one_copy(tmp_path: Path):
    """Ranks of one node asking at once: before the lock, each copied, and all but the first rename failed."""
    remote = ArtifactStore(f"memory://eagle3-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    for i in range(20):
        remote.write_bytes(f"model/w{i}.bin", bytes([i]) * 1000)
    start, got, errors = threading.Barrier(4), [], []

    def rank() -> None:
        start.wait()
        try:
            got.append(remote.ensure_local_dir("model", version="v1"))
        except OSError as e:  # each rank's failure, reported below
            errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(got)) == 1
    assert sorted(p.name for p in got[0].iterdir()) == sorted(f"w{i}.bin" for i in range(20))
    assert [p.name for p in got[0].parent.iterdir() if not p.name.startswith(".")] == ["model@v1"]


def test_a_local_copy_leaves_out_what_it_is_not_asked_for_and_sweeps_dead_copies(tmp_path: Path):
    remote = ArtifactStore(f"memory://eagle3-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    remote.write_text("model/config.json", "{}")
    remote.write_text("model/original/consolidated.00.pth", "x" * 100)
    first = remote.ensure_local_dir("model", version="v1", files=["config.json"])
    dead = first.parent / f"model@v2{TMP_MARK}0123abcd"  # a copier of v2 killed mid-copy
    (dead / "sub").mkdir(parents=True)
    second = remote.ensure_local_dir("model", version="v2", files=["config.json", "original/consolidated.00.pth"])
    assert not first.exists()  # the copy of the version before goes
    assert sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file()) == [
        "config.json", "original/consolidated.00.pth"
    ]
    assert sorted(p.name for p in second.parent.iterdir() if not p.name.startswith(".")) == ["model@v2"]


# --- the intent (issue 52, item 8): written atomically; a torn one never wedges later publishes ---------------------


def test_a_disk_that_fills_as_the_intent_is_written_leaves_no_intent_and_the_old_directory(small_tmpfs: Path, monkeypatch):
    """The intent was written by a plain `pipe_file`: a full disk left it 0 bytes, and every later publish and resume
    failed on a bare JSONDecodeError until a person deleted a hidden file."""
    from eagle3_assets import storage

    monkeypatch.setattr(storage, "exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE: the intent
    old, new = _put_dirs(small_tmpfs.parent)
    store = ArtifactStore(small_tmpfs / "store")
    store.put_dir(old, "drafter/release")

    def fill(name: str) -> None:  # another writer takes the last bytes once the new copy is uploaded
        if name == "put_dir:drafter/release:uploaded":
            with open(small_tmpfs / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 512)
                except OSError:
                    pass

    monkeypatch.setattr(storage, "crash_point", fill)
    with pytest.raises(StoreRefusal, match=r"^cannot write file://.*/store/drafter/\.release\.replacing\.json: "
                       r"\[Errno 28\] No space left on device"):  # fmt: skip
        store.put_dir(new, "drafter/release")
    assert sorted(os.listdir(small_tmpfs / "store/drafter")) == ["release"]  # no intent, no copy left
    os.remove(small_tmpfs / "filler")
    monkeypatch.setattr(storage, "crash_point", lambda name: None)
    assert _found(store) == "old"
    store.put_dir(new, "drafter/release")
    assert _found(store) == "new"


@pytest.mark.parametrize("torn", [b"", b'{"from": ".release.tmp-'])
def test_a_torn_intent_an_older_writer_left_is_dropped_naming_it_and_the_next_publish_goes_on(tmp_path: Path, capfd, torn: bytes):
    from eagle3_assets import storage

    old, new = _put_dirs(tmp_path)
    url = f"memory://torn-{uuid.uuid4().hex[:8]}"
    store = ArtifactStore(url)
    store.put_dir(old, "drafter/release")
    store.fs.put(f"{new}/", store.path("drafter/.release.tmp-0123456789ab"), recursive=True)  # its complete copy
    store.fs.pipe_file(store.path("drafter/.release.replacing.json"), torn)
    assert store.settle("drafter/release")
    assert capfd.readouterr().err == (
        f"{store.url_of('drafter/.release.replacing.json')}: a torn intent (not JSON: a full disk or a kill while it "
        f"was written) is removed; {store.url_of('drafter/release')} keeps the copy it had\n"
    )
    assert _found(store) == "old"
    assert store.remove_temporaries("drafter") == 1
    store.fs.pipe_file(store.path("drafter/.release.replacing.json"), torn)
    store.put_dir(new, "drafter/release")  # the next publish settles it first, then replaces
    assert _found(store) == "new"
    assert store.fs.ls(store.path("drafter"), detail=False) == [store.path("drafter/release")]


def test_a_killed_trainers_and_promoters_temporaries_are_swept_each_by_its_owner_and_a_killed_ranks_staging_too(
    tmp_path: Path,
):
    """Issue 52, item 12: `.export.tmp-*`, `.release.tmp-*`, `.tensorboard.tmp-*` and a killed rank's local
    `drafter-export-*` staging copy were never swept. Each owner sweeps its own: the release's copies beside a
    family's export are the promotion's, never the trainer's to remove."""
    from eagle3_assets.drafter.run import sweep_killed_writes
    from eagle3_assets.processes import pid_prefix, remove_dead_tempdirs

    store = ArtifactStore(tmp_path / "store")
    left = [".export.tmp-0123456789ab", ".tensorboard.tmp-0123456789ab", ".release.tmp-0123456789ab",
            "..release.replacing.json.tmp-0123456789ab", "export"]  # fmt: skip
    for name in left:
        (tmp_path / "store/drafter" / name).mkdir(parents=True)
    (tmp_path / "store/drafter/tensorboard/.run_from_step_40.tmp-0123456789ab").mkdir(parents=True)
    assert sweep_killed_writes(store) == ["1 export", "2 tensorboard"]
    assert sorted(os.listdir(tmp_path / "store/drafter")) == [
        "..release.replacing.json.tmp-0123456789ab", ".release.tmp-0123456789ab", "export", "tensorboard"
    ]  # fmt: skip
    assert store.remove_temporaries("drafter", "release") == 2  # by the promotion, under its lease
    assert sorted(os.listdir(tmp_path / "store/drafter")) == ["export", "tensorboard"]

    staging = tmp_path / "tmp"
    killed = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, mine = staging / f"drafter-export-{killed.stdout.strip()}-abc", staging / f"{pid_prefix('drafter-export-')}abc"
    for d in (dead, mine):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    assert remove_dead_tempdirs("drafter-export-", staging) == [dead.name]
    assert sorted(os.listdir(staging)) == [mine.name]  # this live process's is kept
