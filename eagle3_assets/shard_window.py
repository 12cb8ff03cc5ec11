"""The rolling window of hidden-state shards (`training.mode: rolling`), kept in the store.

Training reads shards in key order (the tokenized rows are shuffled in rolling mode, so
each shard is a uniform slice of them) and extraction runs at most `window_shards`
shards ahead of it. Records, each written atomically, decide what may be extracted,
trained and deleted, so any fsspec store (a shared volume, object storage) carries the
window between machines:

  hidden_states/<key>/_CHECK.json   the shard's integrity verdict, tied to the manifest it
                                    judged (a re-extracted shard is unchecked until its
                                    check runs again); written by the blocking check
  <family root>/drafter/window/<key>.json
                                    the family's drafter trained the shard through step s,
                                    and its checkpoint step_s holds it; written by that
                                    family's trainer after that checkpoint, marked released
                                    once the files are gone. EAGLE-3's at `drafter/window/`
                                    (where it always was), DFlash's under `families/dflash/`

Every family in `settings.drafters` trains from the one window, each in a trainer of its own,
and each writes only its own records. A shard's sample files are deleted once every family has
recorded it, by whichever trainer records it last (each reads the others' records after writing
its own, so of two that finish at once at least one sees both), and until then the shard counts
as inside the window: at most `window_shards` complete shards are ever on disk.

For shard k and each family the order is always: manifest, check record (passed), trained,
checkpoint, the family's consumed record; then, once every family's record exists, sample files
deleted, the releasing family's record marked released. A record never exists without its
checkpoint, and no sample file is deleted before every family has its record: a kill of any
trainer between any two steps leaves a state that trainer's next run completes
(`ShardWindow.reconcile`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

from eagle3_assets.families import EAGLE3, family_spec
from eagle3_assets.hidden_states.manifest import ShardManifest
from eagle3_assets.sample_file import SAMPLE_SUFFIX, check_record_path, manifest_path, sample_path, sample_row, shard_dir
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore

WINDOW_DIR = "drafter/window"  # under each family's root (`FamilySpec.root`)

Verdict = Literal["passed", "failed", "unchecked"]


def _manifest_digest(store: ArtifactStore, key: str) -> str | None:
    if not store.exists(manifest_path(key)):
        return None
    return hashlib.sha256(store.read_bytes(manifest_path(key))).hexdigest()


def write_check_record(store: ArtifactStore, key: str, *, passed: bool, problems: int) -> None:
    """Record the check's verdict on the shard as its manifest now stands."""
    store.write_json(
        check_record_path(key),
        {"passed": passed, "problems": problems, "manifest_sha256": _manifest_digest(store, key)},
    )


def check_verdict(store: ArtifactStore, key: str, manifest_digest: str | None = None) -> Verdict:
    """The recorded verdict on the shard's current manifest; `unchecked` when there is none for it.
    `manifest_digest`: the manifest's sha256 when the caller has read it already."""
    if not store.exists(check_record_path(key)):
        return "unchecked"
    record = store.read_json(check_record_path(key))
    digest = manifest_digest or _manifest_digest(store, key)
    if digest is None or record.get("manifest_sha256") != digest:
        return "unchecked"
    return "passed" if record.get("passed") else "failed"


def lost_sample_files(store: ArtifactStore, key: str) -> str | None:
    """How shard `key`'s sample files differ from what its manifest recorded (a file gone, bytes changed since), or
    None. One listing, no file read: cheap enough before every shard is trained, where a check passed long ago."""
    rows = Shard.parse(key).rows
    sizes = store.sizes(shard_dir(key))
    if missing := [r for r in rows if f"{r}{SAMPLE_SUFFIX}" not in sizes]:
        return f"{len(missing)} of {len(rows)} sample files are gone, the first {store.url_of(sample_path(key, missing[0]))}"
    manifest = ShardManifest.read(store, key)
    recorded = None if manifest is None else manifest.bytes
    held = sum(sizes[f"{r}{SAMPLE_SUFFIX}"] for r in rows)
    if recorded is not None and held != recorded:
        return f"its sample files hold {held:,} bytes, its manifest recorded {recorded:,}: a file changed after the check"
    return None


