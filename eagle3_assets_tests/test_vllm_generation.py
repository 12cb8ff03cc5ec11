"""Generation through vLLM (CPU build): the engine gets exactly our prompt ids and returns exactly
the ids it generated (the stop token included), equal to HF greedy token for token; both backends
give the same records through `responses`, reasoning split by one rule; rejected rows fail alone;
the server the generator started stops with it.

One server for the module, started by the generator itself (no `vllm.server_url`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.demo.tokenizer import END, THINK_CLOSE, THINK_OPEN, TOKEN_IDS
from eagle3_assets.generation import open_generator
from eagle3_assets.generation.base import Generated
from eagle3_assets.generation.hf import HFGenerator
from eagle3_assets.generation.vllm import VLLMGenerator
from eagle3_assets.hidden_states import ExtractorConfigError
from eagle3_assets.hidden_states.vllm_extractor import VLLMExtractor
from eagle3_assets.processes import group_members
from eagle3_assets.prompts import Prompt
from eagle3_assets.reasoning import detect_format
from eagle3_assets.responses import Renderer, generate_responses, read_responses
from eagle3_assets.settings import GenerationSettings, VllmSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer, stop_token_ids
from eagle3_assets.vllm_server.client import port_in_use

from .helpers import hybrid_demo_tokenizer, vllm_test_settings
from .vllm_helpers import MAX_NEW_TOKENS, confident_target, conversations, hf_greedy, prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 256
GEN = GenerationSettings(backend="vllm", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, rows_per_part=5)


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    path = confident_target(tiny_target_dir, tmp_path_factory.mktemp("vllm-gen") / "target")
    return TargetModel.read(path, aux_layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def generator(target: TargetModel):
    pytest.importorskip("vllm")
    gen = open_generator(target, GEN, vllm_test_settings(MAX_MODEL_LEN))
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def renderer(target: TargetModel) -> Renderer:
    tok = load_tokenizer(target)
    return Renderer(tok, detect_format(tok), stop_token_ids(target), max_seq_len=MAX_MODEL_LEN)


def test_the_engine_returns_exactly_the_ids_hf_greedy_generates_stop_token_included(generator, target):
    assert isinstance(generator, VLLMGenerator) and generator.server.owned
    assert generator.stop_token_ids == {TOKEN_IDS[END]}
    model = LlamaForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()
    prompts = [prompt_ids(target.path, m) for m in conversations()]
    closed = stopped = cut = 0
    for ids, got in zip(prompts, generator.generate(prompts), strict=True):
        want = hf_greedy(model, ids)
        assert got.completion_token_ids == want and got.error is None
        if got.finish_reason == "stop":
            assert want[-1] == TOKEN_IDS[END]  # the stop token is part of what the target produced
            stopped += 1
        else:
            assert got.finish_reason == "length" and len(want) == MAX_NEW_TOKENS and TOKEN_IDS[END] not in want
            cut += 1
        closed += TOKEN_IDS[THINK_CLOSE] in want
    # The rewired target covers every case: reasoning closed, turn ended, budget exhausted.
    assert closed >= 2 and stopped >= 2 and cut >= 2


def test_both_backends_write_the_same_records_through_responses(generator, target, renderer):
    prompts = [Prompt(id=f"p{i}", messages=m) for i, m in enumerate(conversations())]
    by_backend = {}
    hf = HFGenerator(target, GEN.model_copy(update={"backend": "hf"}), device=torch.device("cpu"))
    try:
        for name, gen in (("vllm", generator), ("hf", hf)):
            store = ArtifactStore(f"memory://vllm-gen-responses-{name}")
            summary = generate_responses(store, prompts, gen, renderer, GEN)
            assert (summary.rows, summary.rows_generated, summary.rows_failed) == (12, 12, 0)
            again = generate_responses(store, prompts, gen, renderer, GEN)
            assert (again.rows_generated, again.rows_reused) == (0, 12)
            by_backend[name] = read_responses(store)
    finally:
        hf.close()
    assert by_backend["vllm"] == by_backend["hf"]  # ids, texts, reasoning, counts, finish reasons: all of it
    records = by_backend["vllm"]
    closed = [r for r in records if TOKEN_IDS[THINK_CLOSE] in r["completion_token_ids"]]
    assert closed and len(closed) < len(records)
    for r in records:
        ids = r["completion_token_ids"]
        if r in closed:  # reasoning through the close tag (this untrained target never writes the open tag)
            assert r["usage"]["reasoning_tokens"] == ids.index(TOKEN_IDS[THINK_CLOSE]) + 1
        else:  # no think block was opened, in the prompt or the output: all answer
            assert r["usage"]["reasoning_tokens"] == 0 and r["messages"][-1]["reasoning_content"] == ""
            assert r["messages"][-1]["content"] == renderer.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_mixed_mode_prompt_set_renders_each_mode_for_both_backends(generator, target, renderer):
    """Run-wide thinking off, every other prompt back on: each row is rendered and recorded in its own mode,
    and both engines complete exactly those ids."""
    tok = hybrid_demo_tokenizer(target)
    modal = Renderer(tok, renderer.reasoning, renderer.stop_token_ids, MAX_MODEL_LEN, {"enable_thinking": False})
    prompts = [
        Prompt(f"p{i}-{mode}", m, chat_template_kwargs={"enable_thinking": True} if mode == "on" else {})
        for i, m in enumerate(conversations()[:3])
        for mode in ("off", "on")
    ]
    by_backend = {}
    hf = HFGenerator(target, GEN.model_copy(update={"backend": "hf"}), device=torch.device("cpu"))
    try:
        for name, gen in (("vllm", generator), ("hf", hf)):
            summary = generate_responses(ArtifactStore(f"memory://vllm-gen-modes-{name}"), prompts, gen, modal, GEN)
            assert summary.modes == {'{"enable_thinking": false}': 3, '{"enable_thinking": true}': 3}
            by_backend[name] = read_responses(ArtifactStore(f"memory://vllm-gen-modes-{name}"))
    finally:
        hf.close()
    assert by_backend["vllm"] == by_backend["hf"]
    records = by_backend["vllm"]
    for p, r in zip(prompts, records, strict=True):
        off = p.id.endswith("off")
        assert r["chat_template_kwargs"] == {"enable_thinking": not off}
        assert r["prompt_token_ids"] == generation_prompt_ids(tok, p.messages, r["chat_template_kwargs"])
        assert (r["prompt_token_ids"][-2:] == [TOKEN_IDS[THINK_OPEN], TOKEN_IDS[THINK_CLOSE]]) is off
    # The engines answered the mode's ids: the same conversation is answered differently in the two modes.
    assert any(a["completion_token_ids"] != b["completion_token_ids"] for a, b in zip(records[::2], records[1::2]))


def test_a_rejected_row_fails_alone(generator):
    ok = prompt_ids(generator_target_path(generator), conversations()[0])
    too_long = ok * (MAX_MODEL_LEN // len(ok) + 1)
    out_of_vocab = [*ok, 10**6]
    done = generator.generate([ok, too_long, out_of_vocab, ok])
    assert done[0] == done[3] and done[0].error is None
    assert done[1] == Generated.failed(f"prompt has {len(too_long)} tokens; the server's context is {MAX_MODEL_LEN}")
    assert done[2].finish_reason == "error"
    assert done[2].error.startswith(f"vLLM server at {generator.url} rejected the request (HTTP 400): ")


def generator_target_path(generator: VLLMGenerator) -> Path:
    return Path(generator.server.plan.model)


def test_the_extractor_refuses_a_generation_server(generator, target):
    with pytest.raises(ExtractorConfigError) as e:
        VLLMExtractor(target, VllmSettings(server_url=generator.url))
    assert str(e.value).startswith(
        f"the vLLM server at {generator.url} does not return hidden states (no kv_transfer_params.hidden_states_path)"
    )
    assert generator.server.is_healthy()  # a reused server is left alone


def test_closing_the_generator_stops_the_server_it_started(generator):
    server = generator.server
    pid, workdir = server.process.pid, server.workdir
    host, port = server.url.removeprefix("http://").split(":")
    generator.close()
    assert server.process.poll() is not None
    assert group_members(pid) == []  # nothing of its process group is left
    assert not port_in_use(host, int(port))
    assert not workdir.exists()
