"""Serve the exported drafter with its target in vLLM and measure what it buys.

On held-out prompts (never trained on) the target decodes greedily five ways: alone,
and with the drafter at 3 and 7 speculative tokens, each with the fused target
features as trained and with them zeroed (`fc.weight` = 0). Speculative output must
equal plain greedy output; mean acceptance length with features over without is the
"feature gain": the share of the drafter's skill that comes from reading the target.
The plain greedy answers are then scored by the training objective, acc_k per token
class (`token_accuracy`): fact tokens, which only the target's state can predict,
against template tokens, which the text predicts.

Each prompt is rendered as `responses` renders it: with the run-wide
`generation.chat_template_kwargs` and its own over them. Prompts of one mode (one set of
kwargs, e.g. thinking on and off) are decoded together and the acceptance is also
reported per mode (`acceptance_by_mode`): a drafter serving a hybrid target is scored
on each mode it will serve. Likewise per context-length bin (`context_bins`: the prompt's length in
tokens, bins by `evaluation.context_bins`): a drafter trained at short lengths may collapse at long ones,
which a mean over mostly short prompts hides. Each (mode, bin) pair is decoded as one group; a bin with
fewer than `evaluation.min_prompts_per_bin` prompts is reported as too small. With `traffic` set, the traffic's
held-out split is served in the same passes after these prompts, each group labelled with its set, and every drafter is
reported on each set too (`prompt_sets`, `prompt_sets.py`); token classes are scored on the original prompts alone.

Other drafters are served beside ours on the same prompts, at the same k, in the same
engine, and reported under `beside`: the released one (`drafter/release/`, which
`drafter_release` compares ours against) and `evaluation.reference_drafter`, any EAGLE-3
export directory (e.g. the one published for the target). The report has the form vLLM's
own acceptance tests use: greedy, the chat template, k=3 and k=7, the mean acceptance
length and the acceptance rate per draft position, the eval file named.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.chat import check_template_kwargs, generation_prompt_ids, mode_label
from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.calibration import (
    HISTORY_FILE,
    EstimatePoint,
    correction,
    exported_estimate,
    load_history,
    measured_against,
    record,
)
from eagle3_assets.drafter.context_bins import context_bin, group_label, prompts_per_bin, too_small
from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.eval_report import (
    ACCEPTANCE_BY_BIN,
    EVAL_REPORT_FILE,
    ORIGINAL_SET,
    PROMPT_SETS,
    PROMPTS_BY_BIN,
)
from eagle3_assets.drafter.eval_features import AnswerFeatures, explain_served, token_class_accuracy
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINER_LEASE_DIR
from eagle3_assets.drafter.family import family_of
from eagle3_assets.drafter.prompt_sets import (
    PromptSet,
    add_set_figures,
    blank_like,
    merged_by,
    served_sets,
    set_entries,
    set_group,
)
from eagle3_assets.drafter.release import (
    PROMOTION_LEASE_DIR,
    RELEASE_DIR,
    RELEASED,
    other_target,
    target_version,
)
from eagle3_assets.drafter.run import DRAFTER_METRICS_FILE, heldout_metrics
from eagle3_assets.drafter.served_passes import (
    PASSES_DIR,
    REPORT_KEYS,
    ServedPass,
    drafter_digests,
    pass_args,
    pass_context,
    prune,
    serve_or_reuse,
)
from eagle3_assets.drafter.served_replay import ReplayCheck
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.token_accuracy import ClassAccuracy
from eagle3_assets.drafter.vllm_eval import GenerationResult, engine_version, generate_runs_in_subprocess
from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.families import EAGLE3, FamilySpec, family_spec
from eagle3_assets.leases import settled
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, Prompt, parse_prompts
from eagle3_assets.release_record import read_release_record
from eagle3_assets.settings import EvaluationSettings, Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s

REFERENCE = "reference"
# Speculative decoding verifies k+1 tokens in one forward where plain decoding takes one: other kernels, so in bf16
# (an MoE target on vLLM's CPU build, any bf16 GPU engine) logits differ by rounding, and where greedy's top two are
# this close in logprob either may come first. Outputs that part there are near ties, reported apart; parting where
# the choice was clear is a serving defect and fails the eval.
NEAR_TIE_LOGPROB = 0.1


class ReferenceDrafterMissing(Refusal):
    """`evaluation.reference_drafter` is not an export directory."""


@dataclass
class EvalReport:
    prompts: int
    max_tokens: int
    prompts_file: str = ""  # where the held-out prompts came from
    export_sha256: str = ""  # which export was served (`release.export_digest`)
    engine: str = ""  # the engine and its version
    acceptance: dict[str, float] = field(default_factory=dict)  # "k3" -> mean acceptance length
    acceptance_zeroed: dict[str, float] = field(default_factory=dict)  # features zeroed
    # "k3" -> decode tokens/s with the drafter over plain decoding, the two passes in the same interpreter
    speedup: dict[str, float] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)  # chat-template kwargs (mode_label) -> prompts
    acceptance_by_mode: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> "k3" -> acceptance
    context_bin_edges: list[int] = field(default_factory=list)  # evaluation.context_bins
    min_prompts_per_bin: int = 5  # evaluation.min_prompts_per_bin: fewer is reported as too small
    bins: dict[str, int] = field(default_factory=dict)  # context bin ("0-1024") -> prompts, empty bins included
    acceptance_by_bin: dict[str, dict[str, float]] = field(default_factory=dict)  # bin -> "k3" -> acceptance
    per_position: dict[str, list[float]] = field(default_factory=dict)
    heldout_training_metrics: dict[str, float] = field(default_factory=dict)
    # The held-out estimate of the served weights ("k3" -> accept_len), and it calibrated by this store's past
    # evaluations of the family (`calibration.py`), with how many it rests on (0: not calibrated).
    estimate: dict[str, float] = field(default_factory=dict)
    calibrated_estimate: dict[str, float] = field(default_factory=dict)
    calibration_points: dict[str, int] = field(default_factory=dict)
    token_accuracy: dict[str, ClassAccuracy] = field(default_factory=dict)  # class -> acc_k on the greedy answers
    off_reference: list[str] = field(default_factory=list)  # prompt ids answered unlike their reference
    mismatches: list[dict] = field(default_factory=list)
    near_ties: list[dict] = field(default_factory=list)  # outputs that part where greedy's choice was a near tie
    replay: list[ReplayCheck] = field(default_factory=list)  # each k's served counters against the trained drafter's
    beside: dict[str, dict[str, Any]] = field(default_factory=dict)  # other drafters served: name -> their figures
    # With `traffic` set: ours on each prompt set (`prompt_sets.py`), in the report's form; empty without.
    prompt_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    served_passes: dict[str, str] = field(default_factory=dict)  # pass label -> its kept entry (`served_passes.py`)
    passes_reused: list[str] = field(default_factory=list)  # the labels of the passes read, not served, by this eval

    def add_beside(
        self, name: str, directory: str, k: int, plain: GenerationResult, spec: GenerationResult, sha256: str = ""
    ) -> None:
        """Another drafter's run at k: its acceptance in the report's form, whether its output stayed greedy, and which
        weights were served (`sha256`: the release a report was served beside, `release.released_figures`)."""
        figures = self.beside.setdefault(name, {
            "dir": directory, "export_sha256": sha256, "outputs_match_greedy": True, PROMPTS_BY_BIN: self.bins,
            ACCEPTANCE_BY_BIN: {},
        } | ({PROMPT_SETS: blank_like(self.prompt_sets)} if self.prompt_sets else {}))  # fmt: skip
        figures[f"mean_acceptance_length_k{k}"] = round(spec.mean_acceptance_length, 4)
        figures[f"acceptance_per_position_k{k}"] = [round(x, 4) for x in spec.acceptance_per_position]
        figures["outputs_match_greedy"] &= spec.outputs == plain.outputs
        # Per bin as ours, so the release gate compares like with like.
        for b, part in merged_by(spec.by_group, 1, list(self.bins)).items():
            figures[ACCEPTANCE_BY_BIN].setdefault(b, {})[f"k{k}"] = round(part.mean_acceptance_length, 4)
        add_set_figures(figures.get(PROMPT_SETS, {}), spec.by_group, k)

    def add_run(
        self, k: int, zeroed: bool, plain: GenerationResult, spec: GenerationResult, log: Callable[[str], None],
        plain_tokens_per_s: float | None = None,
    ) -> None:
        """One speculative run's acceptance (overall, per position, per mode and per context bin) and its outputs
        against greedy; its speedup over `plain_tokens_per_s`, the plain pass's rate in the interpreter that served it
        (`plain`'s when None)."""
        label = f"k={k}" + (" features zeroed" if zeroed else "")
        (self.acceptance_zeroed if zeroed else self.acceptance)[f"k{k}"] = spec.mean_acceptance_length
        if not zeroed:
            self.per_position[f"k{k}"] = spec.acceptance_per_position
            if baseline := plain.decode_tokens_per_s if plain_tokens_per_s is None else plain_tokens_per_s:
                self.speedup[f"k{k}"] = spec.decode_tokens_per_s / baseline
            for mode, part in merged_by(spec.by_group, 0).items():
                self.acceptance_by_mode.setdefault(mode, {})[f"k{k}"] = part.mean_acceptance_length
                log(f"drafter_eval: k={k} mode {mode}: mean acceptance length {part.mean_acceptance_length:.3f}")
            for b, part in merged_by(spec.by_group, 1, list(self.bins)).items():
                self.acceptance_by_bin.setdefault(b, {})[f"k{k}"] = part.mean_acceptance_length
                log(
                    f"drafter_eval: k={k} context bin {b} ({self.bins.get(b, 0)} prompts): mean acceptance length "
                    f"{part.mean_acceptance_length:.3f}"
                )
            add_set_figures(self.prompt_sets, spec.by_group, k)
            for name, entry in self.prompt_sets.items():
                if f"mean_acceptance_length_k{k}" in entry:
                    log(
                        f"drafter_eval: k={k} {name} held-out prompts ({entry['prompts']}): mean acceptance length "
                        f"{entry[f'mean_acceptance_length_k{k}']:.3f}"
                    )
        for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs, strict=True)):
            if a == b:
                continue
            at, gap = parting(plain, spec, i)
            parted = {"prompt": i, "setting": label, "position": at, "greedy": a[:16], "speculative": b[:16]}
            if gap < NEAR_TIE_LOGPROB:
                self.near_ties.append(parted | {"top_two_gap": round(gap, 4)})
            else:
                self.mismatches.append(parted)

    @property
    def served_on_eval_prompts(self) -> dict[str, float]:
        """"k3" -> mean acceptance length on the original held-out prompts alone: what the calibration history's points
        are served against (`calibration.measured_against`: the eval prompts' bytes), with `traffic` set or not."""
        if ORIGINAL_SET not in self.prompt_sets:
            return self.acceptance
        entry = self.prompt_sets[ORIGINAL_SET]
        return {f"k{k}": entry[f"mean_acceptance_length_k{k}"] for k in SPECULATIVE_TOKENS
                if f"mean_acceptance_length_k{k}" in entry}  # fmt: skip

    @property
    def too_small_bins(self) -> list[str]:
        """The context bins with fewer than `min_prompts_per_bin` prompts (empty ones too): reported, not judged."""
        return too_small(self.bins, self.min_prompts_per_bin)

    @property
    def outputs_match(self) -> bool:
        return not self.mismatches

    @property
    def served_is_trained(self) -> bool:
        """vLLM served what trained: its counters at every k are the trained drafter's replayed (`served_replay`)."""
        return all(c.passed for c in self.replay)

    def feature_gain(self, k: int) -> float:
        zeroed = self.acceptance_zeroed.get(f"k{k}", 0.0)
        return self.acceptance[f"k{k}"] / zeroed if zeroed else 0.0

    def as_metadata(self) -> dict[str, object]:
        meta: dict[str, object] = {
            "prompts": self.prompts, "max_tokens": self.max_tokens, "prompts_file": self.prompts_file, "engine": self.engine,
            "export_sha256": self.export_sha256,
            "greedy": True, "chat_template": True,
        }  # fmt: skip
        for k in SPECULATIVE_TOKENS:
            meta[f"mean_acceptance_length_k{k}"] = round(self.acceptance[f"k{k}"], 4)
            meta[f"mean_acceptance_length_k{k}_features_zeroed"] = round(self.acceptance_zeroed[f"k{k}"], 4)
            meta[f"feature_gain_k{k}"] = round(self.feature_gain(k), 4)
            meta[f"acceptance_per_position_k{k}"] = [round(x, 4) for x in self.per_position[f"k{k}"]]
            meta[f"decode_speedup_k{k}"] = round(self.speedup.get(f"k{k}", 0.0), 4)
        meta["prompts_by_mode"] = self.modes
        meta["mean_acceptance_length_by_mode"] = {
            mode: {k: round(v, 4) for k, v in acc.items()} for mode, acc in self.acceptance_by_mode.items()
        }
        meta["context_bin_edges"] = self.context_bin_edges
        meta[PROMPTS_BY_BIN] = self.bins
        meta[ACCEPTANCE_BY_BIN] = {
            b: {k: round(v, 4) for k, v in acc.items()} for b, acc in self.acceptance_by_bin.items()
        }
        if self.prompt_sets:  # only with `traffic` set: a report without it is the one it always was
            meta[PROMPT_SETS] = self.prompt_sets
        meta["min_prompts_per_bin"] = self.min_prompts_per_bin
        meta["context_bins_too_small"] = self.too_small_bins
        meta.update({f"heldout_{k}": v for k, v in self.heldout_training_metrics.items()})
        for k, est in self.estimate.items():
            meta[f"estimate_{k}"] = round(est, 4)
            served = self.served_on_eval_prompts.get(k)
            meta[f"estimate_over_served_{k}"] = round(est / served, 4) if served else 0.0
            meta[f"calibration_evals_{k}"] = self.calibration_points.get(k, 0)
            if k in self.calibrated_estimate:
                meta[f"calibrated_estimate_{k}"] = round(self.calibrated_estimate[k], 4)
        for c, acc in self.token_accuracy.items():
            if not acc.predictions[0]:
                continue  # no token of this class in the eval set (plain prompts carry no kind or reference)
            meta[f"eval_acc_0_{c}"] = round(acc.acc[0], 4)
            meta[f"eval_acc_k_{c}"] = [round(a, 4) for a in acc.acc]
            meta[f"eval_tokens_{c}"] = acc.predictions[0]
        meta["eval_rows_off_reference"] = len(self.off_reference)
        meta["outputs_match_greedy"] = self.outputs_match
        meta["passes_reused"] = self.passes_reused
        meta["outputs_parted_at_near_ties"] = len(self.near_ties)  # not defects: NEAR_TIE_LOGPROB
        meta["served_is_trained"] = self.served_is_trained
        for check in self.replay:
            meta[f"replayed_per_position_k{check.k}"] = [round(r, 4) for r in check.replayed.rates]
        for name, figures in self.beside.items():  # flat numbers too: the UI plots them beside ours
            meta.update({f"{name}_mean_acceptance_length_k{k}": figures[f"mean_acceptance_length_k{k}"] for k in SPECULATIVE_TOKENS})
        meta["beside"] = self.beside
        return meta


