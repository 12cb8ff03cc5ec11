"""What the drafter serving tests share (`test_drafter_vllm.py`, `test_dflash.py`): a confident tiny target with its
greedy text in shards, and vLLM's drafting rounds replayed over our own model's predictions.

On the target's own greedy text, a round whose newest token sits at index t + 1 accepts the drafts at index t while
each equals the next greedy token, so replaying the rounds over the teacher-forced predictions gives the counters
vLLM reports: they agree only when the export serves exactly what trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_assets.storage import ArtifactStore
from eagle3_assets.vocab_map import VocabMap

from .helpers import greedy_vocab_map, tiny_llama, write_shard

PROMPT_LEN = 6


def confident_target_with_text(
    tmp: Path, *, prompts: int, new_tokens: int, shard_rows: int, **llama: Any
) -> tuple[Path, list[list[int]], list[list[int]], ArtifactStore, list[str], VocabMap]:
    """(target dir, prompts, greedy prompt + `new_tokens` per prompt, store, shard keys, vocab map): a tiny target
    with a scaled head (clear margins: two engines never break a near-tie differently) and its greedy text cut into
    shards of `shard_rows`; `llama` goes to `tiny_llama` (e.g. `rope_parameters`)."""
    target_dir = tmp / "target"
    model = tiny_llama(target_dir, seed=3, tokenizer=True, **llama)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(target_dir)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 256, size=PROMPT_LEN).tolist() for _ in range(prompts)]
    with torch.no_grad():
        generated = [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0]
            .tolist()
            for p in ids
        ]
    rows = [(g, [0] * PROMPT_LEN + [1] * new_tokens) for g in generated]
    store = ArtifactStore(tmp / "store")
    keys = [write_shard(store, model, rows[a : a + shard_rows], a) for a in range(0, len(rows), shard_rows)]
    return target_dir, ids, generated, store, keys, greedy_vocab_map(model, rows, draft=128)


def replay_rounds(preds: list[torch.Tensor], input_ids: torch.Tensor, served: int) -> tuple[int, list[int]]:
    """(drafts, accepted per position) vLLM reports serving `served` tokens per prompt, where `preds[a][i, t]` is
    the target id our model drafts at position a of a round whose last verified index is t, on row i of
    `input_ids` [B, T] (the greedy text)."""
    k = len(preds)
    drafts, accepted = 0, [0] * k
    for i in range(input_ids.shape[0]):
        ids = input_ids[i]
        newest = PROMPT_LEN  # index of the newest token: the target's prefill output
        while newest - PROMPT_LEN + 1 < served:  # the request is unfinished: draft a round
            t, a = newest - 1, 0
            drafts += 1
            while a < k and preds[a][i, t] == ids[t + 2 + a]:
                accepted[a] += 1
                a += 1
            newest += a + 1
    return drafts, accepted
