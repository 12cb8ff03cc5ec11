"""One owner per artifact, recorded in the store itself: a lease file beside what it guards.

Works on any fsspec store (local disk, a shared volume, object storage), so it also holds between
two `$DAGSTER_HOME`s, two nodes or two start commands that share only the store. The lease file
(`<dir>/_LEASE.json`) names its holder: host, pid, run id, since when, when last renewed, and a
token. A heartbeat thread renews it every `heartbeat_s`; another process takes it over only once
it is `expiry_s` old, or at once when the holder is a process of the same machine that is gone
(a rerun right after a SIGKILL need not wait out the expiry).

fsspec stores have no compare-and-swap, so taking a lease is: write it (atomically, by rename),
wait `settle_s` (2 s on object stores, 0.5 s on a filesystem path or in memory, where a write shows
at once), read it back; the taker whose token is read back holds it, the other refuses.
Two takers within one settle window both see the later writer's token, so one of them wins. The
holder checks before every write it publishes (`Lease.check`, the store's write guard): the file
must still carry its token, and its own last renewal must be younger than `expiry_s`, so a holder
that was frozen (SIGSTOP, a swapped-out VM) past the expiry writes nothing more on waking, even
before it has read who took over. A renewal the frozen holder had in flight may still land after the takeover
(no compare-and-swap can stop it): the taker finds its predecessor's expired lease back in the file and takes it
back the same way. docs/OPERATING.md, "Leases", sets the values against the
store's latency.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from eagle3_assets.crash_points import crash_point
from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.processes import machine_id, process_alive
from eagle3_assets.storage import ArtifactStore, StoreError

LEASE_FILE = "_LEASE.json"
RUN_ID_ENV = "EAGLE3_RUN_ID"  # the Dagster run a process works for, named in the leases it takes
EXPIRY_S = 60.0
HEARTBEAT_S = 10.0
SETTLE_S = 2.0  # object stores: the delay within which every reader sees a write
LOCAL_SETTLE_S = 0.5  # a filesystem path or memory, which show a write at once: the gap between a taker's read and write
READ_EVERY_S = 1.0


def _clock() -> float:
    """Seconds that go on through a system suspend (CLOCK_BOOTTIME), where the platform has it: a holder suspended
    past the expiry must know it on waking, before it writes; `time.monotonic` stops while suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    since: float  # epoch seconds
    renewed: float
    token: str
    machine: str  # host and boot (`processes.machine_id`): where `pid` means something

    def gone(self) -> bool:
        """Known dead: a process of this machine and boot that no longer runs (a SIGKILL, an OOM kill)."""
        return self.machine == machine_id() and not process_alive(self.pid, started_by=self.since)

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, run {self.run_id or '(none)'}, since {since}"


class LeaseHeld(Refusal):
    """Another live process holds the lease: a retry would meet it again."""


class LeaseLost(Eagle3Error):
    """This process held the lease and lost it (it expired, another took it over): it writes nothing more."""

    retryable = False


