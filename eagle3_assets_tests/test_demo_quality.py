"""The drafter's quality bars on the demo, built exactly as `make demo` builds it (issues 4 and 7).

One module fixture runs the whole graph with the demo settings through Dagster: the
demo target trained in-process, 4,000 responses, ten shards, ~1,057 drafter steps, and
`drafter_eval` in vLLM (CPU build). About 10 minutes on two quiet CPU cores; the figures
in the assertions' comments are from that run (BENCHMARKS.md).

The off-by-one test then trains two short drafters on the demo's rows, one on correct
features and one on shards whose aux features come from the classic bug, HF
`hidden_states[i + 1]` (the OUTPUT of layer i) stored as "input of layer i", and scores
both where an engine would feed them the correct layers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dagster import AssetKey

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.definitions import build_definitions
from eagle3_assets.demo_run import run_graph
from eagle3_assets.drafter.evaluate import EVAL_REPORT_FILE, load_eval_prompts, token_class_accuracy
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import build_drafter, train_drafter
from eagle3_assets.drafter.vllm_eval import generate_in_subprocess, generate_runs_in_subprocess
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.project import DEMO_MODEL_DIR, Project
from eagle3_assets.settings import TrainingSettings, demo_settings
from eagle3_assets.shards import plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer
from eagle3_assets.tokenized import TOKENIZED_FILE, TokenizedSet
from eagle3_assets.vocab_map import VOCAB_MAP_FILE, VocabMap

from .helpers import gpu_instance

# The module fixture runs the whole demo (~6-11 min on a quiet 2-core machine) inside the
# first test's budget; a machine shared with other work has taken over twice that.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(5400)]


# Both drafters of the off-by-one test: the demo's recipe for 155 steps with the feature norms
# off, batches grouped by length (the regime its figures were measured in). With
# `norm_before_fc` the 4-layer demo target's adjacent layers look alike once
# normalized and the bug costs little here (measured acc_0 on the eval answers, correct vs
# off by one: 0.550 vs 0.551 at 155 steps on 2,000 rows; fact-prompt answers 0.720 vs 0.683
# at the demo's full training). Without the norms the features' scale tells the layers
# apart, and the test shows that `drafter_eval`, unlike the training metrics, sees the shift.
OFF_BY_ONE_RECIPE = TrainingSettings.model_validate(
    demo_settings().training.model_dump()
    | {"steps": 155, "norm_before_fc": False, "norm_output": False, "norm_before_residual": False}
    | {"batch_order": "by_length", "weight_decay": 0.0}  # the regime its figures were measured in
)


class OffByOneExtractor(HFExtractor):
    """Deliberately wrong: stores HF `hidden_states[i + 1]` under aux id i."""

    def _forward(self, rows):
        correct = self.aux_layer_ids
        self.aux_layer_ids = tuple(i + 1 for i in correct)
        try:
            return super()._forward(rows)
        finally:
            self.aux_layer_ids = correct


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    project = Project(demo_settings(), ArtifactStore(tmp_path_factory.mktemp("demo-quality") / "store"))
    with gpu_instance() as instance:
        assert run_graph(build_definitions(project), instance)
        yield project, instance


@pytest.fixture(scope="module")
def answers(demo):
    """The eval prompts, their generation prompt ids and the target's greedy answers (from vLLM)."""
    project, _ = demo
    prompts = load_eval_prompts(project.store)
    tokenizer = load_tokenizer(project.target())
    prompt_ids = [generation_prompt_ids(tokenizer, p.messages) for p in prompts]
    plain = generate_in_subprocess(project.target_dir(), prompt_ids, max_tokens=160, max_model_len=512, ignore_eos=False)
    return prompts, prompt_ids, plain.outputs