def parting(plain: GenerationResult, spec: GenerationResult, i: int) -> tuple[int, float]:
    """Where prompt `i`'s speculative output first parts from greedy's, and greedy's top-two logprob gap there (inf
    unknown): below NEAR_TIE_LOGPROB the engine's float noise chose, not the drafter."""
    a, b = plain.outputs[i], spec.outputs[i]
    at = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return at, plain.margins[i][at] if i < len(plain.margins) and at < len(plain.margins[i]) else float("inf")


def load_eval_prompts(store: ArtifactStore) -> list[Prompt]:
    if not store.exists(EVAL_PROMPTS_FILE):
        raise EvaluationError(
            f"no held-out prompts at {store.url_of(EVAL_PROMPTS_FILE)}: set `eval_prompts` in the settings "
            "(prompts never used in training) and rematerialize `prompts`"
        )
    return parse_prompts(store.read_text(EVAL_PROMPTS_FILE), store.url_of(EVAL_PROMPTS_FILE))


def eval_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], run_wide: Mapping[str, Any]
) -> tuple[list[list[int]], list[str]]:
    """Each eval prompt's ids as `responses` renders a prompt (its template kwargs over the run-wide ones), and its
    mode (`mode_label` of those kwargs); a kwarg the template ignores is refused as `responses` refuses it."""
    check_template_kwargs(tokenizer, prompts, run_wide)
    kwargs = [p.template_kwargs(run_wide) for p in prompts]
    return [generation_prompt_ids(tokenizer, p.messages, kw) for p, kw in zip(prompts, kwargs, strict=True)], [
        mode_label(kw) for kw in kwargs
    ]


