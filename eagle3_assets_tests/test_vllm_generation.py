"""Generation through vLLM (CPU build): greedy output equals HF token for token, reasoning comes back
apart from the answer through the server's reasoning parser, rejected rows fail alone, `responses`
resumes, and the server the generator started stops with it.

One server for the module, started by the generator itself (no `vllm.server_url`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from eagle3_assets.generation import open_generator
from eagle3_assets.generation.base import Completion
from eagle3_assets.generation.hf import HFGenerator
from eagle3_assets.generation.vllm import VLLMGenerator
from eagle3_assets.hidden_states import ExtractorConfigError
from eagle3_assets.hidden_states.vllm_extractor import VLLMExtractor
from eagle3_assets.prompts import Prompt
from eagle3_assets.responses import generate_responses, read_responses
from eagle3_assets.settings import GenerationSettings, VllmSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.vllm_server import group_members, port_in_use

from .test_vllm_common import (
    AUX,
    MAX_MODEL_LEN,
    MAX_NEW_TOKENS,
    conversations,
    confident_target,
    hf_greedy,
    prompt_ids,
    small_kv_cache,
    vllm_test_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

THINK_CLOSE_ID = 6
GEN = GenerationSettings(backend="vllm", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, rows_per_part=5)


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return confident_target(tiny_target_dir, tmp_path_factory.mktemp("vllm-gen") / "target")


@pytest.fixture(scope="module")
def generator(target: Path):
    pytest.importorskip("vllm")
    with small_kv_cache():
        gen = open_generator(target, GEN, vllm_test_settings(reasoning_parser="deepseek_r1"))
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def hf_completions(target: Path) -> list[Completion]:
    hf = HFGenerator(target, GEN.model_copy(update={"backend": "hf"}), device=torch.device("cpu"))
    try:
        return hf.generate(conversations())
    finally:
        hf.close()


def test_greedy_output_equals_hf_token_for_token(generator: VLLMGenerator, target: Path):
    assert isinstance(generator, VLLMGenerator) and generator.server.owned
    model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    closed = stopped = cut = 0
    for messages in conversations():
        ids = prompt_ids(target, messages)
        want = hf_greedy(model, ids)
        got = generator.chat(messages)
        assert got.token_ids == want, messages
        assert (got.completion.prompt_tokens, got.completion.completion_tokens) == (len(ids), len(want))
        closed += THINK_CLOSE_ID in want
        stopped += got.completion.finish_reason == "stop"
        cut += got.completion.finish_reason == "length"
    # The rewired target covers every case: reasoning closed, turn ended, budget exhausted.
    assert closed >= 2 and stopped >= 2 and cut >= 2


def same_text(vllm_text: str, hf_text: str, finish_reason: str) -> bool:
    """Equal, except where a length cut split a UTF-8 character: HF decodes the dangling bytes
    as U+FFFD, vLLM's incremental detokenizer holds them back. The tokens are equal either way."""
    if finish_reason == "length" and hf_text.endswith("\ufffd"):
        return vllm_text == hf_text.rstrip("\ufffd")
    return vllm_text == hf_text


def test_reasoning_comes_back_apart_from_the_answer(generator: VLLMGenerator, hf_completions: list[Completion]):
    got = generator.generate(conversations())
    assert len(got) == len(hf_completions)
    for v, h in zip(got, hf_completions, strict=True):
        assert (v.finish_reason, v.prompt_tokens, v.completion_tokens, v.error) == (
            h.finish_reason, h.prompt_tokens, h.completion_tokens, None,
        )  # fmt: skip
        if h.reasoning_tokens:  # `</think>` generated: the parser splits exactly where split_reasoning does
            assert (v.reasoning, v.reasoning_tokens) == (h.reasoning, h.reasoning_tokens)
            assert same_text(v.content, h.content, h.finish_reason), (v.content, h.content)
        else:
            # No `</think>`: vLLM's deepseek_r1 parser calls the whole text reasoning (an unfinished
            # thought), where split_reasoning calls it the answer. Same text, same tokens.
            assert v.content == ""
            assert same_text(v.reasoning, h.content, h.finish_reason), (v.reasoning, h.content)
            want = len(generator.tokenizer(v.reasoning, add_special_tokens=False)["input_ids"]) if v.reasoning else 0
            assert v.reasoning_tokens == want
    assert sum(1 for c in got if c.reasoning and c.content) >= 1


def test_a_rejected_row_fails_alone(generator: VLLMGenerator):
    ok = conversations()[0]
    system = [{"role": "system", "content": "be brief"}]
    too_long = [{"role": "user", "content": " plum" * (MAX_MODEL_LEN + 10)}]
    done = generator.generate([ok, system, too_long, ok])
    url = generator.url
    assert done[0] == done[3] == generator.chat(ok).completion and done[0].error is None
    assert done[1] == Completion.failed(
        f"vLLM server at {url} rejected the request (HTTP 400): "
        "the demo chat template knows only user and assistant messages, got role system"
    )
    assert done[2].finish_reason == "error"
    assert done[2].error.startswith(
        f"vLLM server at {url} rejected the request (HTTP 400): This model's maximum context length is "
        f"{MAX_MODEL_LEN} tokens."
    )


def test_responses_are_generated_and_resumed_through_vllm(generator: VLLMGenerator, hf_completions):
    store = ArtifactStore("memory://vllm-gen-responses")
    prompts = [Prompt(id=f"p{i}", messages=m) for i, m in enumerate(conversations())]
    first = generate_responses(store, prompts, generator, GEN)
    assert (first.rows, first.rows_generated, first.rows_reused, first.rows_failed) == (12, 12, 0, 0)
    assert first.prompt_tokens == sum(c.prompt_tokens for c in hf_completions)
    assert first.completion_tokens == sum(c.completion_tokens for c in hf_completions)
    again = generate_responses(store, prompts, generator, GEN)
    assert (again.rows_generated, again.rows_reused) == (0, 12)
    records = read_responses(store)
    assert [r["id"] for r in records] == [p.id for p in prompts]
    for r, c in zip(records, generator.generate(conversations()), strict=True):
        assert r["messages"][-1] == {"role": "assistant", "content": c.content, "reasoning_content": c.reasoning}
        assert r["usage"]["completion_tokens"] == c.completion_tokens


def test_the_extractor_refuses_a_generation_server(generator: VLLMGenerator, target: Path):
    with pytest.raises(ExtractorConfigError) as e:
        VLLMExtractor(target, VllmSettings(server_url=generator.url), aux_layer_ids=AUX)
    assert str(e.value).startswith(
        f"the vLLM server at {generator.url} does not return hidden states (no kv_transfer_params.hidden_states_path)"
    )
    assert generator.server.is_healthy()  # a reused server is left alone


def test_closing_the_generator_stops_the_server_it_started(generator: VLLMGenerator):
    server = generator.server
    pid, workdir = server.process.pid, server.workdir
    host, port = server.url.removeprefix("http://").split(":")
    generator.close()
    assert server.process.poll() is not None
    assert group_members(pid) == []  # nothing of its process group is left
    assert not port_in_use(host, int(port))
    assert not workdir.exists()
