"""Continue the released drafter on appended rows, or train from scratch, and why (docs/DESIGN.md §5).

Every export carries what it was trained on (`trained_on.json`, written in the export's one publish and copied
with it into the release): its family, the versions of the target and of the vocab map, the settings that shape
the model and the loss, and each shard's rows digest. `continuation_plan` compares the release's with what this
run would train on: when they differ only by added shards, the drafter warm-starts from the release's weights and
trains on the new rows plus a replay sample of old ones (`sources.continued_data`), for `training.continue_fraction`
of a from-scratch run's steps; in rolling mode, one pass over the new shards with rows replayed from the reservoir the
release's run kept as it released its shards (`sources.rolling_data`, `rolling.REPLAY_DIR`). Anything else trains from
scratch, naming the first difference.

A release imported from a published drafter (`imported_release.py`) trained on none of this store's shards: it is
continued on every shard (none replayed, the held-out rows drawn as a from-scratch run draws them) when it is of this
family, for this target, and its weights load exactly into the drafter the family builds, on the store's vocab map
(which adopts the import's own); otherwise the plan names each difference.

With several families in rolling mode, the release is one family's; a family that did not win it continues its own
last export instead (`plan_continuation`), when that differs from now only by added shards: trained from scratch it
would clear its window records, every released shard would be extracted again, and the window, which admits shards
once every family consumed those before them, would keep the continuing family's new shard out (issue 52, item 6).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
from eagle3_assets.drafter.release import PROMOTION_LEASE_DIR, RELEASE_DIR, export_digest
from eagle3_assets.families import FamilySpec
from eagle3_assets.leases import settled
from eagle3_assets.provenance import settings_read
from eagle3_assets.release_record import ReleaseRecord, read_release_record
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore

# The training settings that shape what the model is and what its loss asks of it, for every family. The schedule
# (epochs, steps, lr, warmup, batches, evaluation, checkpoints) is not among them: a continuation has its own.
# `heldout_rows` and `seed` choose the held-out rows: with either changed, rows the release trained on could be
# held out now, and its figures would flatter it.
MODEL_LOSS = ("train_lm_head", "loss", "loss_positions", "heldout_rows", "seed")


def model_loss_settings(
    settings: Settings, family: FamilySpec, family_fingerprint: Mapping[str, Any]
) -> dict[str, Any]:
    """What a continued drafter must share with the release besides its data: the family's own settings, the
    training settings that shape model and loss, and how the shards' features were extracted."""
    fields = MODEL_LOSS + family.training_fields
    return {
        **({"family": dict(family_fingerprint)} if family_fingerprint else {}),
        "training": {f: getattr(settings.training, f) for f in fields},
        # Every setting the shards are extracted with (`vllm.dtype` and `vllm.extra_args` when vLLM extracts, left
        # out at their defaults as in provenance): a release is never continued on features extracted otherwise.
        **settings_read("hidden_states", settings),
    }