def beside_drafters(
    store: ArtifactStore, settings: EvaluationSettings, tmp: Path, log: Callable[[str], None] = print
) -> dict[str, tuple[Path, str]]:
    """The drafters served beside ours, with the vLLM method each is served by: the one released for this target
    when there is one (of whichever family won the release), and the reference (an EAGLE-3 export) when set."""
    out: dict[str, tuple[Path, str]] = {}
    if other := other_target(store, target_version(store)):
        log(f"drafter_eval: {other}: not served beside the new export")
    elif (record := read_release_record(store)) is not None:
        out[RELEASED] = (served_copy(store, RELEASE_DIR, tmp / "release"), family_spec(record.family).vllm_method)
    if settings.reference_drafter is not None:
        ref = Path(settings.reference_drafter)
        missing = [n for n in ("config.json", "model.safetensors") if not (ref / n).is_file()]
        if missing:
            raise ReferenceDrafterMissing(
                f"evaluation.reference_drafter {ref}: no {' or '.join(missing)} there; name a local EAGLE-3 export "
                "directory (download a published drafter first) or remove the setting"
            )
        out[REFERENCE] = (ref, EAGLE3.vllm_method)
    return out


def served_copy(store: ArtifactStore, rel: str, dest: Path) -> Path:
    """`rel` copied to the local directory `dest`, which the engines load: never the store's own directory, even on a
    local store, where a promotion or an export swapped in between two passes would mix two drafters in one report."""
    if dest.exists():
        shutil.rmtree(dest)
    store.fs.get(store.path(rel) + "/", str(dest), recursive=True)
    return dest