def side_store(demo, name: str, tmp_path_factory) -> Project:
    """A store with the demo's target, tokenized rows and vocab map, for a second drafter."""
    project, _ = demo
    root = tmp_path_factory.mktemp(name) / "store"
    shutil.copytree(project.store.local_path(DEMO_MODEL_DIR), root / DEMO_MODEL_DIR)
    for rel in (TOKENIZED_FILE, VOCAB_MAP_FILE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(project.store.local_path(rel), root / rel)
    return Project(project.settings, ArtifactStore(root))


def test_served_drafter_meets_the_acceptance_bar_and_reads_the_target(demo):
    project, _ = demo
    report = project.store.read_json(EVAL_REPORT_FILE)
    # Measured: k=3 2.518, k=7 3.161 (issue 13's bars: 2.3, 2.8); feature gain (over the
    # same drafter with its features zeroed) 1.230 / 1.290 (bar 1.2). Thresholds a little under
    # the measured figures: another CPU's float kernels train a slightly different drafter.
    assert report["outputs_match_greedy"] and report["mismatches"] == []
    assert report["mean_acceptance_length_k3"] >= 2.3
    assert report["mean_acceptance_length_k7"] >= 2.8
    assert report["feature_gain_k3"] >= 1.18
    assert report["feature_gain_k7"] >= 1.22


def test_trained_drafter_is_far_above_an_untrained_one_on_heldout_acc_0(demo, answers, tmp_path_factory):
    project, _ = demo
    report = project.store.read_json(EVAL_REPORT_FILE)
    untrained = side_store(demo, "untrained", tmp_path_factory)
    vmap = VocabMap.load(untrained.store)
    target = untrained.target()
    cfg = DrafterConfig.from_target(target, draft_vocab_size=len(vmap.d2t))
    model = build_drafter(cfg, load_target_weights(target), vmap, project.settings.training.seed)
    export_drafter(untrained.store, model.trainable_state_dict(), cfg, aux_layer_ids=[1, 2, 3])
    accuracy, _ = token_class_accuracy(target, project.settings, untrained.store.local_path(EXPORT_DIR), *answers)
    # Measured: trained 0.775 on every answer token of the held-out prompts (0.926 on the
    # rows held out of training); untrained 0.001.
    assert report["eval_acc_0_all"] >= accuracy["all"].acc[0] + 0.4, (report["eval_acc_0_all"], accuracy["all"].acc)
    assert report["heldout_acc_0"] >= 0.75


def test_fact_and_template_tokens_are_scored_apart(demo):
    project, instance = demo
    report = project.store.read_json(EVAL_REPORT_FILE)
    event = instance.get_latest_materialization_event(AssetKey("drafter_eval"))
    shown = {k: v.value for k, v in event.asset_materialization.metadata.items()}  # what the UI lists
    for key in ("eval_acc_0_fact", "eval_acc_0_template", "feature_gain_k3", "feature_gain_k7"):
        assert shown[key] == report[key], key
    # 48 fact prompts about held-out entities; the two-entity questions the target gets wrong
    # (13 measured) are left out of `fact` and listed in `off_reference`.
    assert report["eval_rows_off_reference"] == len(report["off_reference"]) <= 16
    assert report["eval_tokens_fact"] >= 150 and report["eval_tokens_template"] >= 100  # measured 226, 148
    # Measured: template 0.986, fact 0.478: facts of unseen entities are the hard part.
    assert report["eval_acc_0_template"] > report["eval_acc_0_fact"] > 0


def test_drafter_trained_on_off_by_one_features_scores_lower_on_fact_prompts(demo, answers, tmp_path_factory):
    project, _ = demo
    prompts, prompt_ids, _ = answers
    exports, heldout, accuracy = {}, {}, {}
    for name, extractor_class in (("correct", HFExtractor), ("shifted", OffByOneExtractor)):
        side = side_store(demo, name, tmp_path_factory)
        exports[name], heldout[name] = train_on_own_shards(side, extractor_class)
        accuracy[name], _ = token_class_accuracy(side.target(), side.settings, exports[name], *answers)

    # Training metrics cannot tell: on its own (wrong) features the off-by-one drafter's
    # held-out acc_0 is as good as the correct one's (measured 0.589 vs 0.574).
    assert heldout["shifted"] >= heldout["correct"] - 0.05
    # Fed the layers an engine feeds (measured acc_0, correct vs off by one): all answers
    # 0.523 vs 0.431, fact-prompt answers 0.526 vs 0.420, fact tokens 0.235 vs 0.173.
    right, wrong = accuracy["correct"], accuracy["shifted"]
    assert wrong["all"].acc[0] <= right["all"].acc[0] - 0.06
    assert wrong["fact_prompt"].acc[0] <= right["fact_prompt"].acc[0] - 0.06

    fact_prompt_ids = [ids for p, ids in zip(prompts, prompt_ids) if p.extra["kind"] == "fact"]
    served_right, served_wrong = (
        r.mean_acceptance_length
        for r in generate_runs_in_subprocess(
            project.target_dir(), fact_prompt_ids, [{"draft_dir": exports["correct"]}, {"draft_dir": exports["shifted"]}],
            common={"num_speculative_tokens": 3, "max_tokens": 160, "max_model_len": 512, "ignore_eos": False},
        )
    )  # fmt: skip
    # Measured, served in vLLM at k=3 on the 48 fact prompts: 1.726 correct vs 1.568 off by one.
    assert served_wrong <= served_right - 0.07, (served_right, served_wrong)


def train_on_own_shards(side: Project, extractor_class: type[HFExtractor]) -> tuple[Path, float]:
    """Extract the side store's shards with `extractor_class`, train OFF_BY_ONE_RECIPE on them
    and export; returns the export and the held-out acc_0 on those same features."""
    settings = side.settings.model_copy(update={"training": OFF_BY_ONE_RECIPE})
    tokenized = TokenizedSet.load(side.store)
    extractor = extractor_class(side.target(), batch_tokens=1)
    shards = plan_shards(tokenized.num_rows, settings.shard_size)
    for shard in shards:
        extract_shard(side.store, tokenized, shard, extractor, settings.extraction, model_name="demo")
    result = train_drafter(
        side.store, [s.key for s in shards], vmap=VocabMap.load(side.store), target=side.target(),
        settings=settings.training, log=lambda _: None,
    )  # fmt: skip
    export_drafter(side.store, result.model.trainable_state_dict(), result.config, aux_layer_ids=[1, 2, 3])
    return side.store.local_path(EXPORT_DIR), result.heldout["acc_0"]