@dataclass(frozen=True)
class ConsumedShard:
    """Shard `shard` was trained through optimizer step `step`, held by checkpoint `checkpoint`."""

    shard: str
    step: int
    checkpoint: str
    released: bool = False  # its sample files are deleted
    bytes_released: int = 0
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))  # when recorded


def window_dir(family: str = EAGLE3.name) -> str:
    """Where `family`'s consumed records live (store-relative)."""
    return f"{family_spec(family).root}/{WINDOW_DIR}".lstrip("/")


def consumed_path(key: str, family: str = EAGLE3.name) -> str:
    return f"{window_dir(family)}/{key}.json"


def read_consumed(store: ArtifactStore, family: str = EAGLE3.name) -> dict[str, ConsumedShard]:
    """Every consumed record of `family` in the store, by shard key."""
    out = {}
    for name in store.listdir(window_dir(family)):
        if name.endswith(".json"):
            record = ConsumedShard(**store.read_json(f"{window_dir(family)}/{name}"))
            out[record.shard] = record
    return out


def read_consumed_one(store: ArtifactStore, key: str, family: str = EAGLE3.name) -> ConsumedShard | None:
    if not store.exists(consumed_path(key, family)):
        return None
    return ConsumedShard(**store.read_json(consumed_path(key, family)))


def record_consumed(
    store: ArtifactStore, key: str, *, step: int, checkpoint: str, family: str = EAGLE3.name
) -> ConsumedShard:
    """Record that `family`'s `checkpoint` (already published) has learnt shard `key`; keeps an existing release."""
    old = read_consumed_one(store, key, family)
    if old is not None and old.step == step:
        return old
    record = ConsumedShard(key, step, checkpoint)
    store.write_json(consumed_path(key, family), asdict(record))
    return record


@dataclass(frozen=True)
class Consumption:
    """Shard `shard` as the families that train from the window recorded it."""

    shard: str
    records: dict[str, ConsumedShard]  # by family: those that consumed it
    families: tuple[str, ...]  # every family that must consume it before it is released (`settings.drafters`)

    @property
    def complete(self) -> bool:
        """Every family consumed it: it is out of the window, and its files are (being) released."""
        return all(f in self.records for f in self.families)

    @property
    def waiting_for(self) -> list[str]:
        return [f for f in self.families if f not in self.records]

    @property
    def released(self) -> bool:
        """Its sample files are deleted (the releasing family marked its own record)."""
        return any(r.released for r in self.records.values())

    @property
    def step(self) -> int:
        """The step that learnt it, of the first family (in `settings.drafters` order) that consumed it."""
        return next(self.records[f].step for f in self.families if f in self.records)

    def describe(self) -> str:
        """`consumed at step s, <checkpoint>`; with several families, each family's."""
        if tuple(self.records) == self.families == (self.families[0],):
            c = self.records[self.families[0]]
            return f"consumed at step {c.step}, {c.checkpoint}"
        return "consumed by " + ", ".join(
            f"{f} at step {self.records[f].step} ({self.records[f].checkpoint})"
            for f in self.families
            if f in self.records
        )


def read_consumption(store: ArtifactStore, families: Sequence[str] = (EAGLE3.name,)) -> dict[str, Consumption]:
    """Every shard any of `families` consumed, by key, with each family's record."""
    by_family = {f: read_consumed(store, f) for f in families}
    keys = sorted({k for records in by_family.values() for k in records})
    return {
        k: Consumption(k, {f: by_family[f][k] for f in families if k in by_family[f]}, tuple(families)) for k in keys
    }


def consumed_by_all(store: ArtifactStore, families: Sequence[str] = (EAGLE3.name,)) -> dict[str, Consumption]:
    """The shards every one of `families` consumed: out of the window, their sample files (being) released."""
    return {k: c for k, c in read_consumption(store, families).items() if c.complete}


def sample_files(store: ArtifactStore, key: str) -> list[str]:
    """The shard's sample files (store-relative) still on disk."""
    return [f"{shard_dir(key)}/{n}" for n in store.listdir(shard_dir(key)) if sample_row(n) is not None]