def eval_max_tokens(settings: Settings) -> int:
    """Tokens each held-out prompt is decoded for: a kept pass is found again only under the same count."""
    return settings.evaluation.max_new_tokens or settings.generation.max_new_tokens


def eval_timeout_s(settings: EvaluationSettings, *, passes: int, prompts: int, max_tokens: int) -> float:
    """Engine loads plus decoding at the slowest rate accepted, for every pass: the timeout grows with the work."""
    return passes * (settings.engine_load_s + prompts * max_tokens / settings.min_tokens_per_s)


def calibrate(
    store: ArtifactStore, out: ArtifactStore, report: EvalReport, family: str, log: Callable[[str], None]
) -> None:
    """The served export's held-out estimate against what it served, calibrated by this store's past evaluations of
    the family (this export's own points left out); then this evaluation joins them (`calibration.py`)."""
    metrics = out.read_json(DRAFTER_METRICS_FILE) if out.exists(DRAFTER_METRICS_FILE) else {}
    history, against = load_history(store), measured_against(store, report.engine)
    points = []
    for k in SPECULATIVE_TOKENS:
        est, served = exported_estimate(metrics, k), report.served_on_eval_prompts.get(f"k{k}")
        if est is None or served is None:
            continue
        report.estimate[f"k{k}"] = est
        c = correction(history, family, k, against=against, leave_out=report.export_sha256)
        report.calibration_points[f"k{k}"] = 0 if c is None else c.points
        if c is None:
            log(
                f"drafter_eval: k={k} held-out estimate {est:.3f}, served {served:.3f} (not calibrated: no past "
                f"{family} evaluation in this store)"
            )
        else:
            report.calibrated_estimate[f"k{k}"] = c.apply(est)
            log(
                f"drafter_eval: k={k} held-out estimate {est:.3f}, calibrated {c.apply(est):.3f} (by {c.points} past "
                f"{family} evaluation(s) of this store), served {served:.3f}"
            )
        points.append(EstimatePoint(family, k, est, served, report.export_sha256, against))
    if points:
        try:
            record(store, points)
        except Eagle3Error as e:  # hours of serving are never lost to the history: the report is written all the same
            log(f"drafter_eval: this evaluation's points are not kept in {store.url_of(HISTORY_FILE)} ({e})")


