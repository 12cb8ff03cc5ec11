"""Every asset's artifact, declared once: what determines its content, and where its record lives.

Per asset (docs/DESIGN.md §9):
- `reads`: the settings fields (dotted names) that determine its content, and nothing else (the fields `reads`
  itself consults to choose them, such as `prompts` being set, count too: their change changes the choice);
- `runs_with`: the settings it also reads that only say how the work is carried out (engines, batch sizes,
  retries, timeouts, servers, progress): left out of its provenance on purpose, so changing one redoes nothing;
- `parents`: the inputs whose recorded versions its content depends on;
- `deps_apart`: where `parents` and the asset's Dagster deps differ, and why;
- `code`: a revision, raised when a code change alters what it makes from the same inputs (every artifact it made
  before is then stale and redone);
- `record_dir`: where its record (`_PROVENANCE.json`) lives, a shard's in its own directory below.

`provenance.py` computes records from these entries and nothing else; the Dagster definitions (`defs/`) take their
code versions from them; tests hold `parents` against the Dagster deps and `reads` + `runs_with` against what each
asset really reads (`eagle3_assets_tests/test_artifacts.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from eagle3_assets.families import FAMILIES, FamilySpec, family_spec
from eagle3_assets.settings import Settings, TrainingSettings

# Training settings that change how a run is carried out, not what it learns or exports.
# `sample_ledger` only keeps a record of what was trained (issue 44, item 6): toggling it retrains nothing.
# `replay_reservoir_rows` decides what a rolling run keeps for a later continuation, which records what it replayed.
TRAINING_HOW = (
    "checkpoint_every", "device", "serve_with", "window_shards", "shard_wait_s", "launch", "sample_ledger",
    "replay_reservoir_rows",
)  # fmt: skip
# And those a checkpoint may still be resumed under, though the export may differ (which checkpoint is
# exported, when evaluation and early stop look): left out of a run's fingerprint (`drafter/train.py`), not
# out of the drafter's provenance.
# `replay_rows` and `continue_fraction` shape a continuation only: its fingerprint records what they decided (the
# replayed rows, the steps), so a from-scratch checkpoint stays resumable when they change.
TRAINING_VOLATILE = (
    *TRAINING_HOW, "eval_every", "export_checkpoint", "early_stop_evals", "replay_rows", "continue_fraction"
)  # fmt: skip
# How any engine is served: where, on what, with which limits; and how the target is opened (every asset that
# reads the target resolves it: `Project.target()`). Where these determine content they are in `reads` (the
# target's own, the shards') and reach the rest through the `target_model` parent, except the vLLM settings that
# change what an engine computes (`VLLM_CONTENT`), read by what a vLLM engine made.
SERVING = ("vllm", "alerts", "target_model", "trust_remote_code", "aux_layer_ids")
# The vLLM settings that change what an engine computes: its dtype, its arguments (a quantization flag such as
# `--quantization fp8`; every argument counts, since which of them change numbers is vLLM's to say) and its context
# (generation stops at it). Each is in the `reads` of what a vLLM engine made with them: responses and shards when
# their backend is vLLM. Extraction refuses a row longer than the context, never cuts one: not there. drafter_eval
# starts its engines with settings of its own (`drafter/evaluate.py`), none of these.
VLLM_CONTENT = ("vllm.dtype", "vllm.extra_args", "vllm.max_model_len")
VLLM_EXTRACTION = ("vllm.dtype", "vllm.extra_args")
# Fields recorded only since a later version, with the value every artifact made before had: a field at that value is
# left out of the provenance (`provenance.settings_read`), so an upgrade leaves a store made with it current, and a
# record holding it at another value names it ("setting vllm.dtype: (unset) -> \"float32\"").
# The continuation settings (issue 45) are left out at their defaults too: a store's vocab map is the fresh map of its
# counts, which the default margin keeps, and a drafter trained before continued from nothing; with `start_from`
# unset, no release is imported, and the map is its counts' as before.
RECORDED_SINCE: dict[str, object] = {
    "vllm.dtype": "auto", "vllm.extra_args": [], "vllm.max_model_len": None, "vocab_map_keep_margin": 0.005,
    "training.replay_rows": None, "training.continue_fraction": 0.25, "evaluation.replace_release_for_target": None,
    "start_from": None,
}  # fmt: skip


# Where the released drafter lives (`drafter/release.py`): the evals serve it beside their export, so which drafter it
# is (its weights' digest) is an input of theirs.
RELEASE_DIR = "drafter/release"
# In release.json: the eval whose report the release was promoted on, the inputs it was made from and the release it
# was served beside (`provenance.judged`). That eval judged the release by definition, so its own promotion leaves it
# current; every other eval was served beside another release and is due.
RELEASE_JUDGED = "judged"


@dataclass(frozen=True)
class Artifact:
    name: str
    reads: Callable[[Settings], tuple[str, ...]]
    # A tuple, or a function of the settings where they choose the inputs (`drafter_release`: one eval per family).
    parents: tuple[str, ...] | Callable[[Settings], tuple[str, ...]] = ()
    runs_with: tuple[str, ...] = SERVING
    # Where its parents and Dagster deps differ, and why; a function of the settings where they add a dep.
    deps_apart: Mapping[str, str] | Callable[[Settings], Mapping[str, str]] = field(default_factory=dict)
    code: int = 1
    directory: str | None = None  # where its record lives, when not in a directory of its name
    # Served beside the released drafter, whose figures decide the release: which drafter is released is an input
    # (`provenance.Inputs.release`), so a change of release makes it due (but its own promotion, `RELEASE_JUDGED`), and
    # a report served beside another release is never current.
    beside_release: bool = False
    # A settings field the asset exists for: in the graph only while it is set (`traffic`, `start_from`).
    only_with: str | None = None

    @property
    def record_dir(self) -> str:
        return self.directory or self.name

    def parents_under(self, settings: Settings) -> tuple[str, ...]:
        return self.parents(settings) if callable(self.parents) else self.parents

    def deps_apart_under(self, settings: Settings) -> Mapping[str, str]:
        return self.deps_apart(settings) if callable(self.deps_apart) else self.deps_apart

    def in_graph(self, settings: Settings) -> bool:
        return self.only_with is None or getattr(settings, self.only_with) is not None


def _prompts(s: Settings) -> tuple[str, ...]:
    if s.prompts is not None:
        return ("prompts", "eval_prompts")
    return ("demo.num_prompts", "demo.seed") + (("eval_prompts",) if s.eval_prompts is not None else ())


def _traffic(_: Settings) -> tuple[str, ...]:
    # What `responses` renders with and keeps a row of: the log's prompts are judged by the same rules.
    return ("traffic", "max_seq_len", "generation.chat_template_kwargs", "generation.temperature")


def _responses_parents(s: Settings) -> tuple[str, ...]:
    # With `traffic` set, `responses` generates from the set `traffic_prompts` writes (the prompts and the log's).
    return ("prompts", "target_model") + (("traffic_prompts",) if s.traffic is not None else ())


def _target_model(s: Settings) -> tuple[str, ...]:
    return ("demo",) if s.is_demo else ("target_model", "trust_remote_code")


def _tokenized(s: Settings) -> tuple[str, ...]:
    fields = ("max_seq_len", "overlong", "unfinished_responses", "shard_size", "training.mode")
    return fields + (("training.seed",) if s.training.rolling else ())  # rolling shuffles with its seed


def _responses(s: Settings) -> tuple[str, ...]:
    sampling = ("max_new_tokens", "temperature", "top_p", "seed", "reasoning", "chat_template_kwargs")
    # `generation.backend` chooses the engine fields, yet stays how it runs: with the vLLM settings at their defaults
    # (left out of the record, `RECORDED_SINCE`) both engines make the same rows (docs/DESIGN.md §6).
    engine = VLLM_CONTENT if s.generation.backend == "vllm" else ()
    return ("max_seq_len",) + tuple(f"generation.{f}" for f in sampling) + engine


def _hidden_states(s: Settings) -> tuple[str, ...]:
    return ("aux_layer_ids", "extraction.storage_dtype") + (VLLM_EXTRACTION if s.extraction.backend == "vllm" else ())


# A drafter learns from the shards' features: every setting the shards are extracted with (`vllm.dtype`, a
# quantization flag) is in its reads, so other features retrain it (issue 52, item 7), never only re-extract.
def _drafter_reads(family: FamilySpec) -> Callable[[Settings], tuple[str, ...]]:
    """What `family`'s drafter is made from: the shards' reads, its own settings section, and the training
    settings that shape what any family learns, less those only other families read and those its own section holds
    in their stead (`FamilySpec.recipe_fields`)."""

    def reads(s: Settings) -> tuple[str, ...]:
        others = {f for spec in FAMILIES.values() if spec != family for f in spec.training_fields}
        apart = others | set(TRAINING_HOW) | set(family.recipe_fields)
        learnt = [f for f in TrainingSettings.model_fields if f not in apart]
        own = () if family.settings_section == "training" else (family.settings_section,)
        return _hidden_states(s) + ("shard_size", *own) + tuple(f"training.{f}" for f in learnt)

    return reads


def _eval_parents(family: FamilySpec | None) -> Callable[[Settings], tuple[str, ...]]:
    # With `traffic` set, the eval serves the traffic's held-out split too (`drafter/prompt_sets.py`), which
    # `traffic_prompts` writes. None: the release's baseline, which serves no drafter of a family's.
    drafter = () if family is None else (family.drafter_asset,)
    return lambda s: (*drafter, "prompts", "target_model") + (("traffic_prompts",) if s.traffic is not None else ())


def _release_reads(s: Settings) -> tuple[str, ...]:
    # The margin judges only with `traffic` set (`release.traffic_decision`): without it, nothing is recorded.
    return ("evaluation.release_min_acceptance", "evaluation.min_prompts_per_bin", "drafters",
            "evaluation.replace_release_for_target") + (
        ("evaluation.original_regression_margin",) if s.traffic is not None else ()
    )  # fmt: skip


def _eval(_: Settings) -> tuple[str, ...]:
    return ("evaluation.max_new_tokens", "evaluation.reference_drafter", "generation.max_new_tokens",
            "generation.chat_template_kwargs", "evaluation.context_bins", "evaluation.min_prompts_per_bin")  # fmt: skip


_DRAFTER_DEPS_APART = {
    "tokenized": "the rows every shard is made from, known before any shard exists, as rolling mode needs",
    "hidden_states": "its shards stand for tokenized's rows under the target and extraction settings",
}
_EVAL_DEPS_APART = {
    "prompts": "the held-out prompts it serves come with the prompt set",
    "target_model": "the target it serves the drafter beside",
}


def _eval_deps_apart(s: Settings) -> Mapping[str, str]:
    # With `start_from` set, after `release_baseline`: the first eval reads the passes it served (the same passes,
    # the same figures), so its content is no input.
    baseline = {"release_baseline": "it serves first the passes the eval would (served_passes.py)"}
    return _EVAL_DEPS_APART | (baseline if s.start_from is not None else {})


def _baseline(_: Settings) -> tuple[str, ...]:
    # Its passes: the prompts as served (their template kwargs and context bins) and the tokens decoded.
    return ("evaluation.max_new_tokens", "generation.max_new_tokens", "generation.chat_template_kwargs",
            "evaluation.context_bins")  # fmt: skip


def family_artifacts(family: FamilySpec) -> tuple[Artifact, Artifact]:
    """A family's drafter and its eval, from its spec: records in its store directory (`FamilySpec.root`)."""
    where = f"{family.root}/" if family.root else ""
    drafter = Artifact(
        family.drafter_asset,
        _drafter_reads(family),
        parents=("target_model", "tokenized", "vocab_map"),
        runs_with=(*SERVING, *(f"training.{f}" for f in TRAINING_HOW)),
        deps_apart=_DRAFTER_DEPS_APART,
        directory=f"{where}drafter",
    )
    evaluation = Artifact(
        family.eval_asset,
        _eval,
        parents=_eval_parents(family),
        # A published drafter it installs as the release of a store with none, once (`imported_release.py`): what is
        # released is in no eval's provenance, and a later `start_from` never replaces a release.
        runs_with=(*SERVING, "start_from"),
        deps_apart=_eval_deps_apart,
        directory=f"{where}drafter_eval",
        beside_release=True,
    )
    return drafter, evaluation


