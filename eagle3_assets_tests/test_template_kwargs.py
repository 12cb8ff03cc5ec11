"""Chat-template kwargs (serving modes) on a hybrid template that honours `enable_thinking` as Qwen3's does:
a run-wide setting and a per-prompt field, merged per key; the row records what was rendered; the eval
renders the same ids; a kwarg the template never reads is refused; an explicit `generation.reasoning`
that contradicts the tokenizer is refused, naming both. No model: templates and tokenizers only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_assets.chat import TemplateKwargsError, check_template_kwargs, generation_prompt_ids, mode_label
from eagle3_assets.drafter.context_bins import group_label
from eagle3_assets.drafter.evaluate import EvalReport, eval_prompt_ids
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.generation.base import Generated
from eagle3_assets.prompts import PromptsError, parse_prompts
from eagle3_assets.reasoning import ReasoningFormatError, detect_format
from eagle3_assets.responses import Renderer, render, response_record
from eagle3_assets.settings import load_settings
from eagle3_assets.tokenized import tokenize_responses

from .test_reasoning import CHATML, HARMONY, HARMONY_SPECIALS, QWEN3, family_tokenizer, ids_of

# Qwen3's hybrid generation prompt: thinking off writes an empty, closed think block.
HYBRID = QWEN3.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}",
)
MIXED = (
    '{"id": "on", "prompt": "Two plus two?"}\n'
    '{"id": "off", "prompt": "Two plus two?", "chat_template_kwargs": {"enable_thinking": false}}\n'
    '{"id": "on-explicit", "prompt": "What does the plum cat eat?", "chat_template_kwargs": {"enable_thinking": true}}\n'
)


@pytest.fixture(scope="module")
def tok():
    return family_tokenizer(CHATML, HYBRID, "<|im_end|>")


def test_a_mixed_mode_prompt_file_renders_and_records_each_prompts_merged_kwargs(tok):
    prompts = parse_prompts(MIXED, "mixed.jsonl")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = Renderer(tok, detect_format(tok), {end}, 4096, {"enable_thinking": True})
    rows = []
    for i, p in enumerate(prompts):
        ids = render(p, renderer)
        completion = [*ids_of(tok, "Four."), end]
        rows.append(response_record(i, p, ids, Generated(completion, "stop"), renderer))
    on, off, explicit = rows
    # The prompt's own kwarg goes over the run-wide one, and the row records what was rendered.
    assert [r["chat_template_kwargs"] for r in rows] == [{"enable_thinking": True}, {"enable_thinking": False}] + [
        {"enable_thinking": True}
    ]
    assert tok.decode(off["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(on["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
    assert off["prompt_token_ids"] == generation_prompt_ids(tok, prompts[1].messages, {"enable_thinking": False})
    # Thinking off: the closed block is prompt (mask 0), the answer all answer, no reasoning counted.
    assert off["usage"]["reasoning_tokens"] == 0 and off["messages"][-1]["content"] == "Four."
    tset, _ = tokenize_responses(rows, max_seq_len=4096, overlong="truncate", unfinished="keep")
    ids, mask = tset.row(1)
    assert ids.tolist() == off["prompt_token_ids"] + off["completion_token_ids"]
    assert mask.tolist() == [0] * len(off["prompt_token_ids"]) + [1] * len(off["completion_token_ids"])
    # drafter_eval renders each prompt exactly as its row was rendered, and groups by mode.
    eval_ids, modes = eval_prompt_ids(tok, prompts, {"enable_thinking": True})
    assert eval_ids == [r["prompt_token_ids"] for r in rows]
    assert modes == ['{"enable_thinking": true}', '{"enable_thinking": false}', '{"enable_thinking": true}']
    assert mode_label({}) == "{}"


def test_a_kwarg_the_template_never_reads_is_refused_naming_it_and_where_it_is_set(tok):
    prompts = parse_prompts(MIXED + '{"id": "ds", "prompt": "Hi", "chat_template_kwargs": {"thinking": true}}\n', "m")
    with pytest.raises(TemplateKwargsError, match=r"^prompt 'ds' \(m:4\): chat_template_kwargs 'thinking' changes nothing"):
        check_template_kwargs(tok, prompts, {})
    with pytest.raises(TemplateKwargsError, match=r"^generation.chat_template_kwargs: chat_template_kwargs 'effort'"):
        eval_prompt_ids(tok, prompts[:1], {"effort": "high"})
    with pytest.raises(TemplateKwargsError, match=r"^generation.chat_template_kwargs: chat_template_kwargs 'tokenize' is an"):
        check_template_kwargs(tok, prompts[:1], {"tokenize": True})
    # The template's default value renders the same text, but the template reads it: not refused.
    check_template_kwargs(tok, prompts[:3], {"enable_thinking": True})


def kwargs_refusal(tok, kwargs: dict, run_wide: dict | None = None) -> str:
    """Why check_template_kwargs refuses `kwargs` on line 2 of p.jsonl (or `run_wide` for every prompt)."""
    lines = '{"prompt": "a"}\n' + json.dumps({"id": "p", "prompt": "Hi", "chat_template_kwargs": kwargs}) + "\n"
    with pytest.raises(TemplateKwargsError) as e:
        check_template_kwargs(tok, parse_prompts(lines, "p.jsonl")[1:], run_wide or {})
    return str(e.value)


def test_a_kwarg_is_accepted_only_if_the_template_reads_it_as_its_own_variable_of_the_type_it_compares():
    # Qwen3's loop variable is `message`: a kwarg of that name is never what the template reads.
    tok = family_tokenizer(CHATML, HYBRID.replace("for m in", "for message in").replace("m['", "message['"), "<|im_end|>")
    assert kwargs_refusal(tok, {"enable_thinking": "false"}) == (
        "prompt 'p' (p.jsonl:2): chat_template_kwargs 'enable_thinking' is \"false\" (a string), but the chat template "
        "compares it with false (a boolean), so no comparison matches it; give a boolean, e.g. "
        '{"enable_thinking": false}'
    )
    for name in ("messages", "bos_token", "raise_exception"):
        assert kwargs_refusal(tok, {name: []}) == (
            f"prompt 'p' (p.jsonl:2): chat_template_kwargs {name!r} would replace the template's own {name!r} (what "
            "every prompt is rendered with: the conversation, the tokenizer's special tokens, the generation prompt); "
            "remove it"
        )
    assert kwargs_refusal(tok, {}, {"messages": []}).startswith("generation.chat_template_kwargs: chat_template_kwargs 'messages' would")
    assert kwargs_refusal(tok, {"message": 1}) == (
        "prompt 'p' (p.jsonl:2): chat_template_kwargs 'message' changes nothing: the target's chat template renders "
        "the same text without it and with any other value. Remove it or fix its name: a row rendered with it would "
        "record a mode it was not rendered in"
    )
    assert kwargs_refusal(tok, {"enable_thinking": False, "note": "x" * 2_000_000}) == (
        "prompt 'p' (p.jsonl:2): chat_template_kwargs 'note' is 2000002 bytes as JSON, over the 4096-byte limit: a "
        "kwarg chooses a mode and is recorded in every row; put text in the prompt's messages"
    )
    check_template_kwargs(tok, parse_prompts(MIXED, "mixed.jsonl"), {})
    # DeepSeek-V3.1 tests `thinking` for truth: the string "false" is true there.
    v31 = QWEN3.replace("assistant\n{% endif %}", "assistant\n{% if thinking is defined and thinking %}<think>{% endif %}{% endif %}")
    assert kwargs_refusal(family_tokenizer(CHATML, v31, "<|im_end|>"), {"thinking": "false"}) == (
        "prompt 'p' (p.jsonl:2): chat_template_kwargs 'thinking' is \"false\" (a string), but the chat template tests "
        'it as a condition, where every non-empty string is true; give a boolean, e.g. {"thinking": false}'
    )


def test_settings_and_prompt_lines_take_template_kwargs(tmp_path: Path):
    path = tmp_path / "eagle3.yaml"
    path.write_text("generation: {chat_template_kwargs: {enable_thinking: false, reasoning_effort: low}}\n")
    s = load_settings({"EAGLE3_CONFIG": str(path)})
    assert s.generation.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert load_settings({}).generation.chat_template_kwargs == {}
    with pytest.raises(PromptsError, match=r"^p.jsonl:1 \(id a\): 'chat_template_kwargs' must be an object"):
        parse_prompts('{"id": "a", "prompt": "x", "chat_template_kwargs": [true]}\n', "p.jsonl")
    (p,) = parse_prompts('{"id": "a", "prompt": "x", "chat_template_kwargs": {"thinking": true}, "kind": "k"}', "p")
    assert (p.chat_template_kwargs, p.extra) == ({"thinking": True}, {"kind": "k"})
    assert p.to_json()["chat_template_kwargs"] == {"thinking": True}


def test_an_explicit_reasoning_format_that_contradicts_the_tokenizer_is_refused_naming_both(tok):
    harmony = family_tokenizer(HARMONY_SPECIALS, HARMONY, "<|return|>")
    for setting in ("think", "none"):
        with pytest.raises(ReasoningFormatError) as e:
            detect_format(harmony, setting)
        assert str(e.value) == (
            f"generation.reasoning: {setting!r} contradicts the tokenizer, which has gpt-oss's harmony tokens "
            "(<|channel|>, <|message|>, <|return|>) and reads as 'harmony'; set generation.reasoning to 'harmony' "
            "or 'auto'"
        )
    with pytest.raises(ReasoningFormatError, match=r"'harmony' contradicts the tokenizer, which has no <\|channel\|>"):
        detect_format(tok, "harmony")
    # A model may carry the think tags and never think; the tags may be several tokens elsewhere.
    assert (detect_format(tok, "none"), detect_format(harmony, "harmony"), detect_format(tok, "auto")) == (
        "none", "harmony", "think"
    )  # fmt: skip


def test_drafter_eval_reports_acceptance_per_mode():
    """The eval's runs come back with a result per group, one group per (mode, context bin) (vllm_eval `groups`:
    tested on a real engine in test_drafter_vllm.py); the report adds the groups' counters up per mode and per bin,
    beside the whole's."""
    on, off = '{"enable_thinking": true}', '{"enable_thinking": false}'
    plain = GenerationResult([[5, 6], [7, 8], [9]])
    report = EvalReport(prompts=3, max_tokens=2, modes={on: 2, off: 1}, bins={"0-4": 2, "4+": 1}, min_prompts_per_bin=2)
    for k, zeroed, drafts, accepted in ((3, False, 4, 4), (3, True, 4, 1), (7, False, 4, 6), (7, True, 4, 2)):
        short, long = (3, 1) if k == 3 else (4, 2)  # the "on" mode's accepted tokens, split by bin
        spec = GenerationResult(
            [[5, 6], [7, 8], [9]], drafts, k * drafts, accepted, [accepted],
            by_group={
                group_label(on, "4+"): GenerationResult([[7, 8]], 1, k, long),
                group_label(on, "0-4"): GenerationResult([[5, 6]], 2, 2 * k, short),
                group_label(off, "0-4"): GenerationResult([[9]], 1, k, 0),
            },
        )  # fmt: skip
        report.add_run(k, zeroed, plain, spec, log=lambda _: None)
    meta = report.as_metadata()
    assert meta["prompts_by_mode"] == {on: 2, off: 1}
    assert meta["mean_acceptance_length_by_mode"] == {on: {"k3": 2.3333, "k7": 3.0}, off: {"k3": 1.0, "k7": 1.0}}
    # 0-4: on's 2 drafts and off's 1 (3 and 0 accepted at k=3); 4+: on's 1 draft alone. Bins in edge order.
    assert meta["mean_acceptance_length_by_context_bin"] == {
        "0-4": {"k3": 2.0, "k7": 2.3333}, "4+": {"k3": 2.0, "k7": 3.0}
    }  # fmt: skip
    assert (meta["prompts_by_context_bin"], meta["context_bins_too_small"]) == ({"0-4": 2, "4+": 1}, ["4+"])
    assert (meta["mean_acceptance_length_k3"], meta["mean_acceptance_length_k7"]) == (2.0, 2.5)
    assert report.outputs_match
