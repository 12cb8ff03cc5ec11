"""Helpers shared by the vLLM tests (no tests here): a tiny target whose greedy output is unambiguous.

The conftest's tiny demo target is untrained, so its logits are nearly flat and two
engines could break a near-tie differently. `confident_target` scales its head (clear
margins) and rewires two rows of it so that greedy output contains every case the
generator must handle: rows that close `</think>`, rows that stop at `<|end|>`, rows
cut by the token budget.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from eagle3_assets.demo.tokenizer import END, THINK_CLOSE, TOKEN_IDS
from eagle3_assets.settings import VllmSettings
from eagle3_assets.target_model import load_tokenizer
from eagle3_assets.vllm_server import free_port

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
    tok = load_tokenizer(model_dir)
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"
    ]


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


def vllm_test_settings(**overrides) -> VllmSettings:
    """Engine settings for a CPU test server: float32 (exact comparisons), eager (starts faster)."""
    base = dict(
        host="127.0.0.1",
        port=free_port(),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_concurrency=4,
        # On the CPU backend this is the share of host memory the server may take (not GPU memory):
        # the default 0.9 refuses to start while another test server is up.
        gpu_memory_utilization=0.2,
        startup_timeout_s=600.0,
        extra_args=["--enforce-eager"],
    )
    base.update(overrides)
    return VllmSettings(**base)


@contextmanager
def small_kv_cache() -> Iterator[None]:
    """1 GiB of KV cache per test server: the machine is shared."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


def request_files(storage: Path) -> list[str]:
    """Hidden-state files (and locks) the server wrote that nobody collected."""
    return sorted(p.name for p in storage.iterdir() if ".safetensors" in p.name)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass
