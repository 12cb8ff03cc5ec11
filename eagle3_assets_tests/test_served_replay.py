"""vLLM's speculative rounds replayed (issue 54, item 3): the round arithmetic, the verdict and its message, and what
an export tells an engine against what trained. vLLM's own counters against the replay: test_drafter_vllm.py
(EAGLE-3, every norm placement, and a misaligned export) and test_dflash.py (DFlash)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_assets.drafter.dflash_model import DFlashDrafter
from eagle3_assets.drafter.family import DFlash, Eagle3
from eagle3_assets.drafter.served_replay import (
    SERVED_AS,
    ReplayCheck,
    Rounds,
    replay_rounds,
    trained_served_as,
)
from eagle3_assets.settings import DFlashSettings, TrainingSettings
from eagle3_assets.storage import ArtifactStore

from .helpers import AUX_IDS, random_vocab_map
from .test_dflash import tiny_config
from .test_drafter_model import CFG, make_model


def test_rounds_accept_the_leading_drafts_that_equal_the_answer_and_start_past_them():
    ids = [5, 6, 10, 11, 12, 13, 14, 15]  # a 2-token prompt, then the greedy answer
    drafted = torch.full((2, len(ids)), 99)
    drafted[:, 1] = torch.tensor([11, 98])  # round 1 (last verified index 1): the first draft right, the second not
    drafted[:, 3] = torch.tensor([13, 14])  # round 2 starts at index 4: both right
    drafted[:, 6] = torch.tensor([15, 0])  # never drafted: the answer is served by then
    assert replay_rounds(drafted, ids, start=2, served=6) == Rounds(2, [2, 1])
    # Three tokens served: one round, and the request is done.
    assert replay_rounds(drafted, ids, start=2, served=3) == Rounds(1, [1, 0])
    assert Rounds(2, [2, 1]) + Rounds(1, [1, 0]) == Rounds(3, [3, 1])
    assert Rounds(4, [3, 1]).rates == [0.75, 0.25]


def test_drafts_past_the_answers_end_in_its_last_round_are_what_vllm_may_count_beside_the_replay():
    """vLLM counts a round's accepted drafts before it cuts the output at the stop token: in the last round, drafts past
    the answer's end may count as accepted (the target verified them against its continuation past the stop, which no
    answer holds). Measured on a small demo whose drafter went on drafting the template past the end of turn: vLLM
    counted 97 accepted drafts at k=7 that were never output, and the check failed a drafter vLLM served as trained."""
    ids = [5, 6, 10, 11, 2]  # a 2-token prompt, then the greedy answer, ending in its stop token 2
    drafted = torch.full((3, len(ids)), 99)
    drafted[:, 1] = torch.tensor([11, 2, 7])  # the last round: both drafts up to the stop right, the third past it
    assert replay_rounds(drafted, ids, start=2, served=3) == Rounds(1, [1, 1, 0], past_end=[0, 0, 1])
    drafted[1, 1] = 98  # the stop token not drafted: the round ends at it, nothing lies past the end
    assert replay_rounds(drafted, ids, start=2, served=3) == Rounds(1, [1, 0, 0])
    assert Rounds(1, [1, 1, 0], [0, 0, 1]) + Rounds(1, [1, 0, 0]) == Rounds(2, [2, 1, 0], [0, 0, 1])
    # The check: vLLM may count them, never fewer than the replay's own, nor more than both.
    replayed = Rounds(100, [80, 40, 10], past_end=[0, 10, 20])
    assert ReplayCheck(3, Rounds(100, [80, 48, 28]), replayed).passed
    assert ReplayCheck(3, Rounds(100, [80, 48, 28]), replayed).describe().startswith(
        "k=3: vLLM accepted per position [0.800, 0.480, 0.280] over 100 drafts, the trained drafter replayed "
        "[0.800, 0.400, 0.100] over 100 (and up to [0.000, 0.100, 0.200] more past the answers' ends): within 0.040"
    )
    assert ReplayCheck(3, Rounds(100, [80, 48, 35]), replayed).parted_at == 2  # more than past the ends allows
    assert ReplayCheck(3, Rounds(100, [80, 35, 10]), replayed).parted_at == 1  # fewer than the replay's own
    assert ReplayCheck(3, Rounds(100, [80, 48, 28]), Rounds(100, [80, 40, 10])).parted_at == 1  # none past the ends


def test_a_check_names_the_first_position_that_parts_and_the_suspects():
    served, replayed = Rounds(100, [80, 20, 5]), Rounds(100, [81, 60, 30])
    suspect = "the export says norm_output True, the drafter trained with False"
    check = ReplayCheck(3, served, replayed, suspects=[suspect])
    assert (check.passed, check.parted_at) == (False, 1)
    assert check.describe() == (
        "k=3: vLLM accepted per position [0.800, 0.200, 0.050] over 100 drafts, the trained drafter replayed "
        "[0.810, 0.600, 0.300] over 100: they part at position 1 (by more than 0.040). Suspects: the export says "
        "norm_output True, the drafter trained with False"
    )
    same = ReplayCheck(3, served, Rounds(100, [82, 21, 4]))
    assert same.passed and same.describe().endswith("within 0.040 at every position")  # 0.03 and one draft in 100
    # Answers vLLM served otherwise past a near tie widen the tolerance by their tokens' share of the drafts.
    assert ReplayCheck(3, served, Rounds(100, [80, 27, 5]), slack=0.05).passed
    assert not ReplayCheck(3, served, Rounds(100, [80, 27, 5])).passed
    unexplained = ReplayCheck(3, served, replayed).describe()
    assert unexplained.endswith("Suspects: the export's config is the trained one: a weight vLLM's loader never read, "
                                "or a rotary or norm layout vLLM's model computes otherwise")  # fmt: skip
    assert check.as_json()["served_per_position"] == [0.8, 0.2, 0.05]


def _exported(tmp_path: Path, family, model, cfg, aux_layer_ids) -> Path:
    store = ArtifactStore(tmp_path / "store")
    trained_on = {SERVED_AS: family.served_as(cfg, aux_layer_ids)}
    family.export(store, model.trainable_state_dict(), cfg, aux_layer_ids, "export", trained_on=trained_on)
    return store.local_path("export")


def _edit_config(export_dir: Path, **changes) -> None:
    config = json.loads((export_dir / "config.json").read_text())
    for path, value in changes.items():
        *parents, name = path.split("__")
        at = config
        for p in parents:
            at = at[p]
        at[name] = value
    (export_dir / "config.json").write_text(json.dumps(config))


def test_an_eagle3_export_says_what_trained_until_its_config_is_edited(tmp_path: Path):
    family = Eagle3(TrainingSettings())
    export_dir = _exported(tmp_path, family, make_model(), CFG, AUX_IDS)
    trained, suspects = trained_served_as(family, export_dir)
    assert trained == CFG.to_dict() | {"aux_layer_ids": AUX_IDS} and suspects == []
    model, aux = family.load_as(export_dir, torch.randn(CFG.vocab_size, CFG.hidden_size), trained)
    assert aux == AUX_IDS and model.config == CFG

    _edit_config(export_dir, norm_output=not CFG.norm_output, eagle_aux_hidden_state_layer_ids=[2, 3, 4])
    trained, suspects = trained_served_as(family, export_dir)
    assert suspects == [
        f"the export says norm_output {not CFG.norm_output}, the drafter trained with {CFG.norm_output}",
        "the export says aux_layer_ids [2, 3, 4], the drafter trained with [1, 2, 3]",
    ]
    # The replay reads the drafter as it trained, whatever the config says now.
    model, aux = family.load_as(export_dir, torch.randn(CFG.vocab_size, CFG.hidden_size), trained)
    assert aux == AUX_IDS and model.config == CFG

    # Without the trainer's record (a published drafter): replayed as its config says, nothing to suspect there.
    (export_dir / "trained_on.json").write_text("{}")
    trained, suspects = trained_served_as(family, export_dir)
    assert trained["aux_layer_ids"] == [2, 3, 4] and suspects == []


def test_a_dflash_export_served_with_another_rotary_layout_is_a_suspect(tmp_path: Path):
    cfg = tiny_config(draft_vocab_size=128)
    vmap = random_vocab_map(300, 128)
    model = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=torch.randn(300, 64))
    family = DFlash(TrainingSettings(), DFlashSettings(), mask_token_id=0)
    export_dir = _exported(tmp_path, family, model, cfg, AUX_IDS)
    trained, suspects = trained_served_as(family, export_dir)
    assert suspects == [] and trained["is_neox_style"] is True and trained["aux_layer_ids"] == AUX_IDS
    _edit_config(export_dir, is_neox_style=False)
    _, suspects = trained_served_as(family, export_dir)
    assert suspects == ["the export says is_neox_style False, the drafter trained with True"]


def test_a_dflash_drafter_drafts_every_round_of_a_row_the_same_in_chunks_of_anchors(monkeypatch):
    """A long row's blocks are drafted a chunk of anchors at a time (each block attends to the whole context): the
    same drafts as all at once, and none at the last index, where no round starts."""
    from eagle3_assets.drafter import family as families

    cfg = tiny_config(draft_vocab_size=128)
    vmap = random_vocab_map(300, 128)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=torch.randn(300, 64)).eval()
    dflash = DFlash(TrainingSettings(), DFlashSettings(), mask_token_id=0)
    ids, aux = torch.randint(1, 300, (1, 11)), torch.randn(1, 11, 3 * 64)
    whole = dflash.drafted(model, ids, aux, 3)
    monkeypatch.setattr(families, "REPLAY_ANCHORS", 4)
    assert torch.equal(dflash.drafted(model, ids, aux, 3), whole)
    assert whole.shape == (3, 11) and whole[:, -1].tolist() == [-1, -1, -1]
    assert bool((vmap.t2d[whole[:, :-1]]).all())  # every draft is a target id the draft vocab holds


def test_replay_served_holds_vllms_counters_to_the_rounds_the_drafter_drafts_on_the_answers():
    """`replay_served` as drafter_eval calls it: per row, the drafter's rounds over prompt + answer; vLLM's counters
    equal to them pass, counters of another drafter part at the position they differ; an answer vLLM served otherwise
    past a near tie is replayed up to there, its remaining tokens allowed on top."""
    import numpy as np

    from eagle3_assets.drafter.served_replay import replay_served
    from eagle3_assets.drafter.vllm_eval import GenerationResult
    from eagle3_assets.hidden_states.base import ExtractedSample

    family, model = Eagle3(TrainingSettings()), make_model().eval()
    torch.manual_seed(0)
    rows = [torch.randint(0, 256, (12,)) for _ in range(3)]
    samples = [ExtractedSample(i, r.numpy().astype(np.int32), torch.randn(12, 3 * 64), torch.randn(12, 64))
               for i, r in enumerate(rows)]  # fmt: skip
    starts = [4, 5, 4]
    # What the drafter itself drafts, replayed by hand: the counters vLLM would report serving the answers.
    want = Rounds(0, [0, 0, 0])
    for s, start in zip(samples, starts, strict=True):
        drafted = family.drafted(model, torch.as_tensor(s.input_ids.tolist())[None], s.aux_hidden_states[None], 3)
        want += replay_rounds(drafted, s.input_ids.tolist(), start, len(s.input_ids) - start)
    answers = [s.input_ids[start:].tolist() for s, start in zip(samples, starts, strict=True)]
    served = GenerationResult(answers, num_drafts=want.drafts, accepted_per_position=want.accepted)
    (check,) = replay_served(family, model, samples, starts, {3: served}, [])
    assert check.passed and (check.served, check.replayed) == (want, want) and check.slack == 0.0
    other = GenerationResult(answers, num_drafts=want.drafts, accepted_per_position=[want.drafts, 0, 0])
    (check,) = replay_served(family, model, samples, starts, {3: other}, ["a suspect"])
    assert (check.passed, check.parted_at) == (False, 0) and check.describe().endswith("Suspects: a suspect")
    # The first answer served otherwise from its third token on: 6 of its 8 tokens are no longer the replay's.
    parted = [answers[0][:2] + [(answers[0][2] + 1) % 256] + answers[0][3:], *answers[1:]]
    (check,) = replay_served(family, model, samples, starts, {3: GenerationResult(parted, num_drafts=10,
                             accepted_per_position=want.accepted)}, [])  # fmt: skip
    assert check.slack == 6 / 10