@dataclass
class ServedPrompts:
    """The prompts `drafter_eval` serves, as the engine is given them, and the report they start."""

    prompts: list[Prompt]  # the original held-out prompts first, then the traffic's (`prompt_sets.py`)
    prompt_ids: list[list[int]]
    groups: list[str]  # each prompt's `vllm_eval` group: ([set,] mode, context bin)
    original: int  # how many of `prompts` are the original held-out prompts
    report: EvalReport
    plain_outputs: list[list[int]] = field(default_factory=list)  # the plain pass's greedy answers, once served
    speculative: dict[int, GenerationResult] = field(default_factory=dict)  # k -> our pass, features as trained


def served_prompts(store: ArtifactStore, target: TargetModel, settings: Settings, max_tokens: int) -> ServedPrompts:
    """The held-out prompts rendered as `responses` renders a prompt, labelled by (set,) mode and context bin; with
    `traffic` set, the traffic's held-out split after them, served in the same passes."""
    original = load_eval_prompts(store)
    original_file = settings.eval_prompts or "embedded demo eval prompts"
    sets = served_sets(store, original, original_file, settings.traffic is not None)
    prompts = [p for s in sets for p in s.prompts] if sets else original
    prompt_ids, modes = eval_prompt_ids(load_tokenizer(target), prompts, settings.generation.chat_template_kwargs)
    edges = settings.evaluation.context_bins
    lengths = [len(ids) for ids in prompt_ids]  # the context the drafter drafts after: the prompt as served
    groups = [group_label(mode, context_bin(n, edges)) for mode, n in zip(modes, lengths, strict=True)]
    names = [s.name for s in sets for _ in s.prompts]
    groups = [set_group(n, g) for n, g in zip(names, groups, strict=True)] if sets else groups
    report = EvalReport(
        prompts=len(prompt_ids), max_tokens=max_tokens, modes=dict(Counter(modes)), prompts_file=original_file,
        engine=engine_version(), context_bin_edges=list(edges),
        min_prompts_per_bin=settings.evaluation.min_prompts_per_bin, bins=prompts_per_bin(lengths, edges),
    )  # fmt: skip
    report.prompt_sets = set_entries(sets, _bins_by_set(sets, lengths, edges))
    return ServedPrompts(prompts, prompt_ids, groups, len(original), report)