def release(store: ArtifactStore, record: ConsumedShard, family: str = EAGLE3.name) -> ConsumedShard:
    """Delete the consumed shard's sample files (its manifest and check record stay), then mark `family`'s record
    released. Only once every family consumed the shard (`release_when_consumed`)."""
    if record.released:
        return record
    sizes = store.sizes(shard_dir(record.shard))
    freed = 0
    for name, size in sizes.items():
        if sample_row(name) is None:
            continue
        try:
            store.remove(f"{shard_dir(record.shard)}/{name}")
            freed += size
        except FileNotFoundError:
            pass  # another family's trainer, releasing the shard at the same moment, deleted it first
    released = ConsumedShard(record.shard, record.step, record.checkpoint, True, freed, record.at)
    store.write_json(consumed_path(record.shard, family), asdict(released))
    return released


def release_when_consumed(
    store: ArtifactStore, record: ConsumedShard, family: str, families: Sequence[str]
) -> tuple[ConsumedShard, list[str]]:
    """The release rule, for `family` that has just recorded `record`: the shard's files are deleted once every one of
    `families` has a record of it. Returns `family`'s record (released or not) and the families it still waits for.
    Each trainer writes its own record before it reads the others', so when two finish the shard at once at least one
    of them sees both records and releases it."""
    waiting = [f for f in families if f != family and read_consumed_one(store, record.shard, f) is None]
    if waiting:
        return record, waiting
    return release(store, record, family), []


def start_over(store: ArtifactStore, keys: Sequence[str], family: str = EAGLE3.name) -> list[str]:
    """A new run of `family` (a fresh pass, not the resumption of one) is about to train `keys`: records of them are
    another run's, and would keep the window from admitting them. Removes `family`'s records of `keys`; a shard whose
    sample files are gone (released) also loses its manifest and check record, so it reads as not extracted, the
    window admits it in turn and the backfill extracts it again. Other families' records stay (a shard is released
    once each consumed it). Returns the keys whose records were removed."""
    removed = []
    for key in keys:
        if not store.exists(consumed_path(key, family)):
            continue
        if store.exists(manifest_path(key)) and lost_sample_files(store, key) is not None:
            store.remove(check_record_path(key))  # first: a manifest never stands with a passed check on lost files
            store.remove(manifest_path(key))
        store.remove(consumed_path(key, family))
        removed.append(key)
    return removed


def shard_bytes_on_disk(store: ArtifactStore, key: str) -> int:
    return sum(store.size(f) for f in sample_files(store, key))


@dataclass(frozen=True)
class Window:
    """Which shards extraction may work on: the `size` shards after the prefix of `keys` every family consumed."""

    keys: tuple[str, ...]  # every shard, in training order
    consumed: dict[str, Consumption]  # shards any family consumed
    size: int
    families: tuple[str, ...] = (EAGLE3.name,)  # every family training from the window (`settings.drafters`)

    @classmethod
    def read(cls, store: ArtifactStore, keys: Sequence[str], size: int, families: Sequence[str] = (EAGLE3.name,)) -> Window:
        return cls(tuple(keys), read_consumption(store, families), size, tuple(families))

    def done(self, key: str) -> bool:
        """Every family consumed shard `key`: it is out of the window."""
        c = self.consumed.get(key)
        return c is not None and c.complete

    @property
    def consumed_count(self) -> int:
        """Shards consumed by every family from the start of the order (each family consumes them in order)."""
        n = 0
        while n < len(self.keys) and self.done(self.keys[n]):
            n += 1
        return n

    def admitted(self) -> list[str]:
        """The shards extraction may write now."""
        n = self.consumed_count
        return list(self.keys[n : n + self.size])

    def refusal(self, key: str) -> str | None:
        """Why shard `key` may not be extracted now, or None."""
        if self.done(key):
            c = self.consumed[key]
            state = "released" if c.released else "being released"
            return (
                f"shard {key} was trained ({c.describe()}) and {state}: extracting it again would train nothing. "
                "A run that trains from scratch clears its window records as it starts, and the window then admits "
                "the shard again"
            )
        if key not in self.admitted():
            by = (
                "training has consumed the shards before it"
                if len(self.families) == 1
                else f"every drafter family ({', '.join(self.families)}) has consumed the shards before it"
            )
            assets = ", ".join(f"`{family_spec(f).drafter_asset}`" for f in self.families)
            return (
                f"shard {key} is outside the rolling window: training.window_shards={self.size} shards may be on "
                f"disk ahead of training, and the window now holds {self.admitted()}. It is admitted once {by} "
                f"(materialize {assets})"
            )
        return None


