"""What the drafter serving tests share (`test_drafter_vllm.py`, `test_dflash.py`): a confident tiny target with its
greedy text in shards, and vLLM's drafting rounds replayed over our own model's predictions by the package's replay
(`served_replay`, which drafter_eval runs on every eval): they agree only when the export serves exactly what trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_assets.drafter.data import BatchLoader, index_samples
from eagle3_assets.drafter.family import Family
from eagle3_assets.drafter.served_replay import ReplayCheck, replay_served
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.hidden_states.base import ExtractedSample
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


def replayed(family: Family, model: torch.nn.Module, store: ArtifactStore, keys: list[str], spec: GenerationResult,
             k: int, suspects: list[str] | None = None) -> ReplayCheck:  # fmt: skip
    """vLLM's pass `spec` at k against the rounds `model` drafts on the shards' greedy text (`served_replay`, as
    drafter_eval replays them), where every row is a prompt of `PROMPT_LEN` tokens and its greedy continuation."""
    refs, _ = index_samples(store, keys)
    batch = BatchLoader(store, refs, batch_tokens=10**6, seed=0).load(range(len(refs)))
    samples = [
        ExtractedSample(i, batch.input_ids[i, :n].numpy(), batch.aux[i, :n], batch.last[i, :n])
        for i, n in enumerate(batch.lengths.tolist())
    ]
    return replay_served(family, model.eval(), samples, [PROMPT_LEN] * len(samples), {k: spec}, suspects or [])[0]


def assert_served_as_replayed(check: ReplayCheck) -> None:
    """vLLM's counters are the replay's, to a 1% margin: a near-tie argmax flipping on another CPU (they matched
    exactly here). Feeding the wrong aux layers moved them by 3-4%."""
    margin = max(1.0, 0.01 * check.replayed.drafts)
    assert abs(check.served.drafts - check.replayed.drafts) <= margin, check.as_json()
    for got, want in zip(check.served.accepted, check.replayed.accepted, strict=True):
        assert abs(got - want) <= margin, check.as_json()
    assert check.passed, check.describe()