class Lease:
    """The lease on `rel_dir` for `run_id`; `acquire()` takes it or refuses, `release()` gives it back."""

    def __init__(
        self,
        store: ArtifactStore,
        rel_dir: str,
        run_id: str = "",
        *,
        expiry_s: float = EXPIRY_S,
        heartbeat_s: float = HEARTBEAT_S,
        settle_s: float | None = None,
    ):
        if heartbeat_s * 2 > expiry_s:
            raise ValueError(f"a heartbeat every {heartbeat_s:g}s must fit twice in the {expiry_s:g}s expiry")
        self.store, self.rel = store, f"{rel_dir.rstrip('/')}/{LEASE_FILE}"
        if settle_s is None:
            settle_s = LOCAL_SETTLE_S if store.shows_writes_at_once else SETTLE_S
        self.expiry_s, self.heartbeat_s, self.settle_s = expiry_s, heartbeat_s, settle_s
        now = time.time()
        self.me = Holder(socket.gethostname(), os.getpid(), run_id, now, now, uuid.uuid4().hex, machine_id())
        self._renewed_at = 0.0  # _clock() of this holder's last renewal
        self._read_at = 0.0  # _clock() of check()'s last read of the file
        self._lost: str | None = None
        self._superseded: str | None = None  # the token of the expired holder this one took over from
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def what(self) -> str:
        return self.store.url_of(self.rel.rsplit("/", 1)[0])

    def read(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.store.read_text(self.rel)))
        except (StoreError, FileNotFoundError, ValueError, TypeError):
            return None  # absent, or torn by a writer on a store without atomic rename: nobody's

    def _expired(self, holder: Holder) -> bool:
        return time.time() - holder.renewed >= self.expiry_s or holder.gone()

    def _refuse(self, holder: Holder) -> LeaseHeld:
        return LeaseHeld(
            f"{self.what} is held by another process ({holder.describe()}; renewed "
            f"{time.time() - holder.renewed:.0f}s ago): stop that one, or wait {self.expiry_s:g}s after it died"
        )

    def acquire(self) -> Lease:
        current = self.read()
        if current is not None and current.token != self.me.token and not self._expired(current):
            raise self._refuse(current)
        back = self._write_and_read_back()
        if back is None or back.token != self.me.token:
            raise self._refuse(back or current or self.me)
        self._superseded = current.token if current is not None else None
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.rel}", daemon=True)
        self._beat.start()
        return self

    def _write(self) -> None:
        self.me = Holder(**{**asdict(self.me), "renewed": time.time()})
        self.store.write_json(self.rel, asdict(self.me))

    def _write_and_read_back(self) -> Holder | None:
        """Take the lease as fsspec stores allow (no compare-and-swap): write it, wait `settle_s`, read it back. Who is
        read back holds it; when it is this process, its renewal clock starts from before the write."""
        wrote_at = _clock()
        self._write()
        try:
            crash_point(f"lease:{self.rel}:settling")
            time.sleep(self.settle_s)
            back = self.read()
        except BaseException:  # a stop signal while it settles: no lease file of a process that is leaving
            if (mine := self.read()) is not None and mine.token == self.me.token:
                self.store.remove(self.rel)
            raise
        if back is not None and back.token == self.me.token:
            self._renewed_at = wrote_at
        return back

    def _renew(self) -> None:
        """One renewal. Reading the file and writing it are two steps (no compare-and-swap): a renewal delayed
        between them past the point where a taker may have read its own lease back (`expiry_s - settle_s` after this
        holder's last renewal) would land over the taker's, so it is not written, and this holder has lost."""
        self.check(read=True)  # never renew over a taker's lease
        wrote_at = _clock()
        if (age := wrote_at - self._renewed_at) >= self.expiry_s - self.settle_s:
            self._lost = f"its renewal came {age:.0f}s after the last, too late to write safely ({self.expiry_s:g}s expiry)"
            self.check()
        self._write()
        self._renewed_at = wrote_at  # counted from before the write: the expiry errs early

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._renew()
            except LeaseLost as e:  # said now, not only at the holder's next write
                print(f"{e}", file=sys.stderr, flush=True)
                return
            except (Eagle3Error, OSError):
                continue  # the store did not answer this time; check() decides when that is too long

    def check(self, *, read: bool = False) -> None:
        """Raise `LeaseLost` unless this process still holds the lease: call it before every write. The file is
        read at most every READ_EVERY_S (a shard's release deletes thousands of files); the age of this holder's
        own last renewal is checked every time, so no write goes out after an expiry it slept through."""
        if self._lost is None:
            now = _clock()
            age = now - self._renewed_at
            if age >= self.expiry_s:
                self._lost = f"its last renewal was {age:.0f}s ago, past the {self.expiry_s:g}s expiry"
            elif read or now - self._read_at >= READ_EVERY_S:
                holder = self.read()
                self._read_at = now
                if holder is not None and holder.token == self._superseded and self._expired(holder):
                    self._reassert(holder)
                elif holder is None or holder.token != self.me.token:
                    self._lost = _taken_over(holder)
        if self._lost is not None:
            raise LeaseLost(f"{self.what}: this process ({self.me.describe()}) lost its lease: {self._lost}; it writes nothing more")

    def _reassert(self, late: Holder) -> None:
        """The holder this one took over from was frozen with a renewal in flight, which landed after the takeover. Its
        content is past the expiry, so that holder's own clock has stopped it (`check`): it writes nothing more, and
        this one takes its lease back the way it took it, by writing and reading back."""
        back = self._write_and_read_back()
        if back is None or back.token != self.me.token:
            self._lost = _taken_over(back)
        else:
            print(f"lease {self.what}: a renewal of {late.describe()}, in flight when it froze, landed after this "
                  "process took over; taken back", file=sys.stderr, flush=True)  # fmt: skip

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            # A renewal stuck in the store (a hung object-store request) must not hang the holder's exit; its write
            # may still land, so the file is left to expire rather than removed under it.
            self._beat.join(timeout=self.expiry_s)
            if self._beat.is_alive():
                print(f"lease {self.what}: a renewal is still writing after {self.expiry_s:g}s; not released, it "
                      f"expires {self.expiry_s:g}s after it lands", file=sys.stderr, flush=True)  # fmt: skip
                return
        holder = self.read()
        if self._lost is None and holder is not None and holder.token == self.me.token:
            self.store.remove(self.rel)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        try:
            self.release()
        except (Eagle3Error, OSError) as e:
            if exc is None:
                raise
            # What is leaving (a stop, a failure) says more than a lease file left to expire: it goes on, named.
            print(f"lease {self.what}: not released ({e}); it expires {self.expiry_s:g}s after its last renewal",
                  file=sys.stderr, flush=True)  # fmt: skip


def _taken_over(holder: Holder | None) -> str:
    return "taken over by " + (holder.describe() if holder else "nobody (its lease file is gone)")


def settled(store: ArtifactStore, rel: str, owner_dir: str, *, timeout_s: float = 600.0, poll_s: float = 5.0,
            **lease: float) -> None:  # fmt: skip
    """Make `rel` safe to read for a process that does not own it (`storage.ArtifactStore.settle`): while the owner's
    lease (at `owner_dir`) is held, wait for the owner to finish the replacement; once nobody holds it (the writer was
    killed), take the lease, settle `rel` under it and give it back, so that two settlers never race. Nothing to do,
    and no lease taken, when no replacement is pending."""
    deadline = time.monotonic() + timeout_s
    while (body := store.intent(rel)) is not None:
        try:
            with Lease(store, owner_dir, os.environ.get(RUN_ID_ENV, ""), **lease) as held:
                store.guarded(held.check, held.me.describe()).settle(rel)
            return
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise store.still_pending(rel, body, timeout_s) from None
            time.sleep(poll_s)