ARTIFACTS: dict[str, Artifact] = {
    a.name: a
    for a in (
        Artifact("prompts", _prompts),
        # Checked against the target as it is validated, never changing its files.
        Artifact("target_model", _target_model, runs_with=(*SERVING, "extraction.storage_dtype", "generation.reasoning")),
        # Only in the graph with `traffic` set (`definitions.py`): its own records, nothing else's, change with it.
        Artifact("traffic_prompts", _traffic, parents=("prompts", "target_model"), only_with="traffic"),
        # Only with `start_from` set: the import it installs (as vocab_map and the evals do) and serves is in no record.
        Artifact(
            "release_baseline",
            _baseline,
            parents=_eval_parents(None),
            runs_with=(*SERVING, "start_from", "evaluation.reuse_passes", "evaluation.engine_load_s",
                       "evaluation.min_tokens_per_s"),
            only_with="start_from",
        ),  # fmt: skip
        Artifact(
            "responses",
            _responses,
            parents=_responses_parents,
            # `traffic` only chooses which prompt set it reads: that set is a parent (`traffic_prompts`), and a row is
            # stamped without it (`responses.made_by`), so turning it on or moving the log regenerates no row.
            runs_with=(*SERVING, "generation.backend", "generation.batch_size", "generation.rows_per_part",
                       "generation.max_error_rate", "generation.max_row_attempts", "traffic"),
        ),  # fmt: skip
        Artifact(
            "tokenized",
            _tokenized,
            parents=("responses",),
            deps_apart={"target_model": "the tokenizer is the one `responses` recorded its rows with"},
        ),
        Artifact("token_freq", lambda _: (), parents=("tokenized", "target_model")),
        # `start_from`: while the release is the published drafter it imports, the map is that drafter's own.
        Artifact(
            "vocab_map", lambda _: ("draft_vocab_size", "vocab_map_keep_margin", "start_from"), parents=("token_freq",)
        ),
        Artifact(
            "hidden_states",
            _hidden_states,
            parents=("target_model",),
            # Rolling: training.mode, window_shards and drafters (a shard leaves the window once every family consumed
            # it) decide when a shard may be extracted and when its check skips it, not what it holds.
            runs_with=(*SERVING, "extraction.backend", "extraction.batch_tokens", "extraction.progress_interval_s",
                       "extraction.disk_margin", "extraction.max_retries", "extraction.backfill_cron",
                       "training.mode", "training.window_shards", "drafters"),
            deps_apart={"tokenized": "a shard records its own rows' digest from tokenized's record, not its version"},
        ),  # fmt: skip
        *(a for spec in FAMILIES.values() for a in family_artifacts(spec)),
        Artifact(
            "drafter_release",
            _release_reads,
            parents=lambda s: tuple(family_spec(f).eval_asset for f in s.drafters),
        ),
    )
}