def trained_on(
    *, family: str, target: str, vocab_map: str, settings: dict[str, Any], shards: Mapping[str, str],
    continued_from: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The `trained_on.json` body: `shards` is {shard key: rows digest}, in training order."""
    return {
        "family": family,
        "target": target,
        "vocab_map": vocab_map,
        "settings": json.loads(json.dumps(settings)),  # as it reads back: lists, not tuples
        "shards": dict(shards),
        "continued_from": continued_from,
    }


@dataclass(frozen=True)
class ContinuationPlan:
    continues: bool
    reason: str  # why it trains from scratch; empty when it continues
    release_sha256: str = ""
    old_shards: list[str] = field(default_factory=list)  # the release's, in its order
    new_shards: list[str] = field(default_factory=list)
    base: str = RELEASE_DIR  # the weights it continues (store-relative): the release, or the family's own export
    imported: dict[str, Any] = field(default_factory=dict)  # an imported release's source, format and sha256


def _differences(released: Any, now: Any, prefix: str) -> list[str]:
    """Each leaf where the release's record and this run's differ, as "settings.training.loss: release 'kl', now
    'soft_ce'" (the form of `fingerprint.differences`)."""
    if isinstance(released, dict) and isinstance(now, dict):
        out = []
        for k in sorted(set(released) | set(now)):
            out += _differences(released.get(k), now.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if released == now else [f"{prefix}: release {released!r}, now {now!r}"]


def continuation_plan(
    release: ReleaseRecord | None, released_on: Mapping[str, Any] | None, now: Mapping[str, Any],
    import_differences: Sequence[str] | None = None,
) -> ContinuationPlan:  # fmt: skip
    """Continue from the release (`release.json`, its `trained_on.json`) or train from scratch, and why: continue
    only when the release is of this family, for this target, on this vocab map, with the same model and loss
    settings, every shard it trained on is still a shard with the same rows, and at least one shard is new. In
    rolling mode too: the row plan keeps every old row in its shard and puts appended rows in new shards
    (`tokenized.plan_rows`), and the release's shards are compared by their rows' digests, not their files (released)."""

    def scratch(reason: str) -> ContinuationPlan:
        return ContinuationPlan(False, reason)

    if release is None:
        return scratch("nothing is released")
    if release.imported:
        return imported_plan(release, now, import_differences)
    if released_on is None:
        return scratch(
            f"the release has no {TRAINED_ON_FILE} (released before exports recorded what they were trained on)"
        )
    if released_on.get("family") != now["family"]:
        return scratch(f"family: release {released_on.get('family')!r}, now {now['family']!r}")
    for name in ("target", "vocab_map"):
        if released_on.get(name) != now[name]:
            why = " (a head is never continued on a map it was not trained with)" if name == "vocab_map" else ""
            return scratch(f"{name}: release {released_on.get(name)!r}, now {now[name]!r}{why}")
    if diffs := _differences(released_on.get("settings"), now["settings"], "settings"):
        return scratch(diffs[0])
    old: dict[str, str] = dict(released_on.get("shards") or {})
    shards: dict[str, str] = dict(now["shards"])
    for key, rows in old.items():
        if key not in shards:
            return scratch(f"shard {key}: the release trained on it, it is no longer a shard")
        if shards[key] != rows:
            return scratch(f"shard {key}: rows changed, not appended (rows digest: release {rows}, now {shards[key]})")
    new = [k for k in shards if k not in old]
    if not new:
        return scratch("no shard was added since the release")
    return ContinuationPlan(True, "", release.export_sha256, list(old), new)


def imported_plan(release: ReleaseRecord, now: Mapping[str, Any], differences: Sequence[str] | None) -> ContinuationPlan:
    """Continue an imported release on every shard (module docstring), or train from scratch naming why;
    `differences`: how it differs from the drafter the family builds (`Family.import_differences`)."""
    imported = release.imported
    what = f"the release is imported from {imported.get('source')} ({imported.get('format')} format)"
    if release.family != now["family"]:
        return ContinuationPlan(False, f"family: release {release.family!r}, now {now['family']!r} ({what})")
    if release.target != now["target"]:
        return ContinuationPlan(False, f"target: release {release.target!r}, now {now['target']!r} ({what})")
    if differences is None or differences:
        found = "; ".join(differences) if differences else "not compared with the drafter this family builds"
        return ContinuationPlan(False, f"{what}, and its weights do not load into the drafter trained now: {found}")
    if not now["shards"]:
        return ContinuationPlan(False, f"{what}, and there is no shard to continue it on")
    provenance = {k: imported.get(k) for k in ("source", "format", "sha256")}
    return ContinuationPlan(True, "", release.export_sha256, [], list(now["shards"]), imported=provenance)


def read_release(store: ArtifactStore, *, owner: bool = True) -> tuple[ReleaseRecord | None, dict[str, Any] | None]:
    """(the release's record, its trained_on.json), each None when absent. A replacement a kill interrupted is
    finished first, never read half done, by its owner (the promotion: `leases.settled`), or by one process of a
    training job (`owner`, rank 0) in its stead when no promotion lives; the others wait for it."""
    if owner:
        settled(store, RELEASE_DIR, PROMOTION_LEASE_DIR)
    else:
        store.wait_settled(RELEASE_DIR)
    if (record := read_release_record(store)) is None:
        return None, None
    rel = f"{RELEASE_DIR}/{TRAINED_ON_FILE}"
    return record, store.read_json(rel) if store.exists(rel) else None


def read_own_export(
    store: ArtifactStore, root: str, *, owner: bool = True
) -> tuple[ReleaseRecord | None, dict[str, Any] | None]:
    """A family's last export as `read_release` gives the release: (a record naming its weights' sha256, its
    trained_on.json), each None when absent; `root` is the family's directory (`Family.root`)."""
    out = store.child(root)
    if owner:
        out.settle(EXPORT_DIR)
    else:
        out.wait_settled(EXPORT_DIR)
    rel = f"{EXPORT_DIR}/{TRAINED_ON_FILE}"
    if not out.exists(rel) or not out.exists(f"{EXPORT_DIR}/model.safetensors"):
        return None, None
    return ReleaseRecord(export_sha256=export_digest(out)), out.read_json(rel)


def plan_continuation(
    store: ArtifactStore, now: Mapping[str, Any], root: str, *, rolling: bool, owner: bool = True,
    import_differences: Callable[[ArtifactStore], list[str]] | None = None,
) -> ContinuationPlan:  # fmt: skip
    """`continuation_plan` against the release; in rolling mode, when the release is another family's, against this
    family's own last export (`root`, its directory) if that one continues (module docstring). Offline, its shards are
    all still on disk: a from-scratch run extracts nothing again. `import_differences`: how an imported release differs
    from the drafter this family builds, asked only of one."""
    release, released_on = read_release(store, owner=owner)
    # Compared only within its family: another family's release is not continued whatever it holds.
    imported = (
        release is not None and bool(release.imported) and release.family == now["family"]
        and import_differences is not None
    )  # fmt: skip
    plan = continuation_plan(release, released_on, now, import_differences(store) if imported else None)
    if plan.continues or not rolling or released_on is None or released_on.get("family") == now["family"]:
        return plan
    own = continuation_plan(*read_own_export(store, root, owner=owner), now)
    if not own.continues:
        return plan
    return replace(own, base=f"{root}/{EXPORT_DIR}".lstrip("/"))