def _bins_by_set(sets: Sequence[PromptSet], lengths: Sequence[int], edges: Sequence[int]) -> dict[str, dict[str, int]]:
    out, at = {}, 0
    for s in sets:
        out[s.name], at = prompts_per_bin(lengths[at : at + len(s.prompts)], edges), at + len(s.prompts)
    return out


def evaluate_drafter(
    store: ArtifactStore,
    target: TargetModel,
    settings: Settings,
    *,
    max_tokens: int | None = None,
    log: Callable[[str], None] = print,
    family: FamilySpec = EAGLE3,
) -> EvalReport:
    """Serve `family`'s export with the target on the held-out prompts (by its vLLM method); writes
    `drafter_eval/report.json` in the family's directory (`FamilySpec.root`)."""
    out = store.child(family.root)
    # A replacement a kill interrupted is finished by its owner, never read half done.
    settled(out, EXPORT_DIR, TRAINER_LEASE_DIR)
    settled(store, RELEASE_DIR, PROMOTION_LEASE_DIR)
    max_tokens = max_tokens or eval_max_tokens(settings)
    served = served_prompts(store, target, settings, max_tokens)
    report = served.report
    if small := report.too_small_bins:
        log(
            f"drafter_eval: context bins with fewer than evaluation.min_prompts_per_bin "
            f"{report.min_prompts_per_bin} prompts, reported as too small and not judged by drafter_release: "
            + ", ".join(f"{b} ({report.bins[b]})" for b in small)
        )
    with tempfile.TemporaryDirectory(prefix="drafter-eval-") as tmp:
        export_dir = serve_passes(store, out, target, settings, served, Path(tmp), log, family)
        rows = [[*p, *a] for p, a in zip(served.prompt_ids, served.plain_outputs, strict=True)]
        features, weights = AnswerFeatures(target, settings, rows), load_target_weights(target)  # read once for both
        report.replay = explain_served(
            family_of(family, settings, target), weights.embed_tokens, export_dir, served, features, log
        )
        # By token class through EAGLE-3's TTT unroll; a block drafter's classes would need its own (not yet).
        if family.token_classes:
            log("drafter_eval: acc_k by token class on the greedy answers (training objective, export's aux layers)")
            n = served.original  # the original held-out prompts: the ones that carry token classes
            report.token_accuracy, report.off_reference = token_class_accuracy(
                target, settings, export_dir, served.prompts[:n], served.prompt_ids[:n], served.plain_outputs[:n],
                features, weights,
            )  # fmt: skip
        for c, acc in report.token_accuracy.items():
            if acc.predictions[0]:
                log(f"drafter_eval: {c} tokens ({acc.predictions[0]}): acc_0 {acc.acc[0]:.3f}")
    report.heldout_training_metrics = heldout_metrics(out)
    calibrate(store, out, report, family.name, log)
    out.write_json(
        EVAL_REPORT_FILE,
        {**report.as_metadata(), "off_reference": report.off_reference, "mismatches": report.mismatches,
         "near_ties": report.near_ties, "served_replay": [c.as_json() for c in report.replay],
         REPORT_KEYS: report.served_passes},
    )
    if removed := prune(store, log):
        log(f"drafter_eval: {removed} kept pass(es) no report names removed from {store.url_of(PASSES_DIR)}")
    return report


