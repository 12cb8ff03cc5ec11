import pytest

from eagle3_assets.provenance import Provenance, claim_dir
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet, plan_rows, remove_stale_shard_dirs


def test_keys_when_shard_size_does_not_divide_the_rows():
    assert [s.key for s in plan_shards(4500, 2000)] == ["rows_0-2000", "rows_2000-4000", "rows_4000-4500"]


def test_keys_when_shard_size_divides_the_rows():
    shards = plan_shards(10_000, 2000)
    assert [s.key for s in shards] == [f"rows_{a}-{a + 2000}" for a in range(0, 10_000, 2000)]
    assert [len(s) for s in shards] == [2000] * 5
    assert list(shards[-1].rows)[:2] == [8000, 8001]


def test_small_sets():
    assert plan_shards(0, 2000) == []
    assert plan_shards(1, 2000) == [Shard(0, 1)]


def test_parse_round_trips_and_rejects_bad_keys():
    assert Shard.parse("rows_2000-4000") == Shard(2000, 4000)
    for bad in ["rows_5-5", "rows_7-3", "row_0-10", "rows_0-10/"]:
        with pytest.raises(ValueError, match="not a shard key"):
            Shard.parse(bad)


def responses_rows(row_ids: list[int]) -> TokenizedSet:
    """A tokenized set in `responses` order: row r has r + 1 tokens, each r (so a row is known by its content)."""
    return TokenizedSet.from_rows([([r] * (r + 1), [1] * (r + 1)) for r in row_ids], row_ids)


def shard_contents(tset: TokenizedSet, size: int) -> dict[str, str]:
    return {s.key: tset.rows_digest(s.start, s.end) for s in tset.shards(size)}


@pytest.mark.parametrize("seed", [None, 7], ids=["offline", "rolling"])
def test_rows_added_to_the_set_land_in_new_shards_and_every_shard_before_keeps_its_rows(seed):
    """Issue 44, items 6 and 9: an appended prompt (rolling: shuffled, so it would have reshuffled every row) and a
    row retried after it failed (it would have shifted every row after it) change no shard made before: they land in
    new shards after the others, a short last shard included."""
    first = plan_rows(responses_rows([r for r in range(45) if r != 3]), 20, seed, None)  # row 3 failed generation
    assert [s.key for s in first.tset.shards(20)] == ["rows_0-20", "rows_20-40", "rows_40-44"]
    stored = TokenizedSet.from_bytes(first.tset.to_bytes())  # the plan travels with the rows
    assert stored.shards(20) == first.tset.shards(20)
    then = plan_rows(responses_rows(list(range(50))), 20, seed, stored)  # row 3 retried, rows 45-49 appended
    assert (then.kept_rows, then.notes) == (44, [])
    assert [s.key for s in then.tset.shards(20)] == ["rows_0-20", "rows_20-40", "rows_40-44", "rows_44-50"]
    before, after = shard_contents(first.tset, 20), shard_contents(then.tset, 20)
    assert {k: after[k] for k in before} == before
    assert sorted(then.tset.row_ids[44:].tolist()) == [3, 45, 46, 47, 48, 49]
    if seed is None:
        assert then.tset.row_ids[44:].tolist() == [3, 45, 46, 47, 48, 49]  # responses order
    else:
        assert first.tset.row_ids.tolist() != sorted(first.tset.row_ids.tolist())  # a fresh plan shuffles every row


def test_a_row_gone_from_the_set_places_every_row_again_and_says_why():
    first = plan_rows(responses_rows(list(range(10))), 4, 7, None)
    again = plan_rows(responses_rows([r for r in range(10) if r != 6]), 4, 7, first.tset)
    assert again.kept_rows == 0 and [s.key for s in again.tset.shards(4)] == ["rows_0-4", "rows_4-8", "rows_8-9"]
    assert again.notes == [
        "1 row(s) of the tokenized set before are no longer usable (responses rows 6): every row is placed again"
    ]
    assert plan_rows(responses_rows(list(range(10))), 5, 7, None, "setting shard_size: 4 -> 5").notes == [
        "setting shard_size: 4 -> 5"
    ]


def test_shard_directories_cut_for_another_plan_are_removed_and_counted(tmp_path):
    store = ArtifactStore(tmp_path)
    for name, size in [("rows_0-20", 3), ("rows_0-10", 5), ("rows_10-20", 7), ("_leases/rows_0-10", 1)]:
        store.write_bytes(f"hidden_states/{name}/0.safetensors", b"x" * size)
    assert remove_stale_shard_dirs(store, ["rows_0-20"]) == {"rows_0-10": 5, "rows_10-20": 7}
    assert store.listdir("hidden_states") == ["_leases", "rows_0-20"]


def test_a_shard_directory_made_before_provenance_is_made_again_saying_so_and_what_it_costs(tmp_path):
    """Issue 44, item 6: a shard of a store made before records were kept was wiped as 'no provenance record'; what
    made it is still unknown, so it is extracted again, and the cause says so with the files and bytes it held."""
    store = ArtifactStore(tmp_path)
    for row, size in [(0, 100), (1, 150)]:
        store.write_bytes(f"hidden_states/rows_0-2/{row}.safetensors", b"x" * size)
    want = Provenance("hidden_states", {"aux_layer_ids": [1, 2, 3]}, {"rows": "abc"}, 1)
    assert claim_dir(store, "hidden_states/rows_0-2", want) == [
        "made before provenance was kept (no record of what made it): its 2 file(s), 250 bytes, are made again"
    ]
    assert store.listdir("hidden_states/rows_0-2") == ["_PROVENANCE.json"]
    assert claim_dir(store, "hidden_states/rows_0-2", want) == []


def test_the_plan_is_cut_again_only_for_the_settings_that_cut_it_each_named_with_its_values():
    from eagle3_assets.provenance import UNSET, Provenance
    from eagle3_assets.tokenized import replan_reason

    then = Provenance("tokenized", {"shard_size": 20, "max_seq_len": 256}, {"responses": "a"}, 1)
    assert replan_reason(then.changed_settings(Provenance("tokenized", {**then.settings, "max_seq_len": 512}, {}, 1))) is None
    now = Provenance("tokenized", {"shard_size": 15, "max_seq_len": 512, "training.seed": 3}, {"responses": "b"}, 1)
    assert then.changed_settings(now) == {"max_seq_len": (256, 512), "shard_size": (20, 15), "training.seed": (UNSET, 3)}
    assert replan_reason(then.changed_settings(now)) == (
        "setting shard_size: 20 -> 15; setting training.seed: (unset) -> 3: every row is placed again and every shard "
        "is cut again"
    )
