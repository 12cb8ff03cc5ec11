"""Issue 43, item 7: acceptance by context length. `drafter_eval` bins the held-out prompts by their length in
tokens and reports acceptance per bin, for ours and for the released drafter served beside it; a bin with fewer
than `evaluation.min_prompts_per_bin` prompts is reported as too small. (The release gate on bins:
test_drafter_release.py; the per-group counters on a real engine: test_drafter_eval_beside.py.)"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.drafter.context_bins import (
    bin_labels,
    context_bin,
    group_label,
    prompts_per_bin,
    split_group,
    too_small,
)
from eagle3_assets.drafter.eval_report import ContextBins, ServedReport
from eagle3_assets.drafter.evaluate import EvalReport
from eagle3_assets.drafter.release import RELEASED, release_decision
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.settings import EvaluationSettings, SettingsError, parse_settings

EDGES = [0, 1024, 4096]


def test_a_prompt_falls_in_the_bin_its_length_in_tokens_names_and_every_bin_is_counted_even_empty():
    assert bin_labels(EDGES) == ["0-1024", "1024-4096", "4096+"]
    # An edge opens its bin: 1024 tokens is the second bin, 1023 the first; past the last edge, the open bin.
    assert [context_bin(n, EDGES) for n in (0, 1023, 1024, 4095, 4096, 100_000)] == [
        "0-1024", "0-1024", "1024-4096", "1024-4096", "4096+", "4096+"
    ]  # fmt: skip
    counts = prompts_per_bin([10, 20, 30, 40, 50, 2000, 3000], EDGES)
    assert counts == {"0-1024": 5, "1024-4096": 2, "4096+": 0}
    assert too_small(counts, 5) == ["1024-4096", "4096+"]  # reported as too small, empty ones too: none dropped
    assert too_small(counts, 2) == ["4096+"]
    # The demo: every held-out prompt is short, so all fall in the first bin of the default edges.
    default = EvaluationSettings().context_bins
    assert default == [0, 1024, 4096, 16384, 32768, 65536]
    assert prompts_per_bin([30] * 40, default) == {
        "0-1024": 40, "1024-4096": 0, "4096-16384": 0, "16384-32768": 0, "32768-65536": 0, "65536+": 0
    }  # fmt: skip


def test_a_group_names_its_mode_and_its_bin_even_when_the_mode_holds_the_separator():
    mode = '{"reasoning_effort": "a|b"}'
    assert split_group(group_label(mode, "1024-4096")) == (mode, "1024-4096")
    assert split_group(group_label("{}", "4096+")) == ("{}", "4096+")


@pytest.mark.parametrize(
    ("edges", "message"),
    [
        ([512, 4096], "the first edge must be 0, so every prompt falls in a bin; got [512, 4096]"),
        ([], "the first edge must be 0, so every prompt falls in a bin; got []"),
        ([0, 4096, 4096], "edges must increase strictly (each bin a range of prompt lengths); got [0, 4096, 4096]"),
    ],
)
def test_bin_edges_that_leave_a_prompt_without_a_bin_or_make_an_empty_range_are_refused_naming_the_field(
    edges, message
):
    with pytest.raises(SettingsError) as e:
        parse_settings({"evaluation": {"context_bins": edges}})
    assert str(e.value) == f"invalid settings in settings:\n  evaluation.context_bins: Value error, {message}"
    with pytest.raises(
        SettingsError, match=r"evaluation.min_prompts_per_bin: Input should be greater than or equal to 1"
    ):
        parse_settings({"evaluation": {"min_prompts_per_bin": 0}})


def with_groups(by_group: dict[str, GenerationResult]) -> GenerationResult:
    """A speculative run as `vllm_eval.generate` returns it: the groups' counters added, each group kept."""
    whole = GenerationResult.merged(list(by_group.values()))
    whole.by_group = by_group
    return whole


def speculative(k: int, figures: dict[str, tuple[int, int]]) -> GenerationResult:
    """A run at k in which each context bin's group (one mode) drafted `drafts` times and had `accepted` tokens
    accepted: its mean acceptance length is 1 + accepted / drafts."""
    return with_groups({
        group_label("{}", b): GenerationResult([[1]], drafts, k * drafts, accepted, [accepted])
        for b, (drafts, accepted) in figures.items()
    })  # fmt: skip


