import pytest

from eagle3_assets.shards import Shard, plan_shards


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
