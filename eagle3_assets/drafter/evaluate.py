"""Serve the exported drafter with its target in vLLM and measure what it buys.

On held-out prompts (never trained on) the target decodes greedily four ways: alone,
and with the drafter at 3 and 7 speculative tokens, each with the fused target
features as trained and with them zeroed (`fc.weight` = 0). Speculative output must
equal plain greedy output; mean acceptance length with features over without is the
"feature gain": the share of the drafter's skill that comes from reading the target.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.vllm_eval import GenerationResult, generate_in_subprocess
from eagle3_assets.project import Project
from eagle3_assets.prompts import EVAL_PROMPTS_FILE, parse_prompts
from eagle3_assets.target_model import load_tokenizer

DRAFTER_METRICS_FILE = "drafter/metrics.json"
EVAL_REPORT_FILE = "drafter_eval/report.json"
SPECULATIVE_TOKENS = (3, 7)


class EvaluationError(RuntimeError):
    pass


@dataclass
class EvalReport:
    prompts: int
    max_tokens: int
    acceptance: dict[str, float] = field(default_factory=dict)  # "k3" -> mean acceptance length
    acceptance_zeroed: dict[str, float] = field(default_factory=dict)  # features zeroed
    per_position: dict[str, list[float]] = field(default_factory=dict)
    heldout_training_metrics: dict[str, float] = field(default_factory=dict)
    mismatches: list[dict] = field(default_factory=list)

    @property
    def outputs_match(self) -> bool:
        return not self.mismatches

    def feature_gain(self, k: int) -> float:
        zeroed = self.acceptance_zeroed.get(f"k{k}", 0.0)
        return self.acceptance[f"k{k}"] / zeroed if zeroed else 0.0

    def as_metadata(self) -> dict[str, object]:
        meta: dict[str, object] = {"prompts": self.prompts, "max_tokens": self.max_tokens}
        for k in SPECULATIVE_TOKENS:
            meta[f"mean_acceptance_length_k{k}"] = round(self.acceptance[f"k{k}"], 4)
            meta[f"mean_acceptance_length_k{k}_features_zeroed"] = round(self.acceptance_zeroed[f"k{k}"], 4)
            meta[f"feature_gain_k{k}"] = round(self.feature_gain(k), 4)
            meta[f"acceptance_per_position_k{k}"] = [round(x, 4) for x in self.per_position[f"k{k}"]]
        meta.update({f"heldout_{k}": v for k, v in self.heldout_training_metrics.items()})
        meta["outputs_match_greedy"] = self.outputs_match
        return meta


def eval_prompt_ids(project: Project, target_dir: Path) -> list[list[int]]:
    store = project.store
    if not store.exists(EVAL_PROMPTS_FILE):
        raise EvaluationError(
            f"no held-out prompts at {store.url_of(EVAL_PROMPTS_FILE)}: set `eval_prompts` in the settings "
            "(prompts never used in training) and rematerialize `prompts`"
        )
    prompts = parse_prompts(store.read_text(EVAL_PROMPTS_FILE), store.url_of(EVAL_PROMPTS_FILE))
    tok = load_tokenizer(target_dir)
    return [
        tok(tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        for p in prompts
    ]


def evaluate_drafter(project: Project, *, max_tokens: int | None = None, log: Callable[[str], None] = print) -> EvalReport:
    store = project.store
    target_dir = project.target_dir()
    prompt_ids = eval_prompt_ids(project, target_dir)
    max_tokens = max_tokens or project.settings.generation.max_new_tokens
    max_model_len = max(map(len, prompt_ids)) + max_tokens + 8
    report = EvalReport(prompts=len(prompt_ids), max_tokens=max_tokens)
    with tempfile.TemporaryDirectory(prefix="drafter-eval-") as tmp:
        export_dir = Path(tmp) / "export"
        store_export = store.local_path(EXPORT_DIR)
        if store_export is None:
            store.fs.get(store.path(EXPORT_DIR) + "/", str(export_dir), recursive=True)
        else:
            export_dir = store_export

        def run(**kwargs) -> GenerationResult:
            return generate_in_subprocess(
                target_dir, prompt_ids, max_tokens=max_tokens, max_model_len=max_model_len, ignore_eos=False, **kwargs
            )

        log(f"drafter_eval: plain greedy decoding of {len(prompt_ids)} held-out prompts in vLLM")
        plain = run()
        for k in SPECULATIVE_TOKENS:
            for zeroed in (False, True):
                label = f"k={k}" + (" features zeroed" if zeroed else "")
                spec = run(draft_dir=export_dir, num_speculative_tokens=k, zero_fc=zeroed)
                log(f"drafter_eval: {label}: mean acceptance length {spec.mean_acceptance_length:.3f}")
                target = report.acceptance_zeroed if zeroed else report.acceptance
                target[f"k{k}"] = spec.mean_acceptance_length
                if not zeroed:
                    report.per_position[f"k{k}"] = spec.acceptance_per_position
                for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs, strict=True)):
                    if a != b:
                        report.mismatches.append({"prompt": i, "setting": label, "greedy": a[:16], "speculative": b[:16]})
    if store.exists(DRAFTER_METRICS_FILE):
        metrics = store.read_json(DRAFTER_METRICS_FILE)
        report.heldout_training_metrics = {k.removeprefix("heldout_"): v for k, v in metrics.items() if k.startswith("heldout_acc")}
    store.write_json(EVAL_REPORT_FILE, {**report.as_metadata(), "mismatches": report.mismatches})
    return report
