"""The drafter's quality on the demo, at two sizes of one graph (issues 4, 7 and 41).

One module fixture runs the whole graph through the one start command, `python -m
eagle3_assets.start`, into a real $DAGSTER_HOME: the demo target trained in-process, the
responses, the shards, the drafter, `drafter_eval` in vLLM (CPU build) and `drafter_release`.
The first start is killed outright in the middle of the second shard; the same command,
started again, finishes it and redoes nothing that was finished.

Two sizes (`EAGLE3_DEMO_SIZE`):
- `small`, in `make test`: the smallest demo that still shows what the full one shows, that the
  served drafter reads the target's features (acceptance over the same drafter with its features
  zeroed), its output equals greedy decoding, kill and resume redo nothing, and the release gate
  releases what `drafter_eval` measured. Its bars were measured at that size, with margin.
- `full`, `make bench-demo`: exactly the graph `make demo` builds (4,000 prompts, ten shards,
  ~1,057 drafter steps), held to the quality bars of BENCHMARKS.md (`accept`, `acc`), plus the
  off-by-one and topic-drift drafters, which need the full demo's rows (`off-by-one`, `topic drift`).

The off-by-one test trains two short drafters on the demo's rows, one on correct features and
one on shards whose aux features come from the classic bug, HF `hidden_states[i + 1]` (the OUTPUT
of layer i) stored as "input of layer i", and scores both where an engine would feed them the
correct layers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter, DagsterInstance

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.crash_points import CRASH_ENV
from eagle3_assets.defs.drafter.assets import DRAFTER_RELEASE, RELEASE_CHECK, SERVED_CHECK, eval_key
from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE
from eagle3_assets.drafter.evaluate import load_eval_prompts, token_class_accuracy
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.family import build_drafter
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.release import export_digest
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.demo.target import read_build_info
from eagle3_assets.drafter.served_passes import PASSES_DIR, REPORT_KEYS
from eagle3_assets.drafter.vllm_eval import GenerationResult, generate_runs_in_subprocess
from eagle3_assets.families import family_spec
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.project import DEMO_MODEL_DIR, Project
from eagle3_assets.responses import read_responses
from eagle3_assets.release_record import RELEASE_RECORD
from eagle3_assets.settings import CONFIG_ENV, Settings, TrainingSettings, demo_settings
from eagle3_assets.shard_window import write_check_record
from eagle3_assets.shards import plan_shards
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer
from eagle3_assets.tokenized import TOKENIZED_FILE, TokenizedSet
from eagle3_assets.vocab_map import VOCAB_MAP_FILE, VocabMap

from .helpers import REPO
from .test_demo_target import UNTRAINED_FACT_VALUES

# The module fixture runs the whole demo inside the first test's budget: the small one takes
# minutes, the full one ~6-11 min on a quiet 2-core machine and over twice that on a shared one.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(5400)]

SIZE_ENV = "EAGLE3_DEMO_SIZE"


@dataclass(frozen=True)
class DemoSize:
    """One size of the demo and the bars it is held to. Each bar sits a little under the figure measured at that
    size (in the comment beside it): another CPU's float kernels, and a loaded machine's thread timing, train a
    slightly different drafter."""

    overrides: dict = field(default_factory=dict)  # over demo_settings(); empty = `make demo` itself
    shards: int = 10
    k3: float = 2.0  # mean acceptance length served at k=3 ...
    k7: float = 2.4  # ... and k=7
    gain_k3: float = 1.1  # over the same drafter with its features zeroed, at k=3 ...
    gain_k7: float = 1.15  # ... and k=7
    heldout_acc_0: float = 0.75
    over_untrained: float = 0.4  # acc_0 on every eval answer token, above an untrained drafter's
    fact_tokens: int = 150  # eval answer tokens scored as facts ...
    template_tokens: int = 100  # ... and as template
    off_reference: int = 16  # two-entity questions the target answers wrongly, left out of `fact`
    full: bool = True  # the figures that need the full demo's rows: off-by-one, topic drift

    def settings(self) -> Settings:
        data = demo_settings().model_dump()
        for section, values in self.overrides.items():
            data[section] = data[section] | values if isinstance(values, dict) else values
        return Settings.model_validate(data)


SIZES = {
    # `make demo` as it is, its target trained to the end (3,000 steps). Measured (BENCHMARKS.md `demo bars`,
    # 2026-12-07): k=3 2.131, k=7 2.553 (2.131-2.168 / 2.553-2.602 across three CPU kernel settings, `demo target
    # converged`); feature gain 1.143 / 1.189; held-out rows acc_0 0.993, eval answers 0.683 (untrained ~0.001);
    # fact / template eval tokens 307 / 148, 3 answers off the reference.
    "full": DemoSize(),
    # 1,200 prompts (three shards), a target trained 600 steps, 8 epochs of the drafter (136 steps), 64 tokens
    # decoded per eval prompt. Measured, the same in `make test` (fresh clone, the fixture 211 s) and alone (target
    # on 2 threads): k=3 2.030, k=7 2.307; feature gain 1.445 / 1.598; held-out rows acc_0 0.667, eval answers
    # 0.636 (0.634 on drafter_eval's own 64-token answers; an untrained drafter: ~0.001); fact / template eval tokens
    # 161 / 148, 29 answers off the reference.
    "small": DemoSize(
        overrides={
            "demo": {"num_prompts": 1200, "train_steps": 600},
            "training": {"epochs": 8.0, "warmup_steps": 10, "checkpoint_every": 50, "heldout_rows": 32},
            # DFlash's own schedule: the demo's 16 epochs of 2 layers and every anchor cost ~0.9 CPU-s a step (its old
            # recipe ~0.2, BENCHMARKS.md `dflash recipe`); one epoch (~20 steps) keeps its training to ~20 CPU-s.
            # Nothing here holds DFlash to a bar: it must serve greedy output and lose the release to EAGLE-3.
            "dflash": {"epochs": 1.0},
            "evaluation": {"max_new_tokens": 64},
        },
        shards=3, k3=1.8, k7=2.0, gain_k3=1.25, gain_k7=1.3, heldout_acc_0=0.55, over_untrained=0.45,
        fact_tokens=100, template_tokens=100, off_reference=40, full=False,
    ),  # fmt: skip
}
try:
    SIZE = SIZES[os.environ.get(SIZE_ENV, "small")]
except KeyError:
    raise ValueError(f"{SIZE_ENV}={os.environ[SIZE_ENV]!r}: name one of {sorted(SIZES)}") from None
full_size_only = pytest.mark.skipif(
    not SIZE.full, reason=f"needs the full demo's rows: `make bench-demo` ({SIZE_ENV}=full) runs it"
)


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
    base = tmp_path_factory.mktemp("demo-quality")
    home, root = base / "home", base / "store"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, CRASH_ENV)}
    env |= {"DAGSTER_HOME": str(home), "EAGLE3_ROOT": str(root)}
    settings = SIZE.settings()
    if SIZE.overrides:
        (base / "eagle3.yaml").write_text(settings.model_dump_json())
        env[CONFIG_ENV] = str(base / "eagle3.yaml")
    command = [sys.executable, "-m", "eagle3_assets.start"]
    # Killed outright after 50 samples of the second shard (an OOM kill, a lost node) ...
    killed = subprocess.run(command, cwd=REPO, env=env | {CRASH_ENV: "extracted:rows_400-800:50"}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    # Shards run side by side, so how many finished before the kill depends on the machine's load (one on quiet
    # cores, eight of ten on loaded ones) ...
    with DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("hidden_states")), limit=100)
        done = {r.event_log_entry.dagster_event.partition for r in records.records}
    # ... and the same command finishes the graph, redoing nothing that was finished: it extracts exactly the others.
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    runs = [line.removeprefix("[start] ") for line in resumed.stdout.splitlines() if line.endswith(": starting")]
    shards = sorted(line for line in runs if line.startswith("hidden_states["))
    every = {shard.key for shard in plan_shards(SIZE.shards * settings.shard_size, settings.shard_size)}
    assert "rows_400-800" not in done and shards == sorted(f"hidden_states[{k}]: starting" for k in every - done), runs
    assert not {"prompts,target_model: starting", "responses: starting", "tokenized: starting"} & set(runs), runs
    log = resumed.stdout + resumed.stderr
    # drafter_eval reports each of its five vLLM passes as it finishes, not all at the end.
    assert [p for p in range(1, 6) if f"drafter_eval: pass {p}/5 (" in log] == [1, 2, 3, 4, 5]
    project = Project(settings, ArtifactStore(root))
    with DagsterInstance.from_config(str(home)) as instance:
        resumed_shard = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey("hidden_states"), asset_partitions=["rows_400-800"]), limit=1
        ).records[0]
        assert resumed_shard.event_log_entry.asset_materialization.metadata["rows_computed"].value == 350
        yield project, instance


@pytest.fixture(scope="module")
def answers(demo):
    """The eval prompts, their generation prompt ids and the target's greedy answers: those vLLM served in
    drafter_eval's plain pass (kept in the store by its key, which the report names), the answers the report scored."""
    project, _ = demo
    prompts = load_eval_prompts(project.store)
    tokenizer = load_tokenizer(project.target())
    prompt_ids = [generation_prompt_ids(tokenizer, p.messages) for p in prompts]
    key = project.store.read_json(EVAL_REPORT_FILE)[REPORT_KEYS]["plain"]
    plain = GenerationResult.from_json(project.store.read_json(f"{PASSES_DIR}/{key}.json")["result"])
    assert len(plain.outputs) == len(prompt_ids) and all(plain.outputs)
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


