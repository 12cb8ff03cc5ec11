"""The sha256 of whole files, each file read once: cached on disk under what says the file is unchanged.

The target's identity (`provenance.target_identity`) is the sha256 of every file that determines what the target
computes and how it tokenizes, weights included (issue 44: sampled blocks let sparse edits escape, and `.bin`
weights were compared by size). Reading a 1 TB checkpoint whole costs minutes (BENCHMARKS.md, `digest`), so each
file's digest is kept in a cache and read again only when the file may have changed:

- a local file is keyed by its real path (symlinks resolved), size, `mtime_ns`, `ctime_ns`, inode and device.
  `ctime` is in the key because it cannot be set from user space: an edit in place that restores the size and
  the mtime (`cp -p`, `touch -d`) still moves it, so a cached digest is never stale;
- a remote file (any fsspec store) by its URL, size and what the store says changes with its content (ETag,
  LastModified, mtime, created, a checksum). A store that says none of those is read every time, never cached;
- where the store gives the file's own sha256 (Hugging Face's LFS metadata), that is the digest: nothing is read.

The cache is one small JSON file per key (a write is one atomic rename, so processes share it without a lock)
under `$EAGLE3_DIGEST_CACHE`, else `$XDG_CACHE_HOME/eagle3-assets/file-digests`, else
`~/.cache/eagle3-assets/file-digests`. On a machine that starts fresh (a pod) point `$EAGLE3_DIGEST_CACHE` at a
persistent volume, or each start reads the checkpoint whole once.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

CACHE_ENV = "EAGLE3_DIGEST_CACHE"
CHUNK = 8 << 20
# What a store's file info may say that changes whenever the file's content does (S3, GCS, Azure, memory, HTTP).
CHANGE_FIELDS = (
    "ETag",
    "etag",
    "LastModified",
    "last_modified",
    "mtime",
    "created",
    "md5Hash",
    "crc32c",
    "ChecksumSHA256",
    "version_id",
)


def cache_dir() -> Path:
    """Where file digests are kept (the module docstring)."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eagle3-assets" / "file-digests"


@dataclass
class FileDigests:
    """Whole-file sha256 digests, cached under `root` (None: `cache_dir()` at each call). `hashed` counts the files
    this instance read whole, `hashed_bytes` their bytes: what a cache miss cost."""

    root: Path | None = None
    hashed: int = 0
    hashed_bytes: int = 0
    _memo: dict[str, str] = field(default_factory=dict)

    def sha256(self, fs: fsspec.AbstractFileSystem, path: str, info: dict[str, Any] | None = None) -> str:
        """The sha256 (hex) of the file at `path` on `fs`; `info` is the store's info for it, when already listed."""
        if isinstance(fs, LocalFileSystem):
            real = os.path.realpath(path)
            st = os.stat(real)
            key: list[Any] | None = ["local", real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
            size = st.st_size
        else:
            info = info if info is not None else fs.info(path)
            lfs = info.get("lfs")
            if isinstance(lfs, dict) and isinstance(lfs.get("sha256"), str):
                return lfs["sha256"]  # the store's own digest of these bytes (HfFileSystem): nothing to read
            size = int(info.get("size") or 0)
            said = {k: info[k] for k in CHANGE_FIELDS if info.get(k) is not None}
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            key = ["remote", f"{protocol}://{path}", size, said] if said else None
        name = hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:32] if key is not None else None
        if name is not None:
            if name in self._memo:
                return self._memo[name]
            if (found := self._read(name, key)) is not None:
                self._memo[name] = found
                return found
        h = hashlib.sha256()
        with open(path, "rb") if isinstance(fs, LocalFileSystem) else fs.open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        self.hashed += 1
        self.hashed_bytes += size
        digest = h.hexdigest()
        if name is not None:
            self._memo[name] = digest
            self._write(name, key, digest)
        return digest

    def _dir(self) -> Path:
        return self.root if self.root is not None else cache_dir()

    def _read(self, name: str, key: list[Any] | None) -> str | None:
        try:
            body = json.loads((self._dir() / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        # The key is stored whole and compared, so a truncated name never hands over another file's digest.
        if not isinstance(body, dict) or body.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        sha = body.get("sha256")
        return sha if isinstance(sha, str) and len(sha) == 64 else None

    def _write(self, name: str, key: list[Any] | None, digest: str) -> None:
        root = self._dir()
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                tmp.write_text(json.dumps({"key": key, "sha256": digest}, default=str))
                os.replace(tmp, root / f"{name}.json")  # atomic: a reader sees the old entry, the new one, or none
            finally:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only or full cache costs a re-read next time, never a wrong digest


DIGESTS = FileDigests()  # the process's: its memo spares re-reading the cache entries on every daemon tick
