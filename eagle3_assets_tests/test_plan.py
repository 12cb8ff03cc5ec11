"""The plan's own figures and order (`eagle3_assets/plan.py`); the plan against a real start is in test_provenance.py."""

from eagle3_assets.figures import size
from eagle3_assets.plan import NO_PAST, Cost, Plan, Rate, Step


def test_steps_come_in_the_start_commands_order_and_the_total_counts_what_is_unmeasured():
    steps = [
        Step("tokenized", True, "input responses is made again", Cost(seconds=2.0, basis="its last run"), wave=0),
        Step("hidden_states[rows_0-20]", True, "never materialized",
             Cost(shards=1, bytes=2048.0, seconds=6.0, basis="20 rows"), wave=1, sharded=True),
        Step("token_freq", True, "input tokenized is made again", Cost(basis=NO_PAST), wave=1),
        Step("drafter", False, "never materialized", Cost(steps=40, seconds=80.0, basis="b"), wave=2),
    ]  # fmt: skip
    plan = Plan(steps, notes=["n"])
    # Within a tick the start launches the unpartitioned assets first, then the shards.
    assert plan.labels == ["tokenized", "token_freq", "hidden_states[rows_0-20]", "drafter"]
    assert plan.lines() == [
        "plan: 4 to run, in the order the start command runs them (--plan runs nothing)",
        "  tokenized: redo (input responses is made again); ~0m 02s (its last run)",
        f"  token_freq: redo (input tokenized is made again); time unknown ({NO_PAST})",
        "  hidden_states[rows_0-20]: redo (never materialized); ~2.0 KiB to write, ~0m 06s (20 rows)",
        "  drafter: make (never materialized); ~40 optimizer steps, ~1m 20s (b)",
        (
            "total: 0 rows to generate, 1 shard (~2.0 KiB) to extract, ~40 optimizer steps; ~1m 28s measured from "
            f"past runs, 1 step(s) with {NO_PAST}"
        ),
        "note: n",
    ]
    assert Plan([], []).lines() == [
        "plan: nothing to run: everything is made as the current settings and inputs would make it"
    ]


def test_a_rate_is_measured_over_every_past_unit_or_not_at_all():
    assert Rate.measured([(10.0, 20.0), (5.0, 5.0)], "row") == Rate(0.6, 25.0, "row")
    assert Rate.measured([], "row") is None
    assert [size(n) for n in (0, 1023, 1024, 317_991, 5 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "310.5 KiB",
        "5.0 TiB",
    ]
