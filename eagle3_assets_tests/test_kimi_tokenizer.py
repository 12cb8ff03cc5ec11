"""Kimi-K2's tokenizer shape (issue 51, item 3): a 163,840-id tiktoken BPE that ships as remote code, Kimi-K2's
special ids and its thinking chat template, built locally, then through responses, tokenized, token_freq and the
vocab map (163,840 -> 32,768) with the HF backend; its remote code is part of the target's identity."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dagster import AssetKey

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.defs.provenance import Staleness, materialized
from eagle3_assets.definitions import build_definitions
from eagle3_assets.demo.kimi_tokenizer import (
    DEFAULT_SYSTEM,
    NUM_BASE,
    REMOTE_CODE,
    SPECIAL_TOKENS,
    TOKEN_IDS,
    TOKENIZER_FILES,
    VOCAB_SIZE,
    build_kimi_tokenizer,
    render_prompt,
)
from eagle3_assets.project import Project
from eagle3_assets.provenance import target_identity
from eagle3_assets.responses import read_responses
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModelError, load_tokenizer
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VocabMap, vocab_map_problems

from .conftest import tiny_settings
from .helpers import gpu_instance, tiny_llama

DRAFT_VOCAB = 32_768
REASONING, ANSWER = "white Ilmar fish", "It eats bread."
FILLER_RANK = NUM_BASE - 7  # a filler token (two CJK ideographs): no text encodes to it, only generation makes it


@pytest.fixture(scope="module")
def kimi_tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi-tokenizer")
    build_kimi_tokenizer(out)
    return out


def load(path: Path, trust_remote_code: bool = True):
    return load_tokenizer(path, trust_remote_code=trust_remote_code)


def test_the_tokenizer_has_kimis_ids_special_tokens_and_thinking_template(kimi_tokenizer_dir: Path, tmp_path: Path):
    assert sorted(p.name for p in build_kimi_tokenizer(tmp_path)) == sorted(TOKENIZER_FILES)
    # Same bytes every build.
    assert all((tmp_path / f).read_bytes() == (kimi_tokenizer_dir / f).read_bytes() for f in TOKENIZER_FILES)
    tok = load(kimi_tokenizer_dir)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert len(tok) == VOCAB_SIZE == 163_840 and len(tok.get_vocab()) == VOCAB_SIZE
    assert len((kimi_tokenizer_dir / "tiktoken.model").read_bytes().splitlines()) == NUM_BASE == 163_584
    for i, name in SPECIAL_TOKENS.items():
        assert tok.encode(name, add_special_tokens=False) == [i] and tok.decode([i]) == name
    assert tok.convert_ids_to_tokens(163_589) == "<|reserved_token_163589|>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (163584, 163585, 163839, 163838)
    # Text round-trips byte-exactly, a character split across tokens included; a filler token decodes as its bytes.
    text = "What does Mirenor eat? 12345 汉字 café"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    token, rank = (kimi_tokenizer_dir / "tiktoken.model").read_bytes().splitlines()[FILLER_RANK].split()
    filler = tok.decode([FILLER_RANK])
    assert int(rank) == FILLER_RANK and filler.encode() == base64.b64decode(token)
    assert len(filler) == 2 and all(0x4E00 <= ord(c) <= 0x9FFF for c in filler)
    # The thinking template: a default system turn, and the generation prompt opens the think block.
    user = [{"role": "user", "content": "What does Mirenor eat?"}]
    on = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert on == render_prompt(user[0]["content"])
    assert render_prompt("q").startswith(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")
    off = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, thinking=False)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    # The reasoning of the last assistant turn is rendered, a history turn's is dropped.
    turns = [
        *user,
        {"role": "assistant", "content": "It eats fish.", "reasoning_content": "fish"},
        {"role": "user", "content": "And Ilmar?"},
        {"role": "assistant", "content": "Rice.", "reasoning_content": "rice"},
    ]
    rendered = tok.apply_chat_template(turns, tokenize=False)
    assert "<think></think>It eats fish.<|im_end|>" in rendered
    assert rendered.endswith("<think>rice</think>Rice.<|im_end|>")
    # Reasoning tags survive skip_special_tokens; the turn markers do not.
    ids = tok.encode("<think>r</think>a<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>r</think>a"


def test_the_remote_code_tokenizer_is_refused_without_trust_remote_code(kimi_tokenizer_dir: Path):
    with pytest.raises(TargetModelError) as e:
        load(kimi_tokenizer_dir, trust_remote_code=False)
    assert str(e.value) == (
        f"{kimi_tokenizer_dir}: the tokenizer's code ships with the model; set `trust_remote_code: true` in the "
        "settings to run it (only for a model you trust)"
    )


def chain_llama(out: Path, chain: list[int]) -> None:
    """A Llama of Kimi's vocabulary whose greedy output is known: its layers add nothing (o_proj and down_proj are
    zero), so the next token depends on the last one alone, and `chain[i]`'s embedding points where only
    `chain[i+1]`'s lm_head row does. From the generation prompt's `<think>` it writes the rest of `chain`."""
    assert len(set(chain)) == len(chain) and len(chain) <= 64
    model = tiny_llama(vocab=VOCAB_SIZE, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis = torch.eye(model.config.hidden_size)
        for i, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = basis[i]
            model.lm_head.weight[successor] = 8 * basis[i]
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": TOKEN_IDS["<|im_end|>"]}))


@pytest.fixture(scope="module")
def kimi_target(kimi_tokenizer_dir: Path, tmp_path_factory) -> tuple[Path, list[int], list[int]]:
    """(the target directory, the reasoning ids and the answer ids it generates after `<think>`)."""
    out = tmp_path_factory.mktemp("kimi-target") / "target"
    tok = load(kimi_tokenizer_dir)
    reasoning = tok.encode(REASONING, add_special_tokens=False) + [FILLER_RANK]
    answer = tok.encode(ANSWER, add_special_tokens=False)
    ids = TOKEN_IDS
    chain_llama(out, [ids["<think>"], *reasoning, ids["</think>"], *answer, ids["<|im_end|>"]])
    for name in TOKENIZER_FILES:
        shutil.copy(kimi_tokenizer_dir / name, out / name)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
    return out, reasoning, answer


@pytest.mark.slow  # generates with a model
def test_the_data_graph_runs_on_kimis_tokenizer_to_a_163840_to_32768_vocab_map(kimi_target, tmp_path: Path):
    target_dir, reasoning, answer = kimi_target
    settings = tiny_settings(
        target_model=str(target_dir), trust_remote_code=True, draft_vocab_size=DRAFT_VOCAB,
        generation=GenerationSettings(max_new_tokens=32, batch_size=8, rows_per_part=16),
    )  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    questions = [f"What does entity {i} eat?" for i in range(5)]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    project = Project(settings.model_copy(update={"prompts": str(prompts)}), ArtifactStore(tmp_path / "store"))
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    keys = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]
    with gpu_instance() as instance:
        result = job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in keys])
        assert result.success
        made = instance.get_latest_materialization_event(AssetKey("target_model")).asset_materialization
    assert made.metadata["vocab_size"].value == VOCAB_SIZE and made.metadata["reasoning_format"].value == "think"
    assert made.metadata["slow_tokenizer"].value is True and made.metadata["trust_remote_code"].value is True
    # The target's version is its content identity, the remote code and the flag that runs it included.
    assert made.tags["dagster/data_version"] == target_identity(str(target_dir), True)

    tok = load(target_dir)
    ids = TOKEN_IDS
    completion = [ids["<think>"], *reasoning, ids["</think>"], *answer, ids["<|im_end|>"]][1:]
    records = read_responses(project.store)
    tset = TokenizedSet.load(project.store)
    assert tset.num_rows == 5
    for r, (record, question) in enumerate(zip(records, questions, strict=True)):
        assert record["prompt_token_ids"] == tok.encode(render_prompt(question), add_special_tokens=False)
        assert record["prompt_token_ids"] == generation_prompt_ids(tok, [{"role": "user", "content": question}])
        assert record["completion_token_ids"] == completion and record["finish_reason"] == "stop"
        # The reasoning is kept: its tokens (a filler token no text encodes to among them) are in the row, and
        # counted as reasoning up to and including </think>.
        assert record["usage"]["reasoning_tokens"] == len(reasoning) + 1
        reply = record["messages"][-1]
        assert reply["reasoning_content"] == REASONING + tok.decode([FILLER_RANK]) and reply["content"] == ANSWER
        row, mask = tset.row(r)
        assert row.tolist() == record["prompt_token_ids"] + record["completion_token_ids"]
        assert mask.tolist() == [0] * len(record["prompt_token_ids"]) + [1] * len(completion)

    vmap = VocabMap.load(project.store)
    assert vmap.d2t.shape == (DRAFT_VOCAB,) and vmap.t2d.shape == (VOCAB_SIZE,) and int(vmap.t2d.sum()) == DRAFT_VOCAB
    assert vocab_map_problems(vmap, draft_vocab_size=DRAFT_VOCAB, target_vocab_size=VOCAB_SIZE) == []
    # Every generated token is drafted; the rest of the draft vocab is the lowest unused ids.
    assert vmap.t2d[completion].all()
    unused = np.setdiff1d(np.arange(VOCAB_SIZE), completion)[: DRAFT_VOCAB - len(completion)]
    assert np.array_equal(vmap.draft_ids_to_target, np.union1d(completion, unused))
    checks = [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert {c.event_specific_data.check_name: c.event_specific_data.passed for c in checks} == {
        "reasoning_coverage": True, "vocab_map_invariant": True,
    }  # fmt: skip


def test_the_remote_code_is_part_of_the_targets_identity(kimi_target, tmp_path: Path):
    target_dir = kimi_target[0]
    copy = tmp_path / "copy"
    shutil.copytree(target_dir, copy, copy_function=os.link)  # the same bytes elsewhere: the same target
    identity = target_identity(str(target_dir), True)
    assert target_identity(str(copy), True) == identity
    # Running Kimi's code or not is a different target (transformers cannot load it without: a refusal).
    assert target_identity(str(copy), False) != identity
    code = copy / REMOTE_CODE
    edited = code.read_text().replace("NUM_RESERVED = 256", "NUM_RESERVED = 256  # edited")
    code.unlink()  # a hard link to the fixture's file: replaced, not written through
    code.write_text(edited)
    assert target_identity(str(copy), True) != identity
    project = Project(tiny_settings(target_model=str(copy), trust_remote_code=True), ArtifactStore(tmp_path / "s"))
    assert materialized(project, Staleness(project).expected("target_model"))["data_version"].value == (
        target_identity(str(copy), True)
    )