def test_the_demo_target_trained_briefly_recalls_facts(demo):
    """The target the demo builds, trained briefly (600 steps small, the demo's own full), recalls the world's facts:
    its logits are peaked, so the drafter has something to learn and greedy decoding has no near-ties. Measured:
    attribute values 0.899 small (untrained 0.002, test_demo_target.py), loss 0.36."""
    project, _ = demo
    info = read_build_info(project.target_dir())
    assert info.train_steps == project.settings.demo.train_steps
    assert info.fact_value_accuracy > 10 * UNTRAINED_FACT_VALUES  # 0.5: ten times an untrained target's at most
    assert info.train_loss < 1.0


def test_served_drafter_meets_the_acceptance_bar_and_reads_the_target(demo):
    project, _ = demo
    report = project.store.read_json(EVAL_REPORT_FILE)
    assert report["outputs_match_greedy"] and report["mismatches"] == []
    assert report["mean_acceptance_length_k3"] >= SIZE.k3
    assert report["mean_acceptance_length_k7"] >= SIZE.k7
    assert report["feature_gain_k3"] >= SIZE.gain_k3
    assert report["feature_gain_k7"] >= SIZE.gain_k7


def test_the_family_serving_best_is_released_with_the_figures_it_served_and_the_other_is_named(demo):
    """Both families trained from the one data build, both served in vLLM greedily, the better one released."""
    project, instance = demo
    families = project.settings.drafters
    assert families == ["eagle3", "dflash"]
    reports = {f: project.store.child(family_spec(f).root).read_json(EVAL_REPORT_FILE) for f in families}
    for f, report in reports.items():
        assert report["outputs_match_greedy"] and report["mismatches"] == [], f
        assert report["decode_speedup_k3"] > 0 and report["decode_speedup_k7"] > 0, f  # measured, in the same run
        # Issue 54, item 3: what vLLM served is each family's trained drafter, at both k, and its export says so.
        assert [(c["k"], c["passed"], c["suspects"]) for c in report["served_replay"]] == [(3, True, []), (7, True, [])], f
        assert report["served_replay"][1]["served_per_position"] == report["acceptance_per_position_k7"], f
    best = max(families, key=lambda f: reports[f]["mean_acceptance_length_k7"])
    other = next(f for f in families if f != best)
    report, record = reports[best], project.store.read_json(RELEASE_RECORD)
    served = {"k3": report["mean_acceptance_length_k3"], "k7": report["mean_acceptance_length_k7"]}
    assert (record["family"], record["acceptance"], record["replaced"]) == (best, served, None)
    assert record["export_sha256"] == report["export_sha256"] == export_digest(project.store.child(family_spec(best).root))
    assert record["reason"].startswith("first release: k=3 ")
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=DRAFTER_RELEASE), limit=5).records
    first, then = (r.event_log_entry.asset_materialization.metadata for r in reversed(records))
    assert first["promoted"].value is True and first["family"].value == best
    assert (
        f"at k=7, {best} at {report['mean_acceptance_length_k7']:.3f} (same prompts, k and engine): {best} is released, "
        f"{other} is not"
    ) in first["reason"].value
    # The release made the other family's eval due (served beside no release then): served beside it, it is judged
    # against it again, and the release stays, the best; the check passes on it. The start command did that itself.
    assert then["promoted"].value is False and then["family"].value == best
    assert then["reason"].value.startswith(f"the {best} export is the release (sha256 {record['export_sha256']}): it stays")
    assert reports[other]["beside"]["released"]["export_sha256"] == record["export_sha256"]
    # ... and served nothing to do so: its own passes and the release's (the best's own, at each k) were served before
    # from the same target, prompts and files, and are read (`served_passes.py`), with the figures they served.
    assert reports[other]["passes_reused"] == [
        "plain", "k=3", "k=3 features zeroed", "k=7", "k=7 features zeroed", "released k=3", "released k=7"
    ]  # fmt: skip
    assert {k: reports[other]["beside"]["released"][f"mean_acceptance_length_{k}"] for k in served} == served
    assert reports[best]["passes_reused"] == []
    gate = AssetCheckKey(DRAFTER_RELEASE, RELEASE_CHECK)
    # Each family's eval proved what vLLM served is its trained drafter (issue 54, item 3), the gate after them.
    checks = [gate] + [AssetCheckKey(eval_key(family_spec(f)), SERVED_CHECK) for f in families]
    executions = instance.event_log_storage.get_latest_asset_check_execution_by_key(checks)
    assert [executions[c].status.value for c in checks] == ["SUCCEEDED"] * 3


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
    assert report["eval_acc_0_all"] >= accuracy["all"].acc[0] + SIZE.over_untrained, (
        report["eval_acc_0_all"], accuracy["all"].acc
    )
    assert report["heldout_acc_0"] >= SIZE.heldout_acc_0


