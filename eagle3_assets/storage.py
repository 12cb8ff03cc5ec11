"""The artifact store: every artifact the pipeline writes goes through here.

The root is any fsspec URL (`/data/eagle3`, `file:///data/eagle3`, `memory://run`,
`s3://bucket/eagle3`). Writes are atomic (docs/DESIGN.md §2): bytes go to a temporary name
in the same directory and are renamed into place, so a crash never leaves a file
that looks complete. Temporary names start with a dot and are never listed.

A directory (a checkpoint, the export, the release) is replaced as one step too (`put_dir`). On a local
disk the new one is swapped in by one `renameat2(RENAME_EXCHANGE)`. Where no such rename exists (object
stores, some network filesystems) the complete new copy is uploaded first, then an intent beside the
directory names it, and only then is the old one replaced; a writer killed after the intent leaves a
replacement that `settle` finishes from the complete copy. A kill at any point leaves a complete copy:
the old one before the intent, the new one after it. The intent is itself written atomically and names its writer;
one left torn by an older writer (a full disk, a kill while it was written) was written before anything was replaced:
`settle` drops it, saying so, and the old directory stands.

Only the owner of a directory settles it (the holder of its lease, `leases.settled`): a writer that lost its lease
while it rolled a replacement forward stops at the next step (the store's guard is checked before each), so two
settlers never interleave and a writer paused past its lease never overwrites its successor's directory.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from eagle3_assets.crash_points import crash_point
from eagle3_assets.errors import Eagle3Error, Refusal

TMP_MARK = ".tmp-"
INTENT_SUFFIX = ".replacing.json"  # `.<name>.replacing.json` beside a directory being replaced
_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# A full disk, a read-only store, a write not permitted: a retry meets the same wall.
REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class StoreError(Eagle3Error, RuntimeError):
    """A store operation failed; the message names the artifact and the cause."""


class StoreRefusal(Refusal, StoreError):
    """The store cannot take a write (full, read-only, not permitted); the message names the path."""


def this_process() -> str:
    """Who writes, as an intent names its writer when no lease holder is named (`ArtifactStore.guarded`)."""
    return f"host {socket.gethostname()}, pid {os.getpid()}"


def write_error(what: str, e: OSError, free: int | None = None) -> StoreError:
    """`e` as the store's error: a refusal for the errnos no retry can fix; a full disk says how full."""
    room = f"; {free:,} bytes free there" if free is not None and e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return (StoreRefusal if e.errno in REFUSED_ERRNOS else StoreError)(f"{what}: {e}{room}")


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def _hidden(name: str) -> bool:
    return _is_tmp(name) or (name.startswith(".") and name.endswith(INTENT_SUFFIX))


