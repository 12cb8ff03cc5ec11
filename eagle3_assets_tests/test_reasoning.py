"""Training rows on the chat templates of the families people train drafters for.

Each template below is small and written here, with one behaviour of a published family's
template: history reasoning dropped (Qwen3, GLM-4.6, MiniMax-M2), an empty think block for
history turns (Kimi-K2-Thinking), a generation prompt that opens the think block (DeepSeek-R1
distills, QwQ, Kimi), a newline after the end-of-turn token (Qwen, MiniMax), no stop token
rendered at all (GLM), gpt-oss's harmony channels. A row is the prompt as rendered for the
engine (mask 0) and the completion as generated (mask 1); the tests assert the exact mask,
the split of the reasoning, and that the coverage check agrees.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_assets.chat import generation_prompt_ids
from eagle3_assets.generation.base import Generated
from eagle3_assets.prompts import Prompt
from eagle3_assets.reasoning import detect_format, split_completion
from eagle3_assets.reasoning_coverage import reasoning_coverage
from eagle3_assets.responses import Renderer, response_record
from eagle3_assets.tokenized import ResponsesFormatError, tokenize_responses

CORPUS = ["What does the plum cat eat? It eats fish and plums.", "Think first, then answer. Two plus two is four."] * 20


def family_tokenizer(specials: list[str], template: str, eos: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE carrying a family's control tokens as single tokens, with its chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, chat_template=template)


CHATML = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3: history reasoning dropped; a newline after every end-of-turn.
QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Kimi-K2-Thinking: history turns get an empty think block; the generation prompt opens one.
KIMI = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)
# DeepSeek-R1 distills / QwQ: the generation prompt ends inside an open think block, then a newline.
R1 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# GLM: the template never writes the stop token the model generates (<|user|> ends a reply).
GLM_SPECIALS = ["<|user|>", "<|assistant|>", "<think>", "</think>", "<|endoftext|>"]
GLM = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
HARMONY = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def row(tok, messages: list[dict], completion: list[int], finish: str, max_seq_len: int = 4096):
    """The responses record of a generated completion, and its tokenized row (ids, mask)."""
    stop = {tok.convert_tokens_to_ids(tok.eos_token)}
    renderer = Renderer(tok, detect_format(tok), stop, max_seq_len)
    prompt_ids = generation_prompt_ids(tok, messages)
    record = response_record(0, Prompt("p", messages), prompt_ids, Generated(completion, finish), renderer)
    tset, _ = tokenize_responses([record], max_seq_len=max_seq_len, overlong="truncate", unfinished="keep")
    coverage = reasoning_coverage(tset, [record], tok, renderer.reasoning, stop, max_seq_len=max_seq_len)
    assert coverage.ok, coverage.problems
    ids, mask = tset.row(0)
    return record, ids.tolist(), mask.tolist(), coverage


HISTORY = [
    {"role": "user", "content": "What does the plum cat eat?"},
    {"role": "assistant", "content": "It eats fish."},  # a history turn the target never wrote here
    {"role": "user", "content": "Two plus two?"},
]


@pytest.mark.parametrize("template", [QWEN3, KIMI], ids=["history-reasoning-dropped", "empty-think-for-history"])
def test_history_turns_are_prompt_and_the_whole_generated_reply_is_trained(template):
    tok = family_tokenizer(CHATML, template, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    completion = [*ids_of(tok, "<think>Two and two.</think>It is four."), end]
    record, ids, mask, coverage = row(tok, HISTORY, completion, "stop")
    prompt = generation_prompt_ids(tok, HISTORY)
    assert ids == prompt + completion
    assert mask == [0] * len(prompt) + [1] * len(completion)  # history reply, headers: 0; reasoning..end: 1
    assert tok.decode(prompt).count("It eats fish.") == 1  # the history reply is in the prompt, not trained
    close = completion.index(tok.convert_tokens_to_ids("</think>"))
    assert record["usage"]["reasoning_tokens"] == close + 1 == coverage.reasoning_tokens
    assert record["messages"][-1] == {"role": "assistant", "content": "It is four.", "reasoning_content": "Two and two."}


def test_the_newline_after_the_end_of_turn_is_never_trained():
    tok = family_tokenizer(CHATML, QWEN3, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    completion = [*ids_of(tok, "Four."), end]
    _, ids, mask, _ = row(tok, HISTORY[:1], completion, "stop")
    assert ids[-1] == end and mask[-1] == 1  # the row ends with the stop token the model generated
    assert tok.decode(ids).endswith("<|im_end|>") and not tok.decode(ids).endswith("\n")


def test_a_generation_prompt_that_opens_the_think_block():
    tok = family_tokenizer(CHATML, R1, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    completion = [*ids_of(tok, "Two and two is four.\n</think>\n\nFour."), end]
    record, ids, mask, _ = row(tok, HISTORY[:1], completion, "stop")
    assert tok.decode(generation_prompt_ids(tok, HISTORY[:1])).endswith("<think>\n")
    assert mask.count(1) == len(completion)
    assert record["messages"][-1]["reasoning_content"] == "Two and two is four.\n"
    assert record["messages"][-1]["content"] == "\n\nFour."
    # Cut by max_new_tokens inside the reasoning: all reasoning, no answer, and no end-of-turn added.
    cut = ids_of(tok, "Two and two is")
    record, ids, mask, coverage = row(tok, HISTORY[:1], cut, "length")
    assert ids[-len(cut):] == cut and mask.count(1) == len(cut) and end not in ids[-len(cut):]
    assert record["usage"]["reasoning_tokens"] == len(cut) == coverage.reasoning_tokens
    assert record["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "Two and two is"}


def test_the_stop_token_a_template_never_renders_is_trained():
    tok = family_tokenizer(GLM_SPECIALS, GLM, "<|user|>")
    stop = tok.convert_tokens_to_ids("<|user|>")
    completion = [*ids_of(tok, "<think>Sum.</think>Four."), stop]
    _, ids, mask, _ = row(tok, HISTORY[:1], completion, "stop")
    assert ids[-1] == stop and mask[-1] == 1


def test_reasoning_splits_on_whitespace_before_the_tag_truncation_and_no_reasoning():
    tok = family_tokenizer(CHATML, QWEN3, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = generation_prompt_ids(tok, HISTORY[:1])
    spaced = [*ids_of(tok, "\n\n<think>Fish.</think>Fish."), end]
    s = split_completion(tok, "think", prompt, spaced, {end})
    assert (s.reasoning, s.content) == ("Fish.", "Fish.")
    assert s.reasoning_tokens == spaced.index(tok.convert_tokens_to_ids("</think>")) + 1
    opened = ids_of(tok, "<think>Fish and")  # opened, then cut by the budget
    s = split_completion(tok, "think", prompt, opened, {end})
    assert (s.reasoning_tokens, s.reasoning, s.content) == (len(opened), "Fish and", "")
    plain = [*ids_of(tok, "It eats fish."), end]  # never opened: all answer
    s = split_completion(tok, "think", prompt, plain, {end})
    assert (s.reasoning_tokens, s.reasoning, s.content) == (0, "", "It eats fish.")


def test_a_missing_close_tag_is_read_as_vllms_deepseek_r1_parser_reads_it():
    """Whenever the think block was opened (by the prompt or the output), a completion without
    `</think>` is all reasoning, as vLLM's deepseek_r1 parser says."""
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

    tok = family_tokenizer(CHATML, R1, "<|im_end|>")
    parser = DeepSeekR1ReasoningParser(tok)
    prompt = generation_prompt_ids(tok, HISTORY[:1])
    for text in ("Two and two", "<think>Two and two", "Two and two</think>Four.", "<think>Two</think>Four."):
        ids = ids_of(tok, text)
        ours = split_completion(tok, "think", prompt, ids, set())
        reasoning, content = parser.extract_reasoning(tok.decode(ids), request=None)
        assert (ours.reasoning, ours.content or None) == (reasoning, content), text


