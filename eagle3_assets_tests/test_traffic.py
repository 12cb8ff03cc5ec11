"""Prompts from traffic (issue 53, item 2): a request log read as prompts for the target, each line kept (train or
held out) or dropped with its file:line and why; appending keeps every old prompt's split and place; a logged reply
stands for generation only when it is the target's greedy output, decided and said per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import AssetKey

from eagle3_assets.demo.tokenizer import render_prompt
from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project
from eagle3_assets.prompts import Prompt, parse_prompts
from eagle3_assets.provenance import Inputs, expected, read_record
from eagle3_assets.responses import read_responses
from eagle3_assets.settings import SettingsError, parse_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer
from eagle3_assets.traffic import (
    TRAFFIC_HELDOUT_FILE,
    TRAFFIC_REPORT_FILE,
    TrafficBuild,
    read_prompt_set,
    write_traffic,
)
from eagle3_assets.traffic_log import LoggedCall, read_log, reply_decision
from eagle3_assets.traffic_settings import TrafficSettings

from .conftest import TINY_DEMO, tiny_settings
from .helpers import gpu_instance, target_of

MODEL = "acme/demo-target"
BASE = parse_prompts('{"id": "p-0", "prompt": "How many words are in: ring hat"}\n', "prompts.jsonl")
BASE_HELDOUT = parse_prompts('{"id": "e-0", "prompt": "What color is Xuquilin?"}\n', "eval.jsonl")


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return load_tokenizer(target_of(tiny_target_dir))


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def call(tokenizer, prompt: str, *, reply: str | None = "It is purple.<|end|>", model: str = MODEL, flat: bool = False,
         token_ids: bool = True, **request) -> str:  # fmt: skip
    """One logged call, as vLLM's OpenAI server answers it with `return_token_ids` (or without ids, `token_ids`)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **request}
    response = None
    if reply is not None:
        choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
        response = {"model": model, "choices": [choice]}
        if token_ids:
            choice["token_ids"] = ids_of(tokenizer, reply)
            response["prompt_token_ids"] = ids_of(tokenizer, render_prompt(prompt))
    line = {**body, **(response or {})} if flat else {"request": body, "response": response}
    return json.dumps(line)


def judge(tokenizer, share: float = 0.3, model: str | None = MODEL, temperature: float = 0.0) -> TrafficBuild:
    return TrafficBuild(tokenizer, len(tokenizer), {}, 64, share, model, temperature)


def build(tokenizer, log: Path, **kw):
    return judge(tokenizer, **kw).build(*read_log(str(log)), BASE, BASE_HELDOUT)


def first_log(tokenizer) -> list[str]:
    return [
        call(tokenizer, "Who founded Arvel?"),  # 1: kept, its reply logged
        call(tokenizer, "Who founded Arvel?", flat=True),  # 2: the same prompt, another shape
        '{"request": {"messages": [',  # 3: cut mid-line
        json.dumps({"request": {"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}]}}),  # 4  # fmt: skip
        call(tokenizer, "What color is Xuquilin?"),  # 5: a held-out prompt of the store
        call(tokenizer, "How many words are in: ring hat"),  # 6: a training prompt of the store
        call(tokenizer, "Where is Harrow?", temperature=0.7),  # 7
        call(tokenizer, "Where is Pemberly?", model="other/model"),  # 8
        call(tokenizer, "What does Ulla eat?", token_ids=False),  # 9
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}),  # 10
        call(tokenizer, "Who founded Harrow?", reply=None),  # 11: the request alone
        "[1, 2]",  # 12
        call(tokenizer, "Who lives in Arvel?", top_k=1, temperature=0.8),  # 13: greedy by top_k
        "",  # a blank line is no line
        call(tokenizer, "Name a fruit.", presence_penalty=0.5),  # 15
        call(tokenizer, "What color is Harrow?"),  # 16: its hash holds it out
    ]


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_log_gives_the_expected_rows_and_names_each_line_it_dropped(tmp_path, tokenizer):
    log = write_log(tmp_path / "gateway.jsonl", first_log(tokenizer))
    result = build(tokenizer, log)
    assert [str(d) for d in result.dropped] == [
        f"{log}:2: duplicate of {log}:1 (the same prompt as the target's template renders it)",
        f"{log}:3: malformed JSON (Expecting value at column 27)",
        f"{log}:4: the chat template cannot render this conversation: TemplateError: the demo chat template knows only "
        "user and assistant messages, got role system",
        f"{log}:5: a held-out prompt of `eval_prompts` (id e-0): never trained on",
        f"{log}:6: a training prompt of `prompts` already (id p-0)",
        f"{log}:10: messages[1] is a tool call or its result: only text chats are prompts here",
        f"{log}:12: expected a JSON object, got list",
    ]
    rows = [(r.prompt.messages[-1]["content"], r.heldout, r.reply and (r.reply.source, r.reply.why)) for r in result.rows]
    assert rows == [
        ("Who founded Arvel?", False, ("logged", "the greedy output of 'acme/demo-target', token ids logged")),
        ("Where is Harrow?", False, ("generated", "sampled, not greedy: temperature 0.7")),
        ("Where is Pemberly?", False, ("generated", "answered by 'other/model', not the target ('acme/demo-target', "
                                       "traffic.model)")),  # fmt: skip
        ("What does Ulla eat?", False, ("generated", "token ids not logged (a training row is the ids the engine "
                                        "produced, docs/DESIGN.md §3; vLLM logs them with return_token_ids)")),  # fmt: skip
        ("Who founded Harrow?", False, ("generated", "no reply logged")),
        ("Who lives in Arvel?", False, ("logged", "the greedy output of 'acme/demo-target', token ids logged")),
        ("Name a fruit.", False, ("generated", "the request sets presence_penalty 0.5: not the target's plain greedy output")),
        ("What color is Harrow?", True, None),
    ]
    assert (result.lines, result.files) == (15, [str(log)])
    assert result.reply_counts() == {"logged": 2, "generated: sampled": 1, "generated: other model": 1,
                                     "generated: text only": 1, "generated: no reply": 1, "generated: constrained": 1}  # fmt: skip
    # A training row says whose reply it gets; its id and split are its prompt's own hash.
    assert result.train[0] == Prompt("traffic-517a2652a5febfd3", [{"role": "user", "content": "Who founded Arvel?"}],
                                     {"traffic_reply": "logged"})  # fmt: skip
    assert result.rows[0].reply.completion_token_ids == ids_of(tokenizer, "It is purple.<|end|>")
    assert [p.id for p in result.heldout] == ["traffic-1677e24c770f451d"]
