"""Hidden-state loading: shard guard, format checks, deterministic resumable batches, held-out split."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eagle3_assets.drafter.data import (
    BatchLoader,
    DataError,
    DataPosition,
    MissingShardsError,
    SampleRef,
    fill_packed,
    heldout_batches,
    index_samples,
    pack_rows,
    packing_width,
    plan_epoch,
    require_complete_shards,
    split_batch,
    split_heldout,
)
from eagle3_assets.hidden_states.manifest import ShardManifest
from eagle3_assets.sample_file import read_header
from eagle3_assets.storage import ArtifactStore

from .helpers import random_rows, tiny_llama, write_shard


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("target"))


def test_refuses_to_start_listing_incomplete_shards(tmp_path, model):
    store = ArtifactStore(tmp_path)
    done = write_shard(store, model, random_rows(2), 0)
    half = write_shard(store, model, random_rows(2), 2, complete=False)
    with pytest.raises(MissingShardsError) as e:
        require_complete_shards(store, [done, half, "rows_4-6"])
    assert e.value.missing == ["rows_2-4", "rows_4-6"]
    assert str(e.value).startswith("2 hidden-state shard(s) are not complete (no _SUCCESS.json): rows_2-4, rows_4-6.")
    require_complete_shards(store, [done])
    with pytest.raises(DataError, match="no hidden-state shards given"):
        require_complete_shards(store, [])


def test_index_reads_headers_and_names_a_bad_file(tmp_path, model):
    store = ArtifactStore(tmp_path)
    rows = random_rows(3, seed=1)
    key = write_shard(store, model, rows, 0)
    refs, fmt = index_samples(store, [key])
    assert [(r.row, r.length) for r in refs] == [(i, len(ids)) for i, (ids, _) in enumerate(rows)]
    assert (fmt.hidden_size, fmt.aux_layer_ids, fmt.storage_dtype) == (64, (1, 2, 3), "float32")

    other = write_shard(store, model, random_rows(1), 3, aux_ids=[1, 2, 4])
    with pytest.raises(DataError, match=r"rows_3-4/3.safetensors: hidden size 64, aux layers \[1, 2, 4\] differ"):
        index_samples(store, [key, other])

    bad = {
        "input_ids": torch.zeros(4, dtype=torch.int64),
        "loss_mask": torch.zeros(4, dtype=torch.uint8),
        "aux_hidden_states": torch.zeros(4, 192),
        "last_hidden_state": torch.zeros(4, 64),
    }
    store.write_bytes("hidden_states/rows_9-10/9.safetensors", st_save(bad, metadata={
        "format": "eagle3-hidden-states/1", "aux_layer_ids": "[1, 2, 3]", "last_hidden_state_norm": "post_norm"}))
    with pytest.raises(DataError, match=r"rows_9-10/9.safetensors: input_ids is I64\[4\], expected I32\[T\]"):
        index_samples(store, ["rows_9-10"])
    store.write_bytes("hidden_states/rows_8-9/8.safetensors", st_save(bad, metadata={"format": "other/2"}))
    with pytest.raises(DataError, match=r"rows_8-9/8.safetensors: format 'other/2', expected one of \['eagle3-hidden-states/1', 'eagle3-hidden-states/2'\]"):
        index_samples(store, ["rows_8-9"])


@pytest.mark.parametrize("order", ["packed", "random", "by_length"])
def test_plan_is_deterministic_covers_every_sample_and_keeps_the_budget(order):
    lengths = [5 + (i * 37) % 60 for i in range(300)]
    a, b = plan_epoch(lengths, 0, 7, 256, order), plan_epoch(lengths, 0, 7, 256, order)
    assert a == b
    assert plan_epoch(lengths, 1, 7, 256, order) != a
    assert sorted(i for batch in a for i in batch) == list(range(300))
    if order == "packed":  # rows as wide as the longest sample (64), at most 256 // 64 of them
        rows = [[batch[i] for i in row] for batch in a for row in pack_rows([lengths[i] for i in batch], 64)]
        assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
        assert all(len(pack_rows([lengths[i] for i in batch], 64)) <= 4 for batch in a)
    else:
        assert all(max(lengths[i] for i in batch) * len(batch) <= 256 for batch in a)
    # A row longer than the budget is a batch of its own, never truncated.
    assert plan_epoch([10, 500, 10], 0, 0, 100, order).count([1]) == 1


def test_random_batches_are_the_shuffle_cut_in_order_and_by_length_batches_are_sorted():
    lengths = [5 + (i * 37) % 60 for i in range(300)]
    shuffle = np.random.default_rng([7, 0]).permutation(300).tolist()
    random_plan = plan_epoch(lengths, 0, 7, 256, "random")
    assert [i for batch in random_plan for i in batch] == shuffle
    # Random draws mix lengths: the widest batch spans most of the 5..64 range.
    assert max(max(lengths[i] for i in bt) - min(lengths[i] for i in bt) for bt in random_plan) >= 50
    sorted_plan = plan_epoch(lengths, 0, 7, 256, "by_length")
    for batch in sorted_plan:
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
    # Neighbours of similar length: fewer, fuller batches than random draws under the same budget.
    assert len(sorted_plan) < len(random_plan)


def test_packing_is_first_fit_in_order_and_fills_the_rows():
    assert pack_rows([5, 4, 3, 2, 6, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert pack_rows([12, 3], 8) == [[0], [1]]  # longer than the width: a row of its own, never split
    # Batches of at most 2 rows of 8: 6 fits neither row of [5] [4], so it starts the next batch,
    # where 1 still fits beside it.
    assert fill_packed([5, 4, 6, 7, 1], [0, 1, 2, 3, 4], budget=16, width=8) == [[0, 1], [2, 3, 4]]
    assert pack_rows([6, 7, 1], 8) == [[0, 2], [1]]
    assert packing_width([3, 40, 7], 1000) == 40 and packing_width([3, 40, 7], 16) == 16
    lengths = [5 + (i * 37) % 60 for i in range(300)]
    packed, padded = plan_epoch(lengths, 0, 7, 256, "packed"), plan_epoch(lengths, 0, 7, 256, "random")
    # The same shuffle, cut into fewer, fuller batches: 80% of the packed rows' tokens are
    # samples', 66% of the padded rows' (lengths 5..64 with four rows a batch).
    assert [i for b in packed for i in b] == [i for b in padded for i in b]
    rows = sum(len(pack_rows([lengths[i] for i in b], 64)) for b in packed)
    assert round(sum(lengths) / (rows * 64), 3) == 0.805
    assert round(sum(lengths) / sum(max(lengths[i] for i in b) * len(b) for b in padded), 3) == 0.663
    assert (len(packed), len(padded)) == (51, 68)


def test_packed_batches_place_each_sample_whole_with_its_segment_and_positions(tmp_path, model):
    store = ArtifactStore(tmp_path)
    rows = random_rows(5, seed=4, min_len=4, max_len=12)
    key = write_shard(store, model, rows, 0)
    refs, _ = index_samples(store, [key])
    loader = BatchLoader(store, refs, batch_tokens=1000, seed=0, order="packed")
    width = max(len(ids) for ids, _ in rows)
    b = loader.load([0, 1, 2, 3, 4])
    layout = pack_rows([len(rows[i][0]) for i in range(5)], width)
    assert b.input_ids.shape[0] == len(layout) and b.pre_norm.shape == b.input_ids.shape
    assert [r.row for r in b.samples] == [i for row in layout for i in row]
    for r, row in enumerate(layout):
        start = 0
        for seg, i in enumerate(row):
            ids, mask = rows[i]
            span = slice(start, start + len(ids))
            assert b.input_ids[r, span].tolist() == ids and b.loss_mask[r, span].tolist() == mask
            assert b.segments[r, span].tolist() == [seg] * len(ids)
            assert b.positions[r, span].tolist() == list(range(len(ids)))
            start += len(ids)
        assert b.lengths[r] == start
        assert b.segments[r, start:].tolist() == [-1] * (b.input_ids.shape[1] - start)
    assert b.num_tokens == sum(len(ids) for ids, _ in rows)


def test_resume_from_a_position_gives_the_same_batches(tmp_path, model):
    store = ArtifactStore(tmp_path)
    key = write_shard(store, model, random_rows(12, seed=3), 0)
    refs, _ = index_samples(store, [key])
    loader = BatchLoader(store, refs, batch_tokens=64, seed=1)
    n0 = loader.steps_in_epoch(0)
    full = []
    for pos, batch in loader.iterate():
        full.append((pos, [(s.row) for s in batch.samples], batch.input_ids.clone()))
        if len(full) == n0 + 3:
            break
    start = full[n0 - 1][0]
    assert start == DataPosition(0, n0 - 1)
    resumed = []
    for pos, batch in BatchLoader(store, refs, batch_tokens=64, seed=1).iterate(start):
        resumed.append((pos, [(s.row) for s in batch.samples], batch.input_ids.clone()))
        if len(resumed) == 4:
            break
    assert [(p, r) for p, r, _ in resumed] == [(p, r) for p, r, _ in full[n0 - 1 :]]
    assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(resumed, full[n0 - 1 :]))
    assert resumed[1][0] == DataPosition(1, 0)
    assert loader.position_after(DataPosition(0, n0 - 1)) == DataPosition(1, 0)


def test_batch_contents_are_padded_rows(tmp_path, model):
    store = ArtifactStore(tmp_path)
    rows = random_rows(2, seed=4)
    key = write_shard(store, model, rows, 0, dtype="bfloat16")
    refs, fmt = index_samples(store, [key])
    assert fmt.storage_dtype == "bfloat16"
    b = BatchLoader(store, refs, batch_tokens=1000, seed=0).load([1, 0])
    T = max(len(r[0]) for r in rows)
    assert b.input_ids.shape == (2, T) and b.aux.shape == (2, T, 192) and b.aux.dtype == torch.bfloat16
    assert b.lengths.tolist() == [len(rows[1][0]), len(rows[0][0])]
    assert b.input_ids[0, : len(rows[1][0])].tolist() == rows[1][0]
    assert b.loss_mask[1, : len(rows[0][1])].tolist() == rows[0][1]
    assert b.input_ids[0, len(rows[1][0]) :].abs().sum() == 0
    assert b.num_tokens == len(rows[0][0]) + len(rows[1][0])


def test_memory_store(model):
    store = ArtifactStore(f"memory://drafter-data-{uuid.uuid4().hex}")
    rows = random_rows(4, seed=6)
    key = write_shard(store, model, rows, 0, norm="pre_norm")
    refs, _ = index_samples(store, [key])
    loader = BatchLoader(store, refs, batch_tokens=1000, seed=0)
    (pos, batch), = [next(iter(loader.iterate()))]
    assert pos == DataPosition(0, 0)
    assert sorted(s.row for s in batch.samples) == [0, 1, 2, 3]
    assert batch.pre_norm.tolist() == [True] * 4


def test_heldout_split_is_deterministic_and_disjoint():
    refs = [SampleRef("rows_0-50", i, 10 + i) for i in range(50)]
    train, held = split_heldout(refs, 8, seed=0)
    assert (train, held) == split_heldout(refs, 8, seed=0)
    assert len(held) == 8 and not set(train) & set(held) and len(train) == 42
    assert split_heldout(refs, 8, seed=1)[1] != held
    with pytest.raises(DataError, match="heldout_rows=50 leaves nothing to train on: the shards hold 50 samples"):
        split_heldout(refs, 50, seed=0)
    # Ranks split the held-out batches between them.
    all_b = heldout_batches(held, 40)
    rank0, rank1 = heldout_batches(held, 40, 0, 2), heldout_batches(held, 40, 1, 2)
    assert rank0 and rank1
    assert sorted(map(tuple, rank0 + rank1)) == sorted(map(tuple, all_b))


def test_ranks_share_out_the_batches_one_process_would_train():
    refs = [SampleRef("rows_0-64", i, 8 + (i % 5)) for i in range(64)]
    one = BatchLoader(None, refs, batch_tokens=128, seed=0)  # type: ignore[arg-type]
    r0 = BatchLoader(None, refs, batch_tokens=128, seed=0, rank=0, world_size=2)  # type: ignore[arg-type]
    r1 = BatchLoader(None, refs, batch_tokens=128, seed=0, rank=1, world_size=2)  # type: ignore[arg-type]
    p0, p1, whole = r0.rank_plan(0), r1.rank_plan(0), one.rank_plan(0)
    assert len(p0) == len(p1) == len(whole) == r0.total_steps(1.0) == one.total_steps(1.0)
    for a, b, w in zip(p0, p1, whole, strict=True):
        assert sorted(a + b) == sorted(w) and a and b  # step i trains the same samples, split in two
        assert abs(sum(refs[i].length for i in a) - sum(refs[i].length for i in b)) <= 12  # one sample's length


def test_split_batch_deals_longest_first_to_the_lightest_rank_and_skips_nothing():
    assert split_batch([10, 3, 8, 7, 2], [0, 1, 2, 3, 4], 2) == [[0, 1, 4], [2, 3]]
    assert split_batch([5, 5, 5], [2, 0, 1], 3) == [[0], [1], [2]]
    assert split_batch([5], [0], 2) == [[0], []]  # the loader skips such a batch on 2 ranks


def test_the_test_shards_are_written_by_the_pipelines_own_writer_in_the_contract_format(tmp_path, model):
    store = ArtifactStore(tmp_path)
    key = write_shard(store, model, random_rows(1, min_len=10, max_len=10), 0)
    with store.open(f"hidden_states/{key}/0.safetensors") as f:
        header, problem = read_header(f)
    assert problem is None
    meta = header.pop("__metadata__")
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
        "input_ids": ("I32", [10]),
        "loss_mask": ("U8", [10]),
        "aux_hidden_states": ("F32", [10, 192]),
        "last_hidden_state": ("F32", [10, 64]),
    }
    assert meta["format"] == "eagle3-hidden-states/2"
    assert json.loads(meta["aux_layer_ids"]) == [1, 2, 3]
    assert meta["last_hidden_state_norm"] == "pre_norm"
    manifest = ShardManifest.read(store, key)  # the pipeline's own manifest, read by its one reader
    assert (manifest.shard, manifest.rows, manifest.tokens, manifest.aux_layer_ids) == (key, 1, 10, (1, 2, 3))
    assert manifest.bytes == store.size(f"hidden_states/{key}/{manifest.row_start}.safetensors")


def test_float8_samples_are_loaded_dequantized(tmp_path, model):
    store = ArtifactStore(tmp_path)
    rows = random_rows(3, seed=5)
    exact = write_shard(store, model, rows, 0)
    fp8 = write_shard(store, model, rows, 3, dtype="float8_e4m3fn")
    refs, fmt = index_samples(store, [fp8])
    assert fmt.storage_dtype == "float8_e4m3fn"
    got = BatchLoader(store, refs, batch_tokens=10**6, seed=0).load([0, 1, 2])
    want = BatchLoader(store, index_samples(store, [exact])[0], batch_tokens=10**6, seed=0).load([0, 1, 2])
    assert got.aux.dtype == torch.bfloat16 and torch.equal(got.input_ids, want.input_ids)
    rel = (got.aux.float() - want.aux).norm() / want.aux.norm()
    assert 0 < rel < 0.05, rel  # e4m3: about 2% relative error per value


def test_a_non_finite_sample_is_refused_by_file_name_as_it_is_read(tmp_path, model):
    """A shard corrupted after its check passed: the loader names the file instead of training on NaN."""
    store = ArtifactStore(tmp_path)
    key = write_shard(store, model, random_rows(3, seed=2), 0)
    rel = f"hidden_states/{key}/1.safetensors"
    tensors = st_load(store.read_bytes(rel))
    tensors["aux_hidden_states"][4, 7] = float("nan")
    with store.open(rel) as f:
        header, _ = read_header(f)
    store.write_bytes(rel, st_save(tensors, metadata=header["__metadata__"]))
    refs, _ = index_samples(store, [key])  # headers still fine
    loader = BatchLoader(store, refs, batch_tokens=10**6, seed=0)
    with pytest.raises(DataError) as e:
        loader.load([0, 1, 2])
    assert str(e.value) == (
        f"{store.url_of(rel)}: aux_hidden_states has 1 non-finite values; re-extract it "
        "(run the `verify_shards` job, then materialize the shard it names)"
    )