def test_harmony_channels_split_into_analysis_and_final():
    tok = family_tokenizer(HARMONY_SPECIALS, HARMONY, "<|return|>")
    assert detect_format(tok) == "harmony"
    text = (
        "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Four.<|return|>"
    )
    completion = ids_of(tok, text)
    record, ids, mask, coverage = row(tok, HISTORY[:1], completion, "stop")
    final = [i for i, t in enumerate(completion) if t == tok.convert_tokens_to_ids("<|channel|>")][1]
    assert record["usage"]["reasoning_tokens"] == final == coverage.reasoning_tokens
    assert record["messages"][-1] == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    assert mask.count(1) == len(completion)
    cut = ids_of(tok, "<|channel|>analysis<|message|>Two and")  # no final channel yet
    record, *_ = row(tok, HISTORY[:1], cut, "length")
    assert record["usage"]["reasoning_tokens"] == len(cut) and record["messages"][-1]["content"] == ""


def test_a_row_over_max_seq_len_keeps_a_prefix_of_what_was_generated():
    tok = family_tokenizer(CHATML, KIMI, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    completion = [*ids_of(tok, "Two and two is four, so the answer is four.</think>Four."), end]
    prompt = generation_prompt_ids(tok, HISTORY[:1])
    _, ids, mask, coverage = row(tok, HISTORY[:1], completion, "stop", max_seq_len=len(prompt) + 5)
    assert ids == prompt + completion[:5] and mask == [0] * len(prompt) + [1] * 5
    assert coverage.reasoning_tokens == 5  # the kept prefix is all reasoning


def test_responses_of_the_text_only_format_are_refused_with_how_to_regenerate():
    old = {"id": "p7", "row": 3, "messages": [{"role": "user", "content": "hi"}], "finish_reason": "stop", "error": None}
    with pytest.raises(ResponsesFormatError) as e:
        tokenize_responses([old], max_seq_len=64, overlong="truncate", unfinished="keep")
    assert str(e.value).startswith(
        "responses row 3 (id p7) has no prompt_token_ids/completion_token_ids: it was generated by an earlier "
        "version of the pipeline, which kept text only. Re-materialize `responses`"
    )


def test_unfinished_responses_are_kept_as_generated_or_dropped_and_counted():
    tok = family_tokenizer(CHATML, QWEN3, "<|im_end|>")
    renderer = Renderer(tok, "think", {tok.convert_tokens_to_ids("<|im_end|>")}, 64)
    prompt = generation_prompt_ids(tok, HISTORY[:1])
    records = [
        response_record(i, Prompt(f"p{i}", HISTORY[:1]), prompt, Generated(ids_of(tok, "Fish"), finish), renderer)
        for i, finish in enumerate(["stop", "length", "length"])
    ]
    kept, summary = tokenize_responses(records, max_seq_len=64, overlong="truncate", unfinished="keep")
    assert (kept.num_rows, summary.rows_unfinished, summary.rows_dropped_unfinished) == (3, 2, 0)
    dropped, summary = tokenize_responses(records, max_seq_len=64, overlong="truncate", unfinished="drop")
    assert (dropped.num_rows, summary.rows_unfinished, summary.rows_dropped_unfinished) == (1, 2, 2)
    assert summary.unfinished_ids == ["p1", "p2"] and dropped.row_ids.tolist() == [0]
