"""The drafter's quality bars on the demo, built exactly as `make demo` builds it (issues 4 and 7).

One module fixture runs the whole graph with the demo settings through Dagster: the
demo target trained in-process, 2,000 responses, five shards, 622 drafter steps, and
`drafter_eval` in vLLM (CPU build). About 11 minutes on two CPU cores; the figures in
the assertions' comments are from `make demo` (BENCHMARKS.md).

The off-by-one test then trains a second drafter with the same settings on shards
whose aux features come from the classic bug, HF `hidden_states[i + 1]` (the OUTPUT of
layer i) stored as "input of layer i", and scores both where an engine would feed them
the correct layers.
"""

from __future__ import annotations

import shutil

import pytest
from dagster import AssetKey

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.definitions import build_definitions
from eagle3_assets.defs.demo_run import run_graph
from eagle3_assets.drafter.evaluate import EVAL_REPORT_FILE, load_eval_prompts, token_class_accuracy
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import build_drafter, train_drafter
from eagle3_assets.drafter.vllm_eval import generate_in_subprocess, generate_runs_in_subprocess
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.project import DEMO_MODEL_DIR, Project
from eagle3_assets.settings import demo_settings
from eagle3_assets.shards import plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer
from eagle3_assets.tokenized import TOKENIZED_FILE, TokenizedSet
from eagle3_assets.vocab_map import VOCAB_MAP_FILE, VocabMap

from .helpers import gpu_instance

# The module fixture runs the whole demo (~6-11 min on a quiet 2-core machine) inside the
# first test's budget; a machine shared with other work has taken over twice that.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(5400)]


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
    # Measured: k=3 2.075, k=7 2.433; features zeroed 1.399 / 1.424 -> feature gain 1.48 / 1.71.
    assert report["outputs_match_greedy"] and report["mismatches"] == []
    assert report["mean_acceptance_length_k3"] >= 2.0
    assert report["mean_acceptance_length_k7"] >= report["mean_acceptance_length_k3"]
    assert report["feature_gain_k3"] >= 1.2
    assert report["feature_gain_k7"] >= 1.2


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
    # Measured: trained 0.673 on every answer token of the held-out prompts (0.846 on the
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
    # (10 measured) are left out of `fact` and listed in `off_reference`.
    assert report["eval_rows_off_reference"] == len(report["off_reference"]) <= 16
    assert report["eval_tokens_fact"] >= 150 and report["eval_tokens_template"] >= 100  # measured 225, 148
    # Measured: template 0.939, fact 0.324: facts of unseen entities are the hard part.
    assert report["eval_acc_0_template"] > report["eval_acc_0_fact"] > 0


def test_drafter_trained_on_off_by_one_features_scores_lower_on_fact_prompts(demo, answers, tmp_path_factory):
    project, _ = demo
    shifted = side_store(demo, "off-by-one", tmp_path_factory)
    settings = project.settings
    tokenized = TokenizedSet.load(shifted.store)
    extractor = OffByOneExtractor(shifted.target(), batch_tokens=1)
    shards = plan_shards(tokenized.num_rows, settings.shard_size)
    for shard in shards:
        extract_shard(shifted.store, tokenized, shard, extractor, settings.extraction, model_name="demo")
    result = train_drafter(
        shifted.store, [s.key for s in shards], vmap=VocabMap.load(shifted.store), target=shifted.target(),
        settings=settings.training, log=lambda _: None,
    )  # fmt: skip
    export_drafter(shifted.store, result.model.trainable_state_dict(), result.config, aux_layer_ids=[1, 2, 3])
    shifted_export = shifted.store.local_path(EXPORT_DIR)

    correct = project.store.read_json(EVAL_REPORT_FILE)
    # Training metrics cannot tell: on its own (wrong) features the off-by-one drafter's
    # held-out acc_0 is as good as the correct one's (measured 0.868 vs 0.846).
    assert result.heldout["acc_0"] >= correct["heldout_acc_0"] - 0.05

    accuracy, _ = token_class_accuracy(shifted.target(), settings, shifted_export, *answers)
    # Fed the layers an engine feeds (measured acc_0, correct vs off by one): fact-prompt
    # answers 0.623 vs 0.442, their fact tokens 0.324 vs 0.169, template answers 0.939 vs 0.649.
    assert accuracy["fact_prompt"].acc[0] <= correct["eval_acc_0_fact_prompt"] - 0.09
    assert accuracy["fact"].acc[0] <= correct["eval_acc_0_fact"] - 0.07

    prompts, prompt_ids, _ = answers
    fact_prompt_ids = [ids for p, ids in zip(prompts, prompt_ids) if p.extra["kind"] == "fact"]

    right, wrong = (
        r.mean_acceptance_length
        for r in generate_runs_in_subprocess(
            project.target_dir(), fact_prompt_ids,
            [{"draft_dir": project.store.local_path(EXPORT_DIR)}, {"draft_dir": shifted_export}],
            common={"num_speculative_tokens": 3, "max_tokens": 160, "max_model_len": 512, "ignore_eos": False},
        )
    )  # fmt: skip
    # Measured, served in vLLM at k=3 on the 48 fact prompts: 1.939 correct vs 1.632 off by one.
    assert wrong <= right - 0.15, (right, wrong)
