"""Convert the project's hidden-state shards into the layout speculators trains from.

Runs in the project venv (it uses the project's sample index and held-out split, so the
peer trains on exactly our training rows):

    .venv/bin/python benchmarks/peer/convert_shards.py --store /tmp/peer-demo-store --out /tmp/peer-data

Input (docs/DESIGN.md §4): `hidden_states/rows_A-B/<row>.safetensors` with `input_ids` [T] int32,
`loss_mask` [T] uint8, `aux_hidden_states` [T, 3H], `last_hidden_state` [T, H] and string
metadata (`aux_layer_ids`, `last_hidden_state_norm`, ...).

Output, under --out:

    hidden_states/hs_<i>.safetensors   hidden_states [T, 4, H] (the 3 aux layers ascending, then
                                       the last layer, PRE-norm: vLLM's extraction layout),
                                       token_ids [T] int64, loss_mask [T] uint8 (extra key,
                                       ignored by speculators' loader; the wrapper reads it)
    d2t.npy, t2d.npy                   the store's vocab map, as speculators' --d2t-path/--t2d-path
    manifest.json                      n_train, n_heldout, the (shard, row) of every index i,
                                       aux layer ids, hidden size, source store

Order: i = 0 .. n_train-1 are the training rows of `split_heldout(index_samples(...))` in
the project's index order, then the held-out rows (also in index order). speculators splits
train/validation by position (the first int(N * train_data_ratio) rows train), so the
wrapper passes a ratio that puts exactly our training rows in its training split.

speculators applies the target's final norm to the last state itself, so a shard whose
last state is post-norm would be normed twice: such files are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafter_runs import shard_keys  # noqa: E402

from eagle3_assets.drafter.data import index_samples, load_sample, split_heldout  # noqa: E402
from eagle3_assets.sample_file import manifest_path as shard_manifest  # noqa: E402
from eagle3_assets.storage import ArtifactStore  # noqa: E402
from eagle3_assets.vocab_map import VocabMap  # noqa: E402


class ConvertError(RuntimeError):
    pass


def convert(
    store_dir: str | Path, out_dir: str | Path, *, heldout_rows: int, seed: int, keys: list[str] | None = None,
    force: bool = False,
) -> dict:
    """The store's complete shards (or those of `keys`, in that order, as our run names them) in `out_dir`."""
    store = ArtifactStore(str(Path(store_dir).resolve()))
    out = Path(out_dir)
    keys = shard_keys(store) if keys is None else list(keys)
    if not keys:
        raise ConvertError(f"{store.url_of('hidden_states')}: no complete shards")
    samples, fmt = index_samples(store, keys)
    train, held = split_heldout(samples, heldout_rows, seed) if heldout_rows else (list(samples), [])
    ordered = list(train) + list(held)
    manifest_file = out / "manifest.json"
    want = {
        "source_store": store.url_of(""),
        "shard_keys": keys,
        # a re-extracted shard gets a new manifest: convert again rather than reuse stale files
        "shard_created": {k: store.read_json(shard_manifest(k)).get("created") for k in keys},
        "heldout_rows": heldout_rows,
        "seed": seed,
        "rows": [[s.shard, s.row] for s in ordered],
    }
    if manifest_file.exists() and not force:
        have = json.loads(manifest_file.read_text())
        if {k: have.get(k) for k in want} == want:
            return have  # already converted from the same rows
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    for old in hs_dir.glob("hs_*.safetensors"):
        old.unlink()
    t0 = time.perf_counter()
    tokens = 0
    for i, ref in enumerate(ordered):
        t, pre_norm = load_sample(store, ref)  # decoded (float8 files too) and checked finite
        if not pre_norm:
            raise ConvertError(
                f"{store.url_of(ref.rel)}: the last state is post-norm; speculators applies the target's final norm "
                "itself, so it needs the PRE-norm one (both backends extract it: re-extract this shard)."
            )
        T, H = t["last_hidden_state"].shape
        aux = t["aux_hidden_states"].reshape(T, len(fmt.aux_layer_ids), H)
        hs = torch.cat([aux, t["last_hidden_state"].unsqueeze(1)], dim=1).contiguous()  # [T, 4, H]
        save_file(
            {
                "hidden_states": hs,
                "token_ids": t["input_ids"].to(torch.int64).contiguous(),
                "loss_mask": t["loss_mask"].to(torch.uint8).contiguous(),
            },
            str(hs_dir / f"hs_{i}.safetensors"),
            metadata={"shard": ref.shard, "row": str(ref.row)},
        )
        tokens += T
    vmap = VocabMap.load(store)
    np.save(out / "d2t.npy", vmap.d2t.astype(np.int64))
    np.save(out / "t2d.npy", vmap.t2d.astype(bool))
    manifest = {
        **want,
        "n_train": len(train),
        "n_heldout": len(held),
        "train_tokens": sum(s.length for s in train),
        "heldout_tokens": sum(s.length for s in held),
        "tokens": tokens,
        "aux_layer_ids": list(fmt.aux_layer_ids),
        "hidden_size": fmt.hidden_size,
        "storage_dtype": fmt.storage_dtype,
        "draft_vocab_size": len(vmap.d2t),
        "target_vocab_size": len(vmap.t2d),
        "convert_seconds": round(time.perf_counter() - t0, 2),
    }
    manifest_file.write_text(json.dumps(manifest) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Convert our hidden-state shards into speculators' hs_<i> layout.")
    ap.add_argument("--store", required=True, help="artifact store directory with complete shards")
    ap.add_argument("--out", required=True, help="output directory (speculators' --data-path)")
    ap.add_argument("--heldout-rows", type=int, default=64, help="training.heldout_rows of our run")
    ap.add_argument("--seed", type=int, default=0, help="training.seed of our run (drives the held-out split)")
    ap.add_argument("--force", action="store_true", help="convert again even if the output matches")
    args = ap.parse_args(argv)
    try:
        m = convert(args.store, args.out, heldout_rows=args.heldout_rows, seed=args.seed, force=args.force)
    except ConvertError as e:
        print(f"convert_shards: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in m.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