PLAIN_RUN: dict[str, Any] = {"margins": True}  # the plain pass: greedy, with each token's top-two logprob gap


def drafter_run(directory: Path, method: str, k: int, zeroed: bool = False) -> dict[str, Any]:
    """One drafter's pass at k, as every eval asks for it (a kept pass is found again by these arguments)."""
    return {"draft_dir": directory, "method": method, "num_speculative_tokens": k, "zero_fc": zeroed}


def serve_passes(
    store: ArtifactStore, out: ArtifactStore, target: TargetModel, settings: Settings, served: ServedPrompts, tmp: Path,
    log: Callable[[str], None], family: FamilySpec,
) -> Path:  # fmt: skip
    """Every pass in one interpreter: plain, ours at each k with features kept and zeroed, each drafter beside at each
    k; their figures go to `served.report`, the plain outputs to `served.plain_outputs`. Returns the export served."""
    report, prompt_ids = served.report, served.prompt_ids
    export_dir = served_copy(out, EXPORT_DIR, tmp / "export")
    drafters = beside_drafters(store, settings.evaluation, tmp, log)
    read = {str(d): drafter_digests(d) for d in [export_dir, *(d for d, _ in drafters.values())]}
    report.export_sha256 = read[str(export_dir)].weights
    digests = {name: read[str(d)].weights for name, (d, _) in drafters.items()}
    beside = [(name, d, method, k) for name, (d, method) in drafters.items() for k in SPECULATIVE_TOKENS]
    variants = [(k, zeroed) for k in SPECULATIVE_TOKENS for zeroed in (False, True)]
    labels = ["plain"] + [f"k={k}" + (" features zeroed" if zeroed else "") for k, zeroed in variants]
    labels += [f"{name} k={k}" for name, _, _, k in beside]
    of_sets = "".join(f", {e['prompts']} {name}" for name, e in report.prompt_sets.items())
    log(
        f"drafter_eval: {len(prompt_ids)} held-out prompts{f' ({of_sets[2:]})' if of_sets else ''} decoded greedily in "
        f"vLLM ({report.max_tokens} tokens each), plain and with the {family.name} drafter at "
        f"k={', '.join(map(str, SPECULATIVE_TOKENS))} (features as trained, then zeroed)"
        f"{''.join(f', {name} beside' for name, _, _, k in beside if k == SPECULATIVE_TOKENS[0])}: "
        f"{len(labels)} passes"
    )
    runs = [PLAIN_RUN, *(drafter_run(export_dir, family.vllm_method, k, zeroed) for k, zeroed in variants),
            *(drafter_run(d, method, k) for _, d, method, k in beside)]  # fmt: skip
    plain, *speculative = served_or_reused(store, target, settings, served, labels, runs, log,
                                           drafters={d: digest.files for d, digest in read.items()})  # fmt: skip
    for (k, zeroed), spec in zip(variants, speculative[: len(variants)], strict=True):
        report.add_run(k, zeroed, plain.result, spec.result, log, spec.plain_tokens_per_s)
        if not zeroed:
            served.speculative[k] = spec.result
    where = {RELEASED: store.url_of(RELEASE_DIR)}  # not the copy served, gone with the run
    for (name, d, _, k), spec in zip(beside, speculative[len(variants) :], strict=True):
        report.add_beside(name, where.get(name, str(d)), k, plain.result, spec.result, digests[name])
    return export_dir