def test_the_report_keeps_each_bin_for_ours_and_the_released_drafter_and_the_gate_reads_them_back():
    """as_metadata -> report.json -> ServedReport: the figures the gate compares, per bin, for both drafters."""
    bins = {"0-1024": 5, "1024-4096": 5, "4096+": 2}
    report = EvalReport(prompts=12, max_tokens=4, context_bin_edges=EDGES, min_prompts_per_bin=5, bins=bins)
    plain = GenerationResult([[1]] * 3)
    for k in (3, 7):
        ours = speculative(k, {"0-1024": (10, 15), "1024-4096": (10, 5), "4096+": (2, 4)})  # 2.5, 1.5, 3.0
        report.add_run(k, False, plain, ours, log=lambda _: None)
        report.add_run(k, True, plain, ours, log=lambda _: None)
        report.add_beside(RELEASED, "release", k, plain, speculative(k, {
            "4096+": (2, 0), "0-1024": (10, 8), "1024-4096": (10, 6)}))  # 1.8, 1.6, 1.0, any order  # fmt: skip
    meta = report.as_metadata()
    ours_by_bin = {
        "0-1024": {"k3": 2.5, "k7": 2.5},
        "1024-4096": {"k3": 1.5, "k7": 1.5},
        "4096+": {"k3": 3.0, "k7": 3.0},
    }
    assert meta["mean_acceptance_length_by_context_bin"] == ours_by_bin
    assert meta["prompts_by_context_bin"] == bins
    assert (meta["context_bin_edges"], meta["min_prompts_per_bin"], meta["context_bins_too_small"]) == (
        EDGES,
        5,
        ["4096+"],
    )

    served = ServedReport.from_json(json.loads(json.dumps(meta)))  # as written to report.json and read back
    assert served.export.bins == ContextBins(bins, ours_by_bin)
    released = served.beside[RELEASED]
    assert released.bins == ContextBins(
        bins, {"0-1024": {"k3": 1.8, "k7": 1.8}, "1024-4096": {"k3": 1.6, "k7": 1.6}, "4096+": {"k3": 1.0, "k7": 1.0}}
    )
    # Better on the whole set (24 of 22 drafts against 14), worse on the prompts of 1024-4096 tokens: refused.
    assert (served.export.acceptance, released.acceptance) == (
        {"k3": 2.0909, "k7": 2.0909},
        {"k3": 1.6364, "k7": 1.6364},
    )
    decision = release_decision(served, released.acceptance, 1.05, released.bins, 5)
    assert (decision.promote, decision.reason) == (False, (
        "the new export serves at mean acceptance length 1.500 at k=3 on prompts of 1024-4096 tokens (5 prompts), "
        "the released drafter at 1.600 (same prompts, k and engine): not promoted, the released drafter stays"
    ))  # fmt: skip


def test_outputs_that_part_where_greedy_was_a_near_tie_are_reported_apart_and_others_fail_the_eval():
    """bf16 engines round the verify pass's logits otherwise than the plain decode's: a parting where greedy's top two
    were within NEAR_TIE_LOGPROB is not a defect; one where the choice was clear is."""
    from eagle3_assets.drafter.evaluate import NEAR_TIE_LOGPROB

    plain = GenerationResult(
        outputs=[[5, 7, 9, 2], [5, 8, 8, 2], [4, 4, 2]],
        margins=[[3.0, 1.0, NEAR_TIE_LOGPROB / 2, 2.0], [3.0, 2.5, 1.0, 2.0], [1.0, 1.0, 1.0]],
    )
    spec = GenerationResult(outputs=[[5, 7, 3, 2], [5, 6, 8, 2], [4, 4, 2]], num_drafts=4, num_accepted_tokens=2)
    report = EvalReport(prompts=3, max_tokens=4)
    report.add_run(3, False, plain, spec, log=lambda _: None)
    assert report.near_ties == [{"prompt": 0, "setting": "k=3", "position": 2, "greedy": [5, 7, 9, 2],
                                 "speculative": [5, 7, 3, 2], "top_two_gap": NEAR_TIE_LOGPROB / 2}]  # fmt: skip
    assert report.mismatches == [
        {"prompt": 1, "setting": "k=3", "position": 1, "greedy": [5, 8, 8, 2], "speculative": [5, 6, 8, 2]}
    ]
    assert not report.outputs_match
