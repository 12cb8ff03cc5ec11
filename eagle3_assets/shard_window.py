"""The rolling window of hidden-state shards (`training.mode: rolling`), kept in the store.

Training reads shards in key order (the tokenized rows are shuffled in rolling mode, so
each shard is a uniform slice of them) and extraction runs at most `window_shards`
shards ahead of it. Two records, each written atomically, decide what may be extracted,
trained and deleted, so any fsspec store (a shared volume, object storage) carries the
window between machines:

  hidden_states/<key>/_CHECK.json   the shard's integrity verdict, tied to the manifest it
                                    judged (a re-extracted shard is unchecked until its
                                    check runs again); written by the blocking check
  drafter/window/<key>.json         the shard was trained through step s, and checkpoint
                                    step_s holds it; written by the trainer after that
                                    checkpoint, marked released once the files are gone

For shard k the order is always: manifest, check record (passed), trained, checkpoint,
consumed record, sample files deleted, record marked released. A record never exists
without its checkpoint, and no sample file is deleted without a record: a kill between
any two steps leaves a state the trainer's next run completes (`Window.reconcile`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

from eagle3_assets.hidden_states.manifest import ShardManifest
from eagle3_assets.sample_file import SAMPLE_SUFFIX, check_record_path, manifest_path, sample_path, sample_row, shard_dir
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore

WINDOW_DIR = "drafter/window"

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


def consumed_path(key: str) -> str:
    return f"{WINDOW_DIR}/{key}.json"


def read_consumed(store: ArtifactStore) -> dict[str, ConsumedShard]:
    """Every consumed record in the store, by shard key."""
    out = {}
    for name in store.listdir(WINDOW_DIR):
        if name.endswith(".json"):
            record = ConsumedShard(**store.read_json(f"{WINDOW_DIR}/{name}"))
            out[record.shard] = record
    return out


def read_consumed_one(store: ArtifactStore, key: str) -> ConsumedShard | None:
    if not store.exists(consumed_path(key)):
        return None
    return ConsumedShard(**store.read_json(consumed_path(key)))


def record_consumed(store: ArtifactStore, key: str, *, step: int, checkpoint: str) -> ConsumedShard:
    """Record that `checkpoint` (already published) has learnt shard `key`; keeps an existing release."""
    old = read_consumed_one(store, key)
    if old is not None and old.step == step:
        return old
    record = ConsumedShard(key, step, checkpoint)
    store.write_json(consumed_path(key), asdict(record))
    return record


def sample_files(store: ArtifactStore, key: str) -> list[str]:
    """The shard's sample files (store-relative) still on disk."""
    return [f"{shard_dir(key)}/{n}" for n in store.listdir(shard_dir(key)) if sample_row(n) is not None]


def release(store: ArtifactStore, record: ConsumedShard) -> ConsumedShard:
    """Delete the consumed shard's sample files (its manifest and check record stay), then mark it released."""
    if record.released:
        return record
    files = sample_files(store, record.shard)
    freed = sum(store.size(f) for f in files)
    for f in files:
        store.remove(f)
    released = ConsumedShard(record.shard, record.step, record.checkpoint, True, freed, record.at)
    store.write_json(consumed_path(record.shard), asdict(released))
    return released


def shard_bytes_on_disk(store: ArtifactStore, key: str) -> int:
    return sum(store.size(f) for f in sample_files(store, key))


@dataclass(frozen=True)
class Window:
    """Which shards extraction may work on: the `size` shards after the consumed prefix of `keys`."""

    keys: tuple[str, ...]  # every shard, in training order
    consumed: dict[str, ConsumedShard]
    size: int

    @classmethod
    def read(cls, store: ArtifactStore, keys: Sequence[str], size: int) -> Window:
        return cls(tuple(keys), read_consumed(store), size)

    @property
    def consumed_count(self) -> int:
        """Shards consumed from the start of the order (training consumes them in order)."""
        n = 0
        while n < len(self.keys) and self.keys[n] in self.consumed:
            n += 1
        return n

    def admitted(self) -> list[str]:
        """The shards extraction may write now."""
        n = self.consumed_count
        return list(self.keys[n : n + self.size])

    def refusal(self, key: str) -> str | None:
        """Why shard `key` may not be extracted now, or None."""
        if key in self.consumed:
            c = self.consumed[key]
            state = "released" if c.released else "being released"
            return (
                f"shard {key} was trained (consumed at step {c.step}, {c.checkpoint}) and {state}: extracting it "
                "again would train nothing. To train from scratch, remove drafter/ from the store first"
            )
        if key not in self.admitted():
            return (
                f"shard {key} is outside the rolling window: training.window_shards={self.size} shards may be on "
                f"disk ahead of training, and the window now holds {self.admitted()}. It is admitted once training "
                "has consumed the shards before it (materialize `drafter`)"
            )
        return None


ShardState = Literal["missing", "extracted", "check failed", "checked", "consumed", "released"]


@dataclass(frozen=True)
class WindowStatus:
    """Where a rolling run stands, from the store alone: what the UI and the logs report."""

    states: dict[str, ShardState]  # every shard, in training order
    consumed_at: dict[str, int]  # step that learnt each consumed shard
    bytes_on_disk: int  # hidden states of shards not yet released (from their manifests)
    window_bytes: int  # what `size` shards of the mean extracted size take
    eta_s: float | None  # until the last shard is consumed, at the slower of the two measured rates

    def as_metadata(self) -> dict[str, float | int]:
        counts = {state: list(self.states.values()).count(state) for state in ("released", "consumed", "checked")}
        return {
            "shards_total": len(self.states),
            "shards_consumed": counts["released"] + counts["consumed"],
            "shards_on_disk": sum(s in ("extracted", "checked", "check failed", "consumed") for s in self.states.values()),
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


def window_status(store: ArtifactStore, keys: Sequence[str], size: int) -> WindowStatus:
    consumed = read_consumed(store)
    states: dict[str, ShardState] = {}
    manifests: dict[str, ShardManifest] = {}
    for key in keys:
        # One read of each manifest: its figures and the digest its check record must match.
        raw = store.read_bytes(manifest_path(key)) if store.exists(manifest_path(key)) else None
        if raw is not None:
            manifests[key] = ShardManifest.from_json(json.loads(raw))
        if key in consumed:
            states[key] = "released" if consumed[key].released else "consumed"
        elif raw is None:
            states[key] = "missing"
        else:
            verdict = check_verdict(store, key, hashlib.sha256(raw).hexdigest())
            states[key] = {"passed": "checked", "failed": "check failed", "unchecked": "extracted"}[verdict]
    sizes = [m.bytes for m in manifests.values()]
    on_disk = sum(manifests[k].bytes for k, st in states.items() if st != "released" and k in manifests)
    extracted_at = [datetime.fromisoformat(m.created) for m in manifests.values()]
    trained_at = [datetime.fromisoformat(c.at) for c in consumed.values()]
    extract_rate, train_rate = _rate(extracted_at), _rate(trained_at)
    eta = None
    if train_rate:
        to_train = sum(st not in ("consumed", "released") for st in states.values()) / train_rate
        to_extract = sum(st == "missing" for st in states.values()) / extract_rate if extract_rate else 0.0
        # The pass ends when the slower side does: the last shard is extracted, then trained.
        eta = max(to_train, to_extract + 1 / train_rate) if to_train else 0.0
    return WindowStatus(
        states=states,
        consumed_at={k: c.step for k, c in consumed.items()},
        bytes_on_disk=on_disk,
        window_bytes=size * (sum(sizes) // len(sizes)) if sizes else 0,
        eta_s=eta,
    )
