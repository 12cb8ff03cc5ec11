"""Helpers shared by the drafter tests: a tiny target and hidden-state shards written from it.

The shards follow DESIGN §4 the way HF extraction writes them: aux = hidden_states[i]
for the aux ids ("input of layer i"), last = hidden_states[-1] (post-norm). The tests
in this file check the helpers themselves keep that format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as st_save
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_assets.drafter.data import SAMPLE_FORMAT, SUCCESS_FILE, read_safetensors_header, shard_dir
from eagle3_assets.storage import ArtifactStore

VOCAB, HIDDEN, LAYERS, HEAD_DIM, DRAFT_VOCAB = 256, 64, 4, 32, 64
AUX_IDS = [1, 2, 3]


def tiny_target(
    out_dir: Path, *, seed: int = 0, tie: bool = False, vocab: int = VOCAB, tokenizer: bool = False
) -> LlamaForCausalLM:
    """A random 4-layer Llama (H 64, 2 heads of 32, 1 kv head), saved as safetensors in `out_dir`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Random init gives a nearly flat norm; a non-trivial one makes "norm applied twice" visible.
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(out_dir)
    if tokenizer:
        write_word_tokenizer(out_dir, vocab)
    return model


def write_word_tokenizer(out_dir: Path, vocab: int) -> None:
    """A word-level tokenizer `t0 … t{vocab-1}` (vLLM needs one next to the target)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


def random_rows(
    n: int, *, seed: int = 0, min_len: int = 8, max_len: int = 24, vocab: int = VOCAB
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) rows: a short 'prompt' (mask 0) then 'assistant' tokens (mask 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        T = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(2, T // 2 + 1))
        ids = rng.integers(3, vocab, size=T).tolist()
        rows.append((ids, [0] * prompt + [1] * (T - prompt)))
    return rows


@torch.no_grad()
def sample_bytes(
    model: LlamaForCausalLM,
    ids: list[int],
    mask: list[int],
    *,
    row: int,
    aux_ids: list[int] = AUX_IDS,
    norm: str = "post_norm",
    dtype: torch.dtype = torch.float32,
) -> bytes:
    out = model(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    last = hs[-1][0]
    if norm == "pre_norm":
        # The last layer's output before the final norm: re-run the decoder without it.
        last = _pre_norm_last(model, ids)
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "aux_hidden_states": torch.cat([hs[i][0] for i in aux_ids], dim=-1).to(dtype).contiguous(),
        "last_hidden_state": last.to(dtype).contiguous(),
    }
    meta = {
        "format": SAMPLE_FORMAT,
        "aux_layer_ids": json.dumps(aux_ids),
        "last_hidden_state_norm": norm,
        "model": "tiny-llama",
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": str(model.config.hidden_size),
        "row": str(row),
    }
    return st_save(tensors, metadata=meta)


@torch.no_grad()
def _pre_norm_last(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda m, inp, out: captured.setdefault("x", inp[0]))
    model(torch.tensor([ids]))
    handle.remove()
    return captured["x"][0]


def write_shard(
    store: ArtifactStore,
    model: LlamaForCausalLM,
    rows: list[tuple[list[int], list[int]]],
    start: int,
    *,
    complete: bool = True,
    **kwargs,
) -> str:
    """Write rows as shard `rows_<start>-<start+len>`; returns its key."""
    key = f"rows_{start}-{start + len(rows)}"
    tokens = 0
    for i, (ids, mask) in enumerate(rows):
        data = sample_bytes(model, ids, mask, row=start + i, **kwargs)
        store.write_bytes(f"{shard_dir(key)}/{start + i}.safetensors", data)
        tokens += len(ids)
    if complete:
        store.write_json(f"{shard_dir(key)}/{SUCCESS_FILE}", {"rows": len(rows), "tokens": tokens})
    return key


def vocab_map(vocab: int = VOCAB, draft: int = DRAFT_VOCAB, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) for a random set of `draft` target ids (DESIGN §3 layout)."""
    used = np.sort(np.random.default_rng(seed).choice(vocab, size=draft, replace=False))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[used] = True
    return (used - np.arange(draft)).astype(np.int64), t2d


def greedy_vocab_map(model: LlamaForCausalLM, rows, draft: int = DRAFT_VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """A map holding the target's most frequent top-1 tokens on `rows`, so most positions are kept."""
    counts = np.zeros(model.config.vocab_size, dtype=np.int64)
    with torch.no_grad():
        for ids, _ in rows:
            top1 = model(torch.tensor([ids])).logits[0].argmax(-1)
            np.add.at(counts, top1.numpy(), 1)
    used = np.sort(np.argsort(-counts, kind="stable")[:draft])
    t2d = np.zeros(model.config.vocab_size, dtype=bool)
    t2d[used] = True
    return (used - np.arange(draft)).astype(np.int64), t2d


# -- the helpers keep the format ------------------------------------------------------


def test_written_sample_has_the_contract_format(tmp_path):
    model = tiny_target(tmp_path / "target")
    store = ArtifactStore(tmp_path / "store")
    key = write_shard(store, model, random_rows(1, min_len=10, max_len=10), 0)
    tensors, meta = read_safetensors_header(store, f"{shard_dir(key)}/0.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in tensors.items()} == {
        "input_ids": ("I32", [10]),
        "loss_mask": ("U8", [10]),
        "aux_hidden_states": ("F32", [10, 3 * HIDDEN]),
        "last_hidden_state": ("F32", [10, HIDDEN]),
    }
    assert meta["format"] == "eagle3-hidden-states/1"
    assert json.loads(meta["aux_layer_ids"]) == AUX_IDS
    assert meta["last_hidden_state_norm"] == "post_norm"
    assert store.read_json(f"{shard_dir(key)}/_SUCCESS.json") == {"rows": 1, "tokens": 10}