# "partly consumed": some families consumed it, its files stay for the others.
ShardState = Literal["missing", "extracted", "check failed", "checked", "partly consumed", "consumed", "released"]


@dataclass(frozen=True)
class WindowStatus:
    """Where a rolling run stands, from the store alone: what the UI and the logs report."""

    states: dict[str, ShardState]  # every shard, in training order
    consumed_at: dict[str, dict[str, int]]  # step that learnt each consumed shard, by family
    bytes_on_disk: int  # hidden states of shards not yet released (from their manifests)
    window_bytes: int  # what `size` shards of the mean extracted size take
    eta_s: float | None  # until the last shard is consumed, at the slower of the two measured rates
    families: tuple[str, ...] = (EAGLE3.name,)

    def as_metadata(self) -> dict[str, float | int]:
        counts = {state: list(self.states.values()).count(state) for state in ("released", "consumed", "checked")}
        on_disk = ("extracted", "checked", "check failed", "partly consumed", "consumed")
        per_family = (
            {f"shards_consumed_{f}": sum(f in c for c in self.consumed_at.values()) for f in self.families}
            if len(self.families) > 1
            else {}
        )
        return {
            "shards_total": len(self.states),
            "shards_consumed": counts["released"] + counts["consumed"],
            **per_family,
            "shards_on_disk": sum(s in on_disk for s in self.states.values()),
            "hidden_state_bytes_on_disk": self.bytes_on_disk,
            "window_bytes": self.window_bytes,
            **({"eta_s": round(self.eta_s, 1)} if self.eta_s is not None else {}),
        }


def _rate(times: list[datetime]) -> float | None:
    """Events per second over the span of `times` (None before two of them)."""
    if len(times) < 2:
        return None
    span = (max(times) - min(times)).total_seconds()
    return (len(times) - 1) / span if span > 0 else None


def window_status(
    store: ArtifactStore, keys: Sequence[str], size: int, families: Sequence[str] = (EAGLE3.name,)
) -> WindowStatus:
    consumed = read_consumption(store, families)
    states: dict[str, ShardState] = {}
    manifests: dict[str, ShardManifest] = {}
    for key in keys:
        # One read of each manifest: its figures and the digest its check record must match.
        raw = store.read_bytes(manifest_path(key)) if store.exists(manifest_path(key)) else None
        if raw is not None:
            manifests[key] = ShardManifest.from_json(json.loads(raw))
        if key in consumed and consumed[key].complete:
            states[key] = "released" if consumed[key].released else "consumed"
        elif key in consumed:
            states[key] = "partly consumed"
        elif raw is None:
            states[key] = "missing"
        else:
            verdict = check_verdict(store, key, hashlib.sha256(raw).hexdigest())
            states[key] = {"passed": "checked", "failed": "check failed", "unchecked": "extracted"}[verdict]
    sizes = [m.bytes for m in manifests.values()]
    on_disk = sum(manifests[k].bytes for k, st in states.items() if st != "released" and k in manifests)
    extracted_at = [datetime.fromisoformat(m.created) for m in manifests.values()]
    # A shard leaves the window when its last family consumes it.
    trained_at = [
        max(datetime.fromisoformat(r.at) for r in c.records.values()) for c in consumed.values() if c.complete
    ]
    extract_rate, train_rate = _rate(extracted_at), _rate(trained_at)
    eta = None
    if train_rate:
        to_train = sum(st not in ("consumed", "released") for st in states.values()) / train_rate
        to_extract = sum(st == "missing" for st in states.values()) / extract_rate if extract_rate else 0.0
        # The pass ends when the slower side does: the last shard is extracted, then trained.
        eta = max(to_train, to_extract + 1 / train_rate) if to_train else 0.0
    return WindowStatus(
        states=states,
        consumed_at={k: {f: r.step for f, r in c.records.items()} for k, c in consumed.items()},
        bytes_on_disk=on_disk,
        window_bytes=size * (sum(sizes) // len(sizes)) if sizes else 0,
        eta_s=eta,
        families=tuple(families),
    )
