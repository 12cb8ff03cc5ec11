"""Which checkpoint to export, and how well the held-out estimate predicts what vLLM serves (issue 43, items 5-6).

Needs a store the demo built (`make demo`). `--train FAMILY ...` trains each family from scratch with the demo
recipe into `bench/<family>-every100/`, evaluating the held-out rows every 100 steps and keeping every checkpoint
(one per 100 steps). The training trajectory does not depend on `eval_every` (measured for EAGLE-3: its estimates
equal those of an eval-every-200 run at every shared step; check it for a family whose evaluation may draw random
numbers), so one run gives each export policy's pick:

- `best@N`: the evaluated step with the highest k=3 estimate among the multiples of N and the last step
  (`training.eval_every: N`, `export_checkpoint: best`);
- `last`: the last step (`export_checkpoint: last`).

Each `--serve VARIANT@STEP` (STEP a checkpoint under `bench/<VARIANT>/drafter/checkpoints/`, or `best@N`/`last`)
is exported and served by vLLM CPU on the demo's held-out prompts at k=3 and k=7, all in one interpreter beside a
plain run; output must equal greedy. Each served drafter is printed as one JSON line with its held-out estimate (the
evaluation at that step), so estimate and served figure come from the same weights.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_checkpoint_choice.py --store STORE --train eagle3 dflash \
        --serve eagle3-every100@best@100 eagle3-every100@last eagle3-every100@100 dflash-every100@300
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.drafter import checkpoint as checkpoint_module
from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.checkpoint import checkpoint_rel, read_checkpoint_state, read_model_tensors
from eagle3_assets.drafter.dflash_model import DFlashConfig
from eagle3_assets.drafter.evaluate import load_eval_prompts
from eagle3_assets.drafter.family import DFlash, Eagle3, Family, mask_token_id
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.selection import BEST_DIR, best_index
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess
from eagle3_assets.project import Project
from eagle3_assets.settings import Settings, TrainingSettings, demo_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VocabMap

EVERY = 100  # the finest evaluation cadence measured; coarser ones are subsets of its evaluations


def family_of(variant: str, settings: Settings, target: TargetModel, training: TrainingSettings) -> Family:
    root = f"bench/{variant}"
    if variant.startswith("eagle3"):
        return Eagle3(training, root=root)
    return DFlash(training, settings.dflash, mask_token_id(settings.dflash, target), root=root)


def pick(evals: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """The evaluation an export policy picks: `last`, or `best@N` (the multiples of N and the last step)."""
    if policy == "last":
        return evals[-1]
    every = int(policy.removeprefix("best@"))
    seen = [e for i, e in enumerate(evals) if e["step"] % every == 0 or i == len(evals) - 1]
    return seen[best_index(seen) or 0]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--train", nargs="*", default=[], choices=["eagle3", "dflash"])
    ap.add_argument("--serve", nargs="*", default=[])
    args = ap.parse_args(argv)
    settings = demo_settings()
    store = ArtifactStore(args.store)
    project = Project(settings, store)
    target = project.target()
    checkpoint_module.KEEP_LAST = 10**6  # every checkpoint stays, to export any evaluated step
    training = settings.training.model_copy(update={"eval_every": EVERY, "checkpoint_every": EVERY})
    keys = [s.key for s in TokenizedSet.load(store).shards(settings.shard_size)]
    vmap = VocabMap.load(store)
    for name in args.train:
        variant = f"{name}-every{EVERY}"
        family = family_of(variant, settings, target, training)
        out = store.child(family.root)
        if out.exists("drafter"):
            out.remove("drafter", recursive=True)
        before, wall = cpu_seconds(), time.perf_counter()
        seconds: dict[int, float] = {}  # step -> its wall seconds (the step after an evaluation includes it)
        result = train_drafter(store, keys, vmap=vmap, target=target, settings=training, family=family,
                               on_metrics=lambda step, m, into=seconds: into.__setitem__(step, m["seconds"]),
                               log=lambda line: None)  # fmt: skip
        plain = sorted(v for s, v in seconds.items() if s % EVERY != 1)
        after_eval = [v for s, v in seconds.items() if s % EVERY == 1 and s > 1]
        line = {"trained": variant, "steps": result.step, "train_cpu_s": round(cpu_seconds() - before),
                "train_wall_s": round(time.perf_counter() - wall),
                "evals": [(e["step"], round(e["accept_len_k3"], 3), round(e["accept_len_k7"], 3)) for e in result.evaluations],
                "step_s_median": round(plain[len(plain) // 2], 4),
                "eval_and_checkpoint_s_mean": round(sum(after_eval) / max(1, len(after_eval)) - plain[len(plain) // 2], 3),
                "picks": {p: pick(result.evaluations, p)["step"] for p in ("best@100", "best@200", "best@1000", "last")}}  # fmt: skip
        print(json.dumps(line), flush=True)

    served: list[dict[str, Any]] = []
    for spec in args.serve:
        variant, _, step_spec = spec.partition("@")
        family = family_of(variant, settings, target, training)
        out = store.child(family.root)
        steps = sorted(int(p.name.split("_")[1]) for p in out.local_path("drafter/checkpoints").glob("step_*"))
        evals = read_checkpoint_state(out, checkpoint_rel(steps[-1])).state["evals"]
        if step_spec.isdigit():
            ev = next(e for e in evals if e["step"] == int(step_spec))
        else:
            ev = pick(evals, step_spec)
        if any(r["variant"] == variant and r["step"] == ev["step"] for r in served):
            continue  # another policy's pick, served once
        rel = checkpoint_rel(ev["step"])
        if ev["step"] not in steps:  # a best step between kept checkpoints: its weights are in best/
            assert read_checkpoint_state(out, BEST_DIR).step == ev["step"], f"{spec}: no weights of step {ev['step']}"
            rel = BEST_DIR
        state = read_checkpoint_state(out, checkpoint_rel(steps[-1])).state  # the config and aux layers
        cfg = (DrafterConfig if family.name == "eagle3" else DFlashConfig)(**state["drafter_config"])
        export_rel = f"drafter/export_step_{ev['step']}"
        family.export(out, read_model_tensors(out, rel), cfg, state["aux_layer_ids"], export_rel)
        served.append({"drafter": f"{variant}@{step_spec}", "variant": variant, "family": family.name, "step": ev["step"],
                       "estimate_k3": round(ev["accept_len_k3"], 3), "estimate_k7": round(ev["accept_len_k7"], 3),
                       "export": out.local_path(export_rel)})  # fmt: skip
    if not served:
        return 0
    prompts = load_eval_prompts(store)
    tokenizer = load_tokenizer(target)
    prompt_ids = [generation_prompt_ids(tokenizer, p.messages) for p in prompts]
    max_tokens = settings.generation.max_new_tokens
    runs = [(row, k) for row in served for k in SPECULATIVE_TOKENS]
    plain, *spec = generate_runs_in_subprocess(
        project.target_dir(), prompt_ids,
        [{}] + [{"draft_dir": r["export"], "method": r["family"], "num_speculative_tokens": k} for r, k in runs],
        common={"max_tokens": max_tokens, "max_model_len": max(map(len, prompt_ids)) + max_tokens + 8, "ignore_eos": False},
        timeout_s=5400,
        on_result=lambda i, res: print(json.dumps({"run": i, "mean_acceptance_length": res.mean_acceptance_length}),
                                       file=sys.stderr, flush=True),
    )  # fmt: skip
    for (row, k), result in zip(runs, spec, strict=True):
        row[f"greedy_k{k}"] = result.outputs == plain.outputs
        row[f"served_k{k}"] = round(result.mean_acceptance_length, 3)
    for row in served:
        row.pop("export")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