def served_or_reused(
    store: ArtifactStore, target: TargetModel, settings: Settings, served: ServedPrompts, labels: Sequence[str],
    runs: Sequence[Mapping[str, Any]], log: Callable[[str], None], drafters: Mapping[str, str] | None = None,
) -> list[ServedPass]:  # fmt: skip
    """`runs` (the plain pass first, `labels` naming each) on `served`'s prompts, each read from the store where the
    same pass was served before (`served_passes.py`), the rest served in one interpreter; `served.plain_outputs` and
    `served.report.served_passes` / `passes_reused` are set from them. `drafters`: digests already read, by directory."""
    report, prompt_ids, max_tokens = served.report, served.prompt_ids, served.report.max_tokens
    common = {**pass_args(target, settings, prompt_ids, max_tokens), "groups": served.groups}
    context = pass_context(store, prompt_ids, common)

    def serve(todo: list[int], on_result: Callable[[int, GenerationResult], None]) -> list[GenerationResult]:
        asked = [labels[i] for i in todo]
        timeout_s = eval_timeout_s(settings.evaluation, passes=len(todo), prompts=len(prompt_ids), max_tokens=max_tokens)
        log(f"drafter_eval: serving {len(todo)} of the {len(labels)} passes ({', '.join(asked)}); timeout {timeout_s:.0f}s")
        logger = _pass_logger(asked, log)
        return generate_runs_in_subprocess(
            target.path, prompt_ids, [runs[i] for i in todo], common=common, timeout_s=timeout_s,
            on_result=lambda i, r: (on_result(i, r), logger(i, r)), cpu_cores=settings.vllm.cpu_cores,
        )  # fmt: skip

    passes = serve_or_reuse(store, runs, context, serve, log, reuse=settings.evaluation.reuse_passes, drafters=drafters)
    if reused := [label for label, p in zip(labels, passes, strict=True) if p.reused]:
        log(
            f"drafter_eval: {len(reused)} of the {len(labels)} passes served before from the same target, prompts, "
            f"drafter and engine, their figures read from {store.url_of(PASSES_DIR)}: {', '.join(reused)}"
        )
    report.served_passes = {label: p.key for label, p in zip(labels, passes, strict=True) if p.key}
    report.passes_reused = reused
    served.plain_outputs = passes[0].result.outputs
    return passes


def _pass_logger(labels: Sequence[str], log: Callable[[str], None]) -> Callable[[int, GenerationResult], None]:
    """Logs each pass as it finishes, its rate against the plain pass's."""
    started, plain_rate = time.monotonic(), []

    def on_result(i: int, result: GenerationResult) -> None:
        rate = result.decode_tokens_per_s
        if i == 0:
            plain_rate.append(rate)
            accepted = f", {rate:.1f} tokens/s"
        else:
            speedup = f" ({rate / plain_rate[0]:.2f}x plain)" if plain_rate and plain_rate[0] else ""
            accepted = f", mean acceptance length {result.mean_acceptance_length:.3f}, {rate:.1f} tokens/s{speedup}"
        log(f"drafter_eval: pass {i + 1}/{len(labels)} ({labels[i]}) done at {time.monotonic() - started:.0f}s{accepted}")

    return on_result