def exchange(a: str, b: str) -> bool:
    """Swap two local paths in one atomic rename; False where the filesystem (or the platform) cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


class ArtifactStore:
    """Relative paths under one fsspec root, with atomic writes."""

    def __init__(self, root: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None):
        self.url = str(root)
        # Object stores' filesystems (s3fs, gcsfs, adlfs) cache directory listings for the life of the process: the
        # daemon, the start command and a trainer waiting for its next shard would never see what another process
        # wrote or removed (a new shard, a record, a killed promotion's intent). Every listing here decides something.
        self.fs, self.root = fsspec.core.url_to_fs(self.url, use_listings_cache=False)
        self.root = self.root.rstrip("/") or "/"
        self._cache_dir = Path(cache_dir) if cache_dir else None
        self._guard: Callable[[], None] = lambda: None
        self.writer = this_process()  # what an intent of this store's writes names

    def guarded(self, guard: Callable[[], None], writer: str = "") -> ArtifactStore:
        """This store, calling `guard` before it publishes a write or deletes anything: a lease holder's
        check (`leases.Lease.check`) that it still owns what it writes; `writer` names the holder in its intents."""
        copy = ArtifactStore(self.url, cache_dir=self._cache_dir)
        copy._guard, copy.writer = guard, writer or self.writer
        return copy

    def child(self, rel: str) -> ArtifactStore:
        """The store rooted at `rel` of this one (this one when `rel` is empty), with the same guard."""
        if not rel.strip("/"):
            return self
        child = ArtifactStore(self.url_of(rel), cache_dir=self._cache_dir)
        child._guard, child.writer = self._guard, self.writer
        return child

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # -- paths -------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def shows_writes_at_once(self) -> bool:
        """Whether a write is visible to the next read of any process at once: a filesystem path (a rename is seen by
        the next open; on NFS, close-to-open) or memory; not an object store, whose reads may lag its writes."""
        return isinstance(self.fs, LocalFileSystem | MemoryFileSystem)

    def path(self, rel: str) -> str:
        """The filesystem path of `rel` (what `self.fs` understands)."""
        rel = rel.strip("/")
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        """A URL a person can paste: `file:///…`, `memory://…`, `s3://…`."""
        return self.fs.unstrip_protocol(self.path(rel))

    def local_path(self, rel: str) -> Path | None:
        """The local path of `rel` when the store is on the local filesystem, else None."""
        return Path(self.path(rel)) if self.is_local else None

    # -- reading -----------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`, temporaries excluded, sorted. Missing dir -> []."""
        p = self.path(rel)
        if not self.fs.exists(p):
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(p, detail=False)]
        return sorted(n for n in names if not _hidden(n))

    def sizes(self, rel: str) -> dict[str, int]:
        """Each file directly under `rel` (temporaries excluded) by name, with its size: one listing. Missing dir -> {}."""
        p = self.path(rel)
        if not self.fs.exists(p):
            return {}
        entries = ((e["name"].rstrip("/").rsplit("/", 1)[-1], e) for e in self.fs.ls(p, detail=True))
        return {n: int(e["size"]) for n, e in entries if e["type"] == "file" and not _hidden(n)}

    def tree_bytes(self, rel: str) -> int:
        """The bytes of every file under `rel`; 0 when it is not there."""
        p = self.path(rel)
        return int(self.fs.du(p, total=True)) if self.fs.exists(p) else 0

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError as e:
            raise StoreError(f"artifact not found: {self.url_of(rel)}") from e

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_text(rel))

    def open(self, rel: str, mode: str = "rb") -> IO[Any]:
        if "r" not in mode:
            raise ValueError("ArtifactStore.open is for reading; write with open_atomic/write_*")
        return self.fs.open(self.path(rel), mode)

    # -- atomic writing ----------------------------------------------------
    def _tmp_name(self, rel: str) -> str:
        parent, _, name = self.path(rel).rpartition("/")
        return f"{parent}/.{name}{TMP_MARK}{uuid.uuid4().hex[:12]}"

    def _makedirs_for(self, rel: str) -> None:
        parent = self.path(rel).rpartition("/")[0]
        try:
            self.fs.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise write_error(f"cannot create directory {self.fs.unstrip_protocol(parent)}", e) from e

    @contextmanager
    def open_atomic(self, rel: str, mode: str = "wb") -> Iterator[IO[Any]]:
        """Open a temporary file; on clean exit it is renamed to `rel`, on error it is removed."""
        self._makedirs_for(rel)
        tmp = self._tmp_name(rel)
        try:
            f = self.fs.open(tmp, mode)
        except OSError as e:
            raise write_error(f"cannot write {self.url_of(rel)}", e) from e
        try:
            with f:
                yield f
            self._guard()
            self.fs.mv(tmp, self.path(rel))
        except BaseException as e:
            try:
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
            except OSError:
                pass
            if isinstance(e, OSError):  # the disk filled, or the store went read-only, while writing
                raise write_error(f"cannot write {self.url_of(rel)}", e, self.free_bytes()) from e
            raise

    def check_writable(self, rel_dir: str) -> None:
        """Write and remove an empty probe in `rel_dir`, so a read-only store is refused before any work."""
        probe = f"{rel_dir}/.write-probe{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self.write_bytes(probe, b"")
        try:
            self.remove(probe)
        except OSError as e:
            raise write_error(f"cannot remove {self.url_of(probe)}", e) from e

    def write_bytes(self, rel: str, data: bytes) -> int:
        with self.open_atomic(rel, "wb") as f:
            f.write(data)
        return len(data)

    def write_text(self, rel: str, text: str) -> int:
        return self.write_bytes(rel, text.encode("utf-8"))

    def write_json(self, rel: str, obj: Any) -> int:
        return self.write_text(rel, json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def remove(self, rel: str, *, recursive: bool = False) -> None:
        p = self.path(rel)
        self._guard()
        if self.fs.exists(p):
            self.fs.rm(p, recursive=recursive)

    def move(self, src: str, dst: str) -> None:
        """Move the file `src` to `dst`, replacing it: on a local disk one rename, which takes no new space.
        FileNotFoundError when `src` is not there."""
        self._makedirs_for(dst)
        self._guard()
        if not self.fs.exists(self.path(src)):
            raise FileNotFoundError(self.url_of(src))
        try:
            self.fs.mv(self.path(src), self.path(dst))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise write_error(f"cannot move {self.url_of(src)} to {self.url_of(dst)}", e, self.free_bytes()) from e

    def remove_temporaries(self, rel_dir: str, name: str | None = None) -> int:
        """Delete leftovers of writers that died under `rel_dir` (only those of `name` there, when given: where
        others' writers share the directory, as a family's export and the release share `drafter/`); returns how
        many. Only by the owner of what it sweeps: a live writer's upload is a temporary too."""
        p = self.path(rel_dir)
        if not self.fs.exists(p):
            return 0
        # A replacement's complete copy is not a leftover: finish it first.
        if name is None:
            self.settle_all(rel_dir)
        else:
            self.settle(f"{rel_dir}/{name}")
        mine = (f".{name}{TMP_MARK}", f".{self._intent_rel(name)}{TMP_MARK}") if name else ("",)
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(p, detail=False))
        stale = [n for n in names if _is_tmp(n) and n.startswith(mine)]
        for n in stale:
            self._guard()
            self.fs.rm(f"{p}/{n}", recursive=True)
        return len(stale)

    # -- directories (model checkpoints, exports) --------------------------
    def put_dir(self, local_dir: str | os.PathLike[str], rel: str) -> None:
        """Copy a local directory to `rel`, replacing it as one step (module docstring): a kill at any point leaves
        the old directory or the new one, complete."""
        self.settle(rel)
        self._makedirs_for(rel)
        tmp, intent = self._tmp_name(rel), None
        try:
            self.fs.put(str(local_dir).rstrip("/") + "/", tmp, recursive=True)
            crash_point(f"put_dir:{rel}:uploaded")
            self._guard()
            if self.is_local and (not self.fs.exists(self.path(rel)) or exchange(tmp, self.path(rel))):
                if self.fs.exists(tmp) and not self.fs.exists(self.path(rel)):
                    os.rename(tmp, self.path(rel))  # nothing to replace: one rename
                crash_point(f"put_dir:{rel}:swapped")
                if self.fs.exists(tmp):
                    self.fs.rm(tmp, recursive=True)  # the old directory, swapped out
                return
            # Atomic, as every file: a full disk or a kill while it is written leaves no intent, never a torn one.
            self.write_json(self._intent_rel(rel), {"from": tmp.rpartition("/")[2], "writer": self.writer})
            intent = self._intent_path(rel)
            crash_point(f"put_dir:{rel}:intent")
            self._roll_forward(rel, tmp, intent)
        except BaseException as e:
            if intent is None and self.fs.exists(tmp):  # after the intent, the new copy is the one to keep
                self.fs.rm(tmp, recursive=True)
            if isinstance(e, OSError):  # a checkpoint or an export on a full disk: a refusal naming it
                raise write_error(f"cannot write {self.url_of(rel)}", e, self.free_bytes()) from e
            raise

    def _intent_rel(self, rel: str) -> str:
        parent, _, name = rel.strip("/").rpartition("/")
        return f"{parent}/.{name}{INTENT_SUFFIX}" if parent else f".{name}{INTENT_SUFFIX}"

    def _intent_path(self, rel: str) -> str:
        return self.path(self._intent_rel(rel))

    def intent(self, rel: str) -> dict[str, Any] | None:
        """The pending replacement of `rel` (`{"from": its complete copy, "writer": who wrote it}`), None when there
        is none; `{}` when its intent is torn (not JSON: written by an older writer that a full disk or a kill cut)."""
        try:
            body = json.loads(self.fs.cat_file(self._intent_path(rel)))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return {}
        return body if isinstance(body, dict) and isinstance(body.get("from"), str) else {}

    def settled_rel(self, rel: str) -> str:
        """Where `rel` can be read as it is once settled, without settling it (for a reader that only looks): the
        complete copy a pending replacement names, else `rel` itself."""
        body = self.intent(rel)
        if body:
            copy = f"{rel.strip('/').rpartition('/')[0]}/{body['from']}".lstrip("/")
            if self.exists(copy):
                return copy
        return rel

    def _roll_forward(self, rel: str, tmp: str, intent: str) -> None:
        """Replace `rel` by the complete copy `tmp` that `intent` names. The intent goes before `tmp` is touched, so
        while it exists `tmp` is complete: a kill anywhere here is finished by `settle`. The guard comes before each
        step: on an object store this is a delete and a copy of gigabytes, and a writer that lost its lease meanwhile
        (paused past it; its directory settled and replaced by the one that took over) must not delete the newer one."""
        self._guard()
        if self.fs.exists(self.path(rel)):
            self.fs.rm(self.path(rel), recursive=True)
        crash_point(f"put_dir:{rel}:removed")
        self._guard()
        if self.is_local:
            os.rename(tmp, self.path(rel))
        else:
            self.fs.copy(tmp, self.path(rel), recursive=True)
        crash_point(f"put_dir:{rel}:copied")
        self._guard()
        self.fs.rm(intent)
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)

    def settle_all(self, rel_dir: str) -> int:
        """`settle` every directory under `rel_dir` a killed writer left mid-replacement; returns how many."""
        p = self.path(rel_dir)
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(p, detail=False)] if self.fs.exists(p) else []
        pending = [n[1 : -len(INTENT_SUFFIX)] for n in names if n.startswith(".") and n.endswith(INTENT_SUFFIX)]
        return sum(self.settle(f"{rel_dir}/{name}") for name in pending)

    def settle(self, rel: str) -> bool:
        """Finish a replacement of `rel` that a killed writer left after its intent; True when there was one. Called
        by the next writer of `rel` (`put_dir`), and by a reader that owns it, before it reads: only by the owner,
        on a store guarded by its lease (`leases.settled` for the others)."""
        body = self.intent(rel)
        if body is None:
            return False
        intent = self._intent_path(rel)
        if not body:  # torn: it never finished, so nothing was replaced yet; its copy is a temporary, swept
            print(
                f"{self.fs.unstrip_protocol(intent)}: a torn intent (not JSON: a full disk or a kill while it was "
                f"written) is removed; {self.url_of(rel)} keeps the copy it had",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            self._guard()
            self.fs.rm(intent)
            return True
        tmp = f"{self.path(rel).rpartition('/')[0]}/{body['from']}"
        if self.fs.exists(tmp):
            self._roll_forward(rel, tmp, intent)
        else:  # the copy was in place and the intent not yet removed
            self._guard()
            self.fs.rm(intent)
        return True

    def wait_settled(self, rel: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> None:
        """Wait until no replacement of `rel` is pending: what a reader that does not own `rel` does, while its owner
        `settle`s it. Two settlers at once would race: one could remove the copy the other just moved in place."""
        deadline = time.monotonic() + timeout_s
        while (body := self.intent(rel)) is not None:
            if time.monotonic() > deadline:
                raise self.still_pending(rel, body, timeout_s)
            time.sleep(poll_s)

    def still_pending(self, rel: str, body: dict[str, Any], waited_s: float) -> StoreError:
        """The error of a reader that waited `waited_s` for the owner of `rel` to settle it, naming the intent's writer."""
        return StoreError(
            f"{self.url_of(rel)} is still mid-replacement after {waited_s:.0f}s "
            f"({self.fs.unstrip_protocol(self._intent_path(rel))} is there, written by "
            f"{body.get('writer') or 'an unknown writer'}): the process that owns it settles it before it reads"
        )

    def ensure_local_dir(self, rel: str, version: str | None = None, files: Collection[str] | None = None) -> Path:
        """A local directory holding `rel`: the directory itself on a local store, else a cached copy.

        Engines (transformers, vLLM) load models from local paths only. A copy is made once per `version` (what
        the caller knows the directory's content by): a directory rewritten in place under a new version is
        copied again, and the copies of its other versions are then removed; one copy per directory is kept.
        `files`: the paths inside `rel` to copy (a model's content files, never its `original/`); all when None.

        Ranks of one node asking at once copy it once: the copy is made under a lock beside it, the others wait for
        it and take it. The holder first removes the temporary copies of copiers that died (no one else copies).
        """
        local = self.local_path(rel)
        if local is not None:
            return local
        cache = self._cache_dir or Path(tempfile.gettempdir()) / "eagle3-store-cache"
        base = cache / hashlib.sha1(self.url.encode()).hexdigest()[:12] / rel.strip("/")
        target = base if version is None else base.with_name(f"{base.name}@{version}")
        base.parent.mkdir(parents=True, exist_ok=True)
        with open(base.parent / f".{base.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel when a holder dies
            if target.exists():
                return target
            for pattern in (f"{glob.escape(base.name)}{TMP_MARK}*", f"{glob.escape(base.name)}@*{TMP_MARK}*"):
                for dead in base.parent.glob(pattern):
                    shutil.rmtree(dead, ignore_errors=True)
            tmp = target.with_name(target.name + TMP_MARK + uuid.uuid4().hex[:8])
            tmp.mkdir()
            self._get_files(rel, tmp, files)
            crash_point(f"local_copy:{rel}:copied")
            tmp.rename(target)
            for old in base.parent.glob(f"{glob.escape(base.name)}@*"):
                if old != target and TMP_MARK not in old.name:
                    shutil.rmtree(old, ignore_errors=True)  # an engine still reading it keeps its open files
        return target

    def _get_files(self, rel: str, dest: Path, files: Collection[str] | None) -> None:
        """Copy `rel` (only `files` inside it, when given) into the local directory `dest`."""
        if files is None:
            self.fs.get(self.path(rel).rstrip("/") + "/", str(dest), recursive=True)
            return
        names = sorted(files)
        for name in names:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get([self.path(f"{rel}/{name}") for name in names], [str(dest / name) for name in names])

    # -- space ---------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Free space under the root, or None where it cannot be known (object stores, memory)."""
        if not self.is_local:
            return None
        p = Path(self.root)
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free
