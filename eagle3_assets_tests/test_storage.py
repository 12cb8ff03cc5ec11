import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from eagle3_assets.storage import ArtifactStore, StoreError, StoreRefusal


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
    assert not first.exists() and sorted(p.name for p in second.parent.iterdir()) == [second.name]
    shutil.rmtree(second.parent)
