"""What the vLLM tests share: prompts, and a tiny target whose greedy output is unambiguous.

The conftest's tiny demo target is untrained, so its logits are nearly flat and two
engines could break a near-tie differently. `confident_target` scales its head (clear
margins) and rewires two rows of it so that greedy output contains every case the
generator must handle: rows that close `</think>`, rows that stop at `<|end|>`, rows
cut by the token budget.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from eagle3_assets.demo.tokenizer import END, THINK_CLOSE, TOKEN_IDS
from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.target import load_tokenizer

PROMPTS = [
    "What does Kamivel eat?",
    "Tell me about the red plums.",
    "Where is Avalon?",
    "hello there friend",
    "Count to ten please",
    "Which cat is 42?",
    "Name three colours.",
    "Who lives in the tower?",
    "Why is the sky blue?",
    "Spell plum backwards.",
    "What is two plus two?",
    "Describe Kamivel.",
]
MAX_NEW_TOKENS = 24
MAX_MODEL_LEN = 256
AUX = [1, 2, 3]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def prompt_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    return generation_prompt_ids(load_tokenizer(model_dir), messages)


@torch.no_grad()
def hf_greedy(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Generated ids up to and including the first `<|end|>`."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=TOKEN_IDS[END], pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def confident_target(src: Path, dest: Path) -> Path:
    """A copy of the tiny target with clear greedy margins and `</think>` / `<|end|>` in its output."""
    shutil.copytree(src, dest)
    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    model.lm_head.weight.mul_(25.0)
    # A non-trivial final norm, so "pre-norm" and "post-norm" states clearly differ.
    model.model.norm.weight.uniform_(0.5, 2.0)
    counts = Counter(
        t for m in conversations() for t in hf_greedy(model, prompt_ids(dest, m)) if t >= len(TOKEN_IDS)
    )
    common = [t for t, _ in counts.most_common(3)]
    # Where the model would emit its most common token it now closes the reasoning, and where it
    # would emit its third most common one it ends the turn: logits 5% above theirs.
    model.lm_head.weight[TOKEN_IDS[THINK_CLOSE]] = model.lm_head.weight[common[0]] * 1.05
    model.lm_head.weight[TOKEN_IDS[END]] = model.lm_head.weight[common[2]] * 1.05
    model.save_pretrained(str(dest))
    return dest