def test_fact_and_template_tokens_are_scored_apart(demo):
    project, instance = demo
    report = project.store.read_json(EVAL_REPORT_FILE)
    event = instance.get_latest_materialization_event(AssetKey("drafter_eval"))
    shown = {k: v.value for k, v in event.asset_materialization.metadata.items()}  # what the UI lists
    for key in ("eval_acc_0_fact", "eval_acc_0_template", "feature_gain_k3", "feature_gain_k7"):
        assert shown[key] == report[key], key
    # 48 fact prompts about held-out entities; the two-entity questions the target gets wrong
    # (13 measured on the full demo, 29 on the small one's less trained target) are left out of
    # `fact` and listed in `off_reference`.
    assert report["eval_rows_off_reference"] == len(report["off_reference"]) <= SIZE.off_reference
    assert report["eval_tokens_fact"] >= SIZE.fact_tokens and report["eval_tokens_template"] >= SIZE.template_tokens
    # Measured: template 0.986, fact 0.478 (small: 0.662, 0.217): facts of unseen entities are the hard part.
    assert report["eval_acc_0_template"] > report["eval_acc_0_fact"] > 0


@full_size_only
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


# One rolling pass (issue 22) of the demo recipe: ~63 steps over the demo's 4,000 rows.
ROLLING_RECIPE = TrainingSettings.model_validate(
    demo_settings().training.model_dump() | {"mode": "rolling", "epochs": 1.0, "window_shards": 2}
)


