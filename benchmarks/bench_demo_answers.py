"""How demo targets answer the held-out prompts: right by the world, and alike across targets (issue 54, item 5).

Targets built under other CPU kernel settings (`bench_demo_isa.py`) served their drafters up to 17% apart. This
answers the 448 held-out prompts of `demo eval set` (`demo_extra_eval_conversations`: facts about held-out entities,
template prompts) greedily with each target (Hugging Face, float32, one thread) and prints, per target, how many
answers are the world's own, by kind of question (single fact, two-entity question, template), then how many
answers every target gives alike: what the drafter is scored on, and whether it depends on the target.

    .venv/bin/python benchmarks/bench_demo_answers.py TARGET_DIR [TARGET_DIR ...] [--extra 448]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_assets.demo.prompts import demo_extra_eval_conversations
from eagle3_assets.demo.target import greedy_answers
from eagle3_assets.demo.world import PAIR_QUESTIONS
from eagle3_assets.settings import DemoSettings


def kind_of(task: str, kind: str) -> str:
    return "template" if kind == "template" else "pair" if task in PAIR_QUESTIONS else "single"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", type=Path, help="demo target model directories")
    parser.add_argument("--extra", type=int, default=448, help="held-out prompts (448: those of `demo eval set`)")
    parser.add_argument("--max-tokens", type=int, default=160, help="answer length, as the demo decodes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [c for _, c in demo_extra_eval_conversations(DemoSettings(), args.extra)]
    kinds = [kind_of(c.task, c.kind) for c in rows]
    answers: dict[str, list[str]] = {}
    for target in args.targets:
        tok = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        answers[str(target)] = got = greedy_answers(model, tok, [c.prompt for c in rows], max_new_tokens=args.max_tokens)
        right = Counter(k for k, c, a in zip(kinds, rows, got) if a == c.assistant_text)
        print(json.dumps({"target": str(target), "right": dict(right), "of": dict(Counter(kinds))}), flush=True)
    alike = Counter(k for i, k in enumerate(kinds) if len({a[i] for a in answers.values()}) == 1)
    print(json.dumps({"alike_across_targets": dict(alike), "of": dict(Counter(kinds))}))


if __name__ == "__main__":
    main()
