"""Token frequencies and the draft vocabulary map (docs/DESIGN.md §3, the contract vLLM and SGLang read).

The files are read and written here only: `token_freq/token_freq.safetensors` (`counts`
int64 [target_vocab]) and `vocab_map/vocab_map.safetensors` (`d2t` int64 [draft_vocab],
`t2d` bool [target_vocab]). `vocab_map_problems` is the one statement of the invariant
`nonzero(t2d) == d2t + arange(draft_vocab)`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from eagle3_assets.errors import Refusal
from eagle3_assets.storage import ArtifactStore

TOKEN_FREQ_FILE = "token_freq/token_freq.safetensors"
VOCAB_MAP_FILE = "vocab_map/vocab_map.safetensors"
_CHUNK = 1 << 20


class VocabMapError(Refusal, ValueError):
    """Counts or a map that cannot be built or read; the message names the token, setting or file."""


def token_frequencies(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Counts of each id over loss-masked positions: int64 [vocab_size]."""
    keep = loss_mask.astype(bool, copy=False)

    def count(start: int) -> np.ndarray:
        ids = input_ids[start : start + _CHUNK][keep[start : start + _CHUNK]]
        # bincount itself finds out-of-vocabulary ids (a longer result, or an error for negatives).
        try:
            chunk = np.bincount(ids, minlength=vocab_size)
        except ValueError:
            raise VocabMapError(f"token id {int(ids.min())} outside the target vocabulary of {vocab_size}") from None
        if len(chunk) > vocab_size:
            raise VocabMapError(f"token id {int(ids.max())} outside the target vocabulary of {vocab_size}")
        return chunk

    # Chunks keep bincount's int32 -> intp conversion in cache, and bincount releases the GIL,
    # so threads count chunks in parallel.
    counts = np.zeros(vocab_size, dtype=np.int64)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for chunk in pool.map(count, range(0, len(input_ids), _CHUNK)):
            counts += chunk
    return counts


@dataclass(frozen=True)
class VocabMap:
    d2t: np.ndarray  # [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d: np.ndarray  # [target_vocab] bool: target id is in the draft vocab

    @property
    def draft_ids_to_target(self) -> np.ndarray:
        return self.d2t + np.arange(len(self.d2t))

    def save(self, store: ArtifactStore) -> int:
        data = st_save({"d2t": self.d2t, "t2d": self.t2d}, metadata={"draft_vocab_size": str(len(self.d2t))})
        return store.write_bytes(VOCAB_MAP_FILE, data)

    @classmethod
    def load(cls, store: ArtifactStore) -> VocabMap:
        tensors = _load(store, VOCAB_MAP_FILE, "vocab_map", ("d2t", "t2d"))
        return cls(tensors["d2t"], tensors["t2d"])


def save_token_frequencies(store: ArtifactStore, counts: np.ndarray) -> int:
    return store.write_bytes(TOKEN_FREQ_FILE, st_save({"counts": counts}))


def load_token_frequencies(store: ArtifactStore) -> np.ndarray:
    return _load(store, TOKEN_FREQ_FILE, "token_freq", ("counts",))["counts"]


def _load(store: ArtifactStore, path: str, asset: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        tensors = st_load(store.read_bytes(path))
    except SafetensorError as e:
        raise VocabMapError(f"{store.url_of(path)}: not a readable safetensors file ({e}); re-materialize {asset}") from None
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise VocabMapError(f"{store.url_of(path)}: has no {missing}; re-materialize {asset}")
    return tensors


def build_vocab_map(freq: np.ndarray, draft_vocab_size: int) -> VocabMap:
    """The `draft_vocab_size` most frequent ids (ties: lower id first), zero-count ids filling the rest."""
    if draft_vocab_size > len(freq):
        raise VocabMapError(f"draft_vocab_size {draft_vocab_size} is larger than the target vocabulary ({len(freq)})")
    # A stable sort on -count keeps ids in ascending order among equal counts, which is the
    # tie rule, and puts unused ids (count 0) last in ascending order, which is the padding rule.
    chosen = np.argsort(-freq, kind="stable")[:draft_vocab_size]
    used = np.sort(chosen)
    d2t = used - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(len(freq), dtype=bool)
    t2d[used] = True
    return VocabMap(d2t.astype(np.int64), t2d)


def vocab_map_problems(vmap: VocabMap, *, draft_vocab_size: int, target_vocab_size: int) -> list[str]:
    """Everything wrong with a map, empty when it keeps the contract."""
    problems = []
    if vmap.d2t.dtype != np.int64 or vmap.d2t.shape != (draft_vocab_size,):
        problems.append(f"d2t is {vmap.d2t.dtype}{list(vmap.d2t.shape)}, expected int64[{draft_vocab_size}]")
    if vmap.t2d.dtype != np.bool_ or vmap.t2d.shape != (target_vocab_size,):
        problems.append(f"t2d is {vmap.t2d.dtype}{list(vmap.t2d.shape)}, expected bool[{target_vocab_size}]")
    if problems:
        return problems
    targets = vmap.draft_ids_to_target
    if not np.array_equal(np.flatnonzero(vmap.t2d), targets):
        problems.append("nonzero(t2d) != d2t + arange(draft_vocab): the two maps disagree")
    if np.any(np.diff(targets) <= 0):
        problems.append("draft ids do not map to strictly increasing target ids")
    if targets.size and (targets[0] < 0 or targets[-1] >= target_vocab_size):
        problems.append(f"d2t maps outside the target vocabulary [0, {target_vocab_size})")
    return problems


def coverage(vmap: VocabMap, freq: np.ndarray) -> float:
    """The share of loss-masked tokens (`freq`) the map's draft vocab holds: an upper bound on what it can draft."""
    total = int(freq.sum())
    return int(freq[vmap.t2d].sum()) / total if total else 1.0


def sticky_vocab_map(
    previous: VocabMap | None, freq: np.ndarray, draft_vocab_size: int, keep_margin: float
) -> tuple[VocabMap, str]:
    """(the map, what was done and why): the previous map while its coverage of `freq` is within `keep_margin` of a
    freshly computed map's, else the fresh one (`build_vocab_map`).

    Appended rows move token counts a little; a recomputed map would move draft ids under a trained head, and a
    drafter is continued only on the map it was trained with. Keeping equal content keeps the data version (it is
    the content's digest), so nothing downstream is redone for it."""
    fresh = build_vocab_map(freq, draft_vocab_size)
    fresh_cov = coverage(fresh, freq)
    if previous is None:
        return fresh, f"computed: no previous map (coverage {fresh_cov:.6f})"
    if previous.d2t.shape != (draft_vocab_size,) or previous.t2d.shape != freq.shape:
        return fresh, (
            f"recomputed: the previous map is {len(previous.d2t)} of {len(previous.t2d)} ids, now {draft_vocab_size} "
            f"of {len(freq)} (coverage {fresh_cov:.6f})"
        )
    kept_cov = coverage(previous, freq)
    if np.array_equal(previous.t2d, fresh.t2d):
        return fresh, f"unchanged: a fresh map is the previous one (coverage {fresh_cov:.6f})"
    if fresh_cov - kept_cov <= keep_margin:
        return previous, (
            f"kept the previous map: it covers {kept_cov:.6f} of the loss tokens, a fresh map {fresh_cov:.6f} "
            f"(within vocab_map_keep_margin {keep_margin:g})"
        )
    return fresh, (
        f"recomputed: the previous map covers {kept_cov:.6f} of the loss tokens, a fresh map {fresh_cov:.6f} "
        f"(more than vocab_map_keep_margin {keep_margin:g} better)"
    )