@full_size_only
def test_a_rolling_pass_over_a_prompt_file_sorted_by_kind_learns_what_the_shuffled_file_does(
    demo, answers, tmp_path_factory
):
    """In rolling mode `tokenized` shuffles the rows before they are cut into shards, so a prompt file
    sorted by topic (here every fact prompt, then every template) does not become a drift across the pass."""
    project, _ = demo
    rows = TokenizedSet.load(project.store)
    responses = read_responses(project.store)
    is_template = [responses[i]["kind"] != "fact" for i in rows.row_ids]
    files = {
        "sorted": rows.reordered(np.argsort(is_template, kind="stable")),
        "shuffled": rows.reordered(np.random.default_rng(7).permutation(rows.num_rows)),
    }
    accuracy = {}
    for name, prompt_file in files.items():
        side = side_store(demo, f"rolling-{name}", tmp_path_factory)
        # What `tokenized` writes in rolling mode (defs/data/assets.py).
        shuffled = prompt_file.shuffled(ROLLING_RECIPE.seed)
        shuffled.save(side.store)
        export = train_rolling(side, shuffled)
        accuracy[name] = token_class_accuracy(side.target(), side.settings, export, *answers)[0]["all"].acc[0]
    # Measured acc_0 on the eval answers: sorted 0.505, shuffled 0.504; the sorted file trained in
    # its own order (no shuffle) 0.452, templates last: 0.385 on template answers against 0.541.
    assert abs(accuracy["sorted"] - accuracy["shuffled"]) <= 0.02 * accuracy["shuffled"], accuracy
    assert accuracy["shuffled"] >= 0.45, accuracy


def train_rolling(side: Project, rows: TokenizedSet) -> Path:
    """Extract and check every shard of `rows` (the window's extraction side, all at once here), run
    one rolling pass of ROLLING_RECIPE over them and export."""
    shards = plan_shards(rows.num_rows, side.settings.shard_size)
    extractor = HFExtractor(side.target(), batch_tokens=4096)
    for shard in shards:
        extract_shard(side.store, rows, shard, extractor, side.settings.extraction, model_name="demo")
        write_check_record(side.store, shard.key, passed=True, problems=0)
    result = train_drafter(
        side.store, [s.key for s in shards], vmap=VocabMap.load(side.store), target=side.target(),
        settings=ROLLING_RECIPE, log=lambda _: None,
    )  # fmt: skip
    export_drafter(side.store, result.model.trainable_state_dict(), result.config, aux_layer_ids=[1, 2, 3])
    return side.store.local_path(EXPORT_DIR)


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
