"""`drafter_eval` in vLLM (CPU build) with a reference drafter and an imported release served beside ours, and the
release gate on what it served. The reference is imported as the store's release (`start_from`) and served alone first
(`release_baseline.py`: plain, then at k=3 and k=7); the eval reads those passes, for the release and the reference
alike (the same files): eight engine starts in all (the eval's plain pass again, ours at k=3 and k=7, features kept
and zeroed). The prompts span two context bins, so each pass reads vLLM's counters per bin (issue 43, item 7). With
`traffic` set, the traffic's held-out prompts are served in the same passes, and each drafter is reported on each prompt
set (issue 53, item 3); the report without it is held by the unit tests of its form (test_context_bins.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE, ORIGINAL_SET, PROMPT_SETS, TRAFFIC_SET, ServedReport
from eagle3_assets.drafter.evaluate import REFERENCE, eval_prompt_ids, evaluate_drafter
from eagle3_assets.drafter.export import export_drafter
from eagle3_assets.drafter.family import build_drafter
from eagle3_assets.drafter.imported_release import install_start_from
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.release import (
    RELEASED,
    export_digest,
    release_decision,
    released_figures,
    released_sets,
    traffic_decision,
)
from eagle3_assets.drafter.release_baseline import Baseline, serve_release_baseline
from eagle3_assets.drafter.served_passes import PASSES_DIR
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, Prompt, dump_prompts
from eagle3_assets.provenance import Provenance, Record, write_record
from eagle3_assets.release_record import read_release_record
from eagle3_assets.settings import EvaluationSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer
from eagle3_assets.traffic import TRAFFIC_HELDOUT_FILE
from eagle3_assets.traffic_settings import TrafficSettings
from eagle3_assets.vocab_map import VocabMap

from .conftest import tiny_settings
from .vllm_helpers import AUX, PROMPTS, confident_target

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

DRAFT_VOCAB = 64
MAX_TOKENS = 12


@pytest.mark.timeout(1200)
def test_a_reference_drafter_is_served_beside_ours_and_a_zeroed_head_is_never_released(tiny_target_dir, tmp_path):
    pytest.importorskip("vllm")
    target_dir = confident_target(tiny_target_dir, tmp_path / "target")
    target = TargetModel.read(target_dir, aux_layer_ids=AUX)
    store = ArtifactStore(tmp_path / "store")
    prompts = [Prompt(f"eval-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS[:4])]
    store.write_text(EVAL_PROMPTS_FILE, dump_prompts(prompts))
    traffic = [Prompt(f"traffic-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS[4:6])]
    store.write_text(TRAFFIC_HELDOUT_FILE, dump_prompts(traffic))
    # Context bins split at the longest prompt's length: the longest ones in a bin of their own, too small at 2.
    lengths = [len(ids) for ids in eval_prompt_ids(load_tokenizer(target), prompts + traffic, {})[0]]
    edge = max(lengths)
    short, long = f"0-{edge}", f"{edge}+"
    counts = {short: sum(n < edge for n in lengths), long: sum(n >= edge for n in lengths)}
    assert counts[short] >= 2 and counts[long] >= 1, lengths
    t2d = np.zeros(target.vocab_size, dtype=bool)
    t2d[:DRAFT_VOCAB] = True
    vmap = VocabMap(np.zeros(DRAFT_VOCAB, dtype=np.int64), t2d)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB)
    drafter = build_drafter(cfg, load_target_weights(target), vmap, seed=0)
    # The reference: an untrained drafter with the target's head rows. Ours: the same with its head zeroed, an
    # export that drafts one token for ever (serving at acceptance 1.0, as a head an engine ignored would).
    export_drafter(store, drafter.trainable_state_dict(), cfg, aux_layer_ids=AUX, dtype="float32", rel="reference")
    zeroed = drafter.trainable_state_dict() | {"lm_head.weight": torch.zeros_like(drafter.lm_head.weight)}
    export_drafter(store, zeroed, cfg, aux_layer_ids=AUX, dtype="float32")
    reference_dir = store.local_path("reference")
    # Issue 53: the reference, a drafter in the EAGLE-3 layout, is also the store's starting release (imported).
    write_record(store, Record(Provenance("target_model", {}, {}, 1), version="target-v1"))  # what passes are kept by
    settings = tiny_settings(
        target_model=str(target_dir),
        evaluation=EvaluationSettings(
            max_new_tokens=MAX_TOKENS,
            reference_drafter=str(reference_dir),
            context_bins=[0, edge],
            min_prompts_per_bin=max(2, counts[long] + 1),
        ),
        traffic=TrafficSettings(log=str(tmp_path / "gateway.jsonl")),  # its held-out split, written above, is served
        start_from={"drafter": str(reference_dir)},
    )
    lines: list[str] = []
    assert install_start_from(store, settings, target).installed
    baseline = serve_release_baseline(store, target, settings, log=lines.append)
    report = evaluate_drafter(store, target, settings, log=lines.append)

    assert report.outputs_match, report.mismatches
    written = store.read_json(EVAL_REPORT_FILE)
    # vLLM's form: greedy, the chat template, k=3 and k=7, mean acceptance and the rate per draft position.
    assert (written["greedy"], written["chat_template"], written["max_tokens"]) == (True, True, MAX_TOKENS)
    assert written["prompts_file"] == "embedded demo eval prompts" and written["engine"].startswith("vllm 0.")
    assert written["export_sha256"] == export_digest(store)
    assert written["mean_acceptance_length_k3"] == written["mean_acceptance_length_k7"] == 1.0  # the zeroed head
    assert [len(written[f"acceptance_per_position_k{k}"]) for k in (3, 7)] == [3, 7]
    ref = written["beside"][REFERENCE]
    assert ref["dir"] == str(reference_dir) and ref["outputs_match_greedy"] is True
    assert [len(ref[f"acceptance_per_position_k{k}"]) for k in (3, 7)] == [3, 7]
    for k in (3, 7):
        assert written[f"reference_mean_acceptance_length_k{k}"] == ref[f"mean_acceptance_length_k{k}"] >= 1.0
        assert ref[f"mean_acceptance_length_k{k}"] == pytest.approx(1 + sum(ref[f"acceptance_per_position_k{k}"]), abs=1e-3)
    assert any(line.startswith("drafter_eval: pass 5/5 (k=7 features zeroed) done at") for line in lines), lines
    # Per context bin, from each bin's own counters: ours at 1.0 in both; the reference's whole-set figure is a
    # mean of its bins' (weighted by drafts), so it lies between them.
    assert (written["prompts_by_context_bin"], written["context_bins_too_small"]) == (counts, [long])
    assert written["mean_acceptance_length_by_context_bin"] == {b: {"k3": 1.0, "k7": 1.0} for b in (short, long)}
    assert ref["prompts_by_context_bin"] == counts and list(ref["mean_acceptance_length_by_context_bin"]) == [short, long]
    for k in (3, 7):
        by_bin = [ref["mean_acceptance_length_by_context_bin"][b][f"k{k}"] for b in (short, long)]
        assert min(by_bin) - 1e-3 <= ref[f"mean_acceptance_length_k{k}"] <= max(by_bin) + 1e-3, (k, by_bin, ref)
    assert f"context bins with fewer than evaluation.min_prompts_per_bin {counts[long] + 1} prompts" in "\n".join(lines)
    assert_prompt_sets(written, counts, lines, store.url_of(TRAFFIC_HELDOUT_FILE))

    # The import was served alone first; the eval read those passes, so the gate holds the very figures it served.
    served = ServedReport.read(store)
    assert_served_first(store, baseline, served, lines)
    decision = release_decision(served, released_figures(store, served), settings.evaluation.release_min_acceptance)
    assert not decision.promote and decision.released == baseline.served.acceptance
    assert decision.reason.startswith("the new export serves at mean acceptance length 1.000 at k=3, below")
    on_sets = traffic_decision(
        served, released_sets(store, served), settings.evaluation.release_min_acceptance, 0.02
    )
    assert not on_sets.promote and on_sets.released == baseline.served.sets[TRAFFIC_SET].acceptance
    assert on_sets.reason.startswith(
        "the new export serves at mean acceptance length 1.000 at k=3 on the traffic's held-out prompts, below"
    )


def assert_served_first(store: ArtifactStore, baseline: Baseline, served: ServedReport, lines: list[str]) -> None:
    """The import's figures as the baseline served them, in its record and in the eval's report (read, not served)."""
    figures = baseline.served
    assert figures is not None and figures.outputs_match_greedy and set(figures.acceptance) == {"k3", "k7"}
    assert set(figures.sets) == {ORIGINAL_SET, TRAFFIC_SET}
    record = read_release_record(store)
    assert record.released_on.acceptance == figures.acceptance and record.sets[TRAFFIC_SET].acceptance == (
        figures.sets[TRAFFIC_SET].acceptance
    )
    assert record.reason == baseline.reason and baseline.reason.endswith(
        "served alone on the held-out prompts before any export: "
        + ", ".join(f"k={k[1:]} {v:.3f}" for k, v in figures.acceptance.items())
    )
    assert served.beside[RELEASED] == figures and figures.sha256 == record.export_sha256
    # The reference is the import's files: a pass is the files vLLM loads, so its passes are the baseline's too.
    assert "drafter_eval: 4 of the 9 passes served before from the same target, prompts, drafter and engine, their " \
        f"figures read from {store.url_of(PASSES_DIR)}: released k=3, released k=7, reference k=3, reference k=7" \
        in lines, lines  # fmt: skip
    assert any(line.startswith("drafter_eval: serving 5 of the 9 passes (plain, k=3, k=3 features zeroed, k=7, k=7 "
                               "features zeroed)") for line in lines), lines  # fmt: skip
    assert served.beside[REFERENCE].acceptance == figures.acceptance


def assert_prompt_sets(written: dict, counts: dict[str, int], lines: list[str], traffic_file: str) -> None:
    """Each prompt set in the same passes: ours at 1.0 on both, the reference's whole-set figure between its sets'."""
    assert any(line.startswith("drafter_eval: 6 held-out prompts (4 original, 2 traffic) decoded") for line in lines)
    sets, ref = written[PROMPT_SETS], written["beside"][REFERENCE]
    assert {s: (e["prompts"], e["prompts_file"]) for s, e in sets.items()} == {
        ORIGINAL_SET: (4, "embedded demo eval prompts"), TRAFFIC_SET: (2, traffic_file)
    }  # fmt: skip
    assert {b: sum(e["prompts_by_context_bin"][b] for e in sets.values()) for b in counts} == counts
    assert [sets[s][f"mean_acceptance_length_k{k}"] for s in sets for k in (3, 7)] == [1.0] * 4
    for k in (3, 7):
        by_set = [ref[PROMPT_SETS][s][f"mean_acceptance_length_k{k}"] for s in (ORIGINAL_SET, TRAFFIC_SET)]
        assert min(by_set) - 1e-3 <= ref[f"mean_acceptance_length_k{k}"] <= max(by_set) + 1e-3, (k, by_set, ref)
