"""The target is known by its bytes (issue 44, items 2 and 4): its identity is the sha256 of every file that
determines what it computes and how it tokenizes, never its path; its version, the one every child and the release
record, is that identity. Tiny model directories of plain files: nothing here loads a model."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from safetensors.torch import save_file

from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.file_digests import FileDigests
from eagle3_assets.project import Project
from eagle3_assets.provenance import IDENTITY_PREFIX, target_identity
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings

BLOCK = 64 << 10  # the sampled identity read three blocks of this size from each weight file


def make_model(root: Path, **extra: bytes) -> Path:
    """A model directory: config, tokenizer, a 1 MiB safetensors file (16 x 64 KiB blocks of data) and `extra`
    files by their path inside the directory."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320}))
    (root / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    save_file({"w": torch.arange(256 * 1024, dtype=torch.float32)}, str(root / "model.safetensors"))
    for rel, body in extra.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
    return root


def edit_in_place(path: Path, offset: int, byte: int = 0x5A) -> None:
    """One byte rewritten in place: the file keeps its size (and its inode)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([byte]))
    assert path.stat().st_size == size


def test_the_same_bytes_moved_copied_linked_or_named_as_file_url_keep_the_identity(tmp_path: Path):
    model = make_model(tmp_path / "a" / "model")
    identity = target_identity(str(model))
    assert identity.startswith(IDENTITY_PREFIX)
    copy = tmp_path / "b" / "model"
    shutil.copytree(model, copy)
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    # A Hugging Face snapshot: a directory of links into `blobs/`.
    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc123", tmp_path / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f.name, snapshot))
    remote = f"memory://identity-{uuid.uuid4().hex[:8]}/model"
    fsspec.filesystem("memory").put(str(model), remote.removeprefix("memory://"), recursive=True)
    assert [target_identity(u) for u in (str(copy), str(link), f"file://{model}", str(snapshot), remote)] == [
        identity
    ] * 5
    # What determines nothing the target computes is not its content: docs, git metadata, Meta's `original/` copies.
    for rel in ("README.md", ".gitattributes", "original/consolidated.00.pth", "LICENSE", ".cache/huggingface/x"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(b"not the model")
    assert target_identity(str(copy)) == identity


def test_a_weight_edited_between_the_blocks_a_sample_would_read_changes_the_identity(tmp_path: Path):
    """Sparse edits (a layer, a retrained special-token row) at the same size: the sampled identity read the header
    and three 64 KiB blocks (start, middle, end) and missed them."""
    model = make_model(tmp_path / "model")
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    assert size > 3 * BLOCK
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    before = target_identity(str(model))
    edit_in_place(weights, header + 4 * BLOCK + 123)  # between the first block and the middle one
    assert target_identity(str(model)) != before


def test_a_bin_weight_edited_at_the_same_size_changes_the_identity(tmp_path: Path):
    model = make_model(tmp_path / "model", **{"pytorch_model.bin": bytes(300_000)})
    before = target_identity(str(model))
    edit_in_place(model / "pytorch_model.bin", 150_000)
    assert target_identity(str(model)) != before


@pytest.mark.parametrize(
    "rel",
    ["modeling_custom.py", "tokenization_custom.py", "tekken.json", "o200k.tiktoken",
     "additional_chat_templates/tool_use.jinja"],
)  # fmt: skip
def test_an_edited_remote_code_tokenizer_or_template_file_changes_the_identity(tmp_path: Path, rel: str):
    model = make_model(tmp_path / "model", **{rel: b"version one"})
    before = target_identity(str(model))
    (model / rel).write_bytes(b"version two")
    assert target_identity(str(model)) != before


STRAYS = {"nohup.out": b"INFO served\n", "notes.txt": b"try lr 3e-4", "training_args.bin": b"\x80\x04pickle",
          "config.json.bak": b"{}", "trainer_state.json": b"{}", "runs/events.out.tfevents.1": b"tb"}  # fmt: skip


def test_a_stray_file_in_the_model_directory_is_named_and_is_no_new_target(tmp_path: Path):
    """Issue 52, item 5: every file not known to be docs counted, so `nohup.out` (from `nohup vllm serve` started in
    the model directory), notes, a trainer's `training_args.bin` or a `config.json.bak` made a new target: every
    response was generated again and the release dropped. Only what a model is made of counts; the rest is named."""
    from eagle3_assets.provenance import target_files, unknown_target_files

    model = make_model(tmp_path / "model", **{"generation_config.json": b"{}", "chat_template.jinja": b"{{ x }}",
                                              "model.safetensors.index.json": b"{}", "tokenizer_config.json": b"{}",
                                              "pytorch_model-00001-of-00002.bin": b"w", "spiece.model": b"sp"})  # fmt: skip
    identity = target_identity(str(model))
    assert unknown_target_files(str(model)) == []
    for rel, body in STRAYS.items():
        (model / rel).parent.mkdir(parents=True, exist_ok=True)
        (model / rel).write_bytes(body)
    (model / "README.md").write_text("docs: known, not named")
    assert target_identity(str(model)) == identity
    assert unknown_target_files(str(model)) == sorted(STRAYS)
    assert sorted(target_files(str(model))) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "model.safetensors.index.json", "pytorch_model-00001-of-00002.bin", "spiece.model", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    (model / "nohup.out").write_bytes(b"INFO served again\n")  # a server writing its log there, every tick
    assert target_identity(str(model)) == identity
    edit_in_place(model / "pytorch_model-00001-of-00002.bin", 0)  # what the model is made of still counts
    assert target_identity(str(model)) != identity


def test_the_target_model_asset_names_the_files_it_does_not_count(tmp_path: Path, tiny_target_dir: Path):
    from dagster import DagsterInstance, materialize

    from eagle3_assets.defs.data.assets import target_model

    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    store = ArtifactStore(tmp_path / "store")
    project = Project(tiny_settings(target_model=str(model)), store)
    with DagsterInstance.ephemeral() as instance:
        before = materialize([target_model], resources={"project": project}, instance=instance)
        (model / "nohup.out").write_text("INFO served\n")
        after = materialize([target_model], resources={"project": project}, instance=instance)
    made = [r.asset_materializations_for_node("target_model")[0] for r in (before, after)]
    assert made[0].tags["dagster/data_version"] == made[1].tags["dagster/data_version"]
    assert [m.metadata["unknown_files"].value for m in made] == [[], ["nohup.out"]]


def version_of(settings_target: str, store: ArtifactStore, trust_remote_code: bool = False) -> str:
    """The data version the `target_model` asset records for a target named so (the version its children and the
    release record)."""
    project = Project(tiny_settings(target_model=settings_target, trust_remote_code=trust_remote_code), store)
    return materialized(project, Staleness(project).expected("target_model"))["data_version"].value


def test_the_target_version_is_its_content_identity_not_where_it_lies_nor_a_flag_that_runs_no_code(tmp_path: Path):
    store = ArtifactStore(tmp_path / "store")
    model = make_model(tmp_path / "a" / "model")
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    moved = tmp_path / "b" / "model"
    shutil.copytree(model, moved)
    version = version_of(str(model), store)
    assert [version_of(u, store) for u in (str(link), f"file://{model}", str(moved))] == [version] * 3
    assert version == target_identity(str(model))
    # No code of its own: `trust_remote_code` runs nothing, the same target.
    assert version_of(str(model), store, trust_remote_code=True) == version
    # Code of its own: the flag decides whether it runs (the target's modeling and tokenizer, or the engines' own).
    (model / "modeling_custom.py").write_text("class Custom: ...\n")
    assert version_of(str(model), store, trust_remote_code=True) != version_of(str(model), store)
    # An `auto_map` in the config names code too (possibly in another repository).
    (moved / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "org/repo--m.Custom"}}))
    assert version_of(str(moved), store, trust_remote_code=True) != version_of(str(moved), store)


def test_each_file_is_read_once_then_its_digest_comes_from_the_cache_until_it_changes(tmp_path: Path):
    model = make_model(tmp_path / "model", **{"pytorch_model.bin": bytes(1000)})
    cache = tmp_path / "cache"
    first = FileDigests(cache)
    identity = target_identity(str(model), digests=first)
    assert (first.hashed, first.hashed_bytes) == (4, sum(f.stat().st_size for f in model.iterdir()))
    assert target_identity(str(model), digests=first) == identity and first.hashed == 4  # its memo
    # Another process, the same cache directory: nothing is read.
    second = FileDigests(cache)
    assert target_identity(str(model), digests=second) == identity and second.hashed == 0
    assert sorted(p.suffix for p in cache.iterdir()) == [".json"] * 4  # written by rename: no temporary left
    # An edit in place that keeps the size and puts the mtime back (`cp -p`, `touch -d`) is still seen: the key holds
    # the inode's ctime, which no one can set. Only that file is read again.
    bin_path = model / "pytorch_model.bin"
    st = bin_path.stat()
    edit_in_place(bin_path, 500)
    os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = FileDigests(cache)
    assert target_identity(str(model), digests=third) != identity and third.hashed == 1


def test_a_remote_target_is_read_once_per_version_and_a_stores_own_sha256_is_used_unread(tmp_path: Path):
    model = make_model(tmp_path / "model")
    url = f"memory://identity-{uuid.uuid4().hex[:8]}/model"
    fs = fsspec.filesystem("memory")
    fs.put(str(model), url.removeprefix("memory://"), recursive=True)
    digests = FileDigests(tmp_path / "cache")
    identity = target_identity(url, digests=digests)
    assert identity == target_identity(str(model)) and digests.hashed == 3
    assert target_identity(url, digests=FileDigests(tmp_path / "cache")) == identity  # from the cache
    fs.pipe(url.removeprefix("memory://") + "/tokenizer.json", b'{"model": {"type": "Unigram"}}')  # rewritten
    again = FileDigests(tmp_path / "cache")
    assert target_identity(url, digests=again) != identity and again.hashed == 1

    # A store that gives each file's sha256 (Hugging Face's LFS metadata, as `HfFileSystem.info` has it): the digest
    # is taken from it and nothing is read. Wrong on purpose here, to see it used.
    class LfsMemory(MemoryFileSystem):
        protocol = "lfsmemory"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.replace("lfsmemory://", "memory://"))

        def find(self, path, *args, **kwargs):
            found = super().find(path, *args, **kwargs)
            return {p: {**i, "lfs": {"sha256": "ab" * 32}} for p, i in found.items()} if kwargs.get("detail") else found

    fsspec.register_implementation("lfsmemory", LfsMemory, clobber=True)
    told = FileDigests(tmp_path / "other-cache")
    assert target_identity(url.replace("memory://", "lfsmemory://"), digests=told) != identity and told.hashed == 0
