import pytest

from eagle3_assets.prompts import PromptsError, decode_prompts, dump_prompts, parse_prompts


def test_prompt_and_messages_forms():
    text = (
        '{"id": "a", "prompt": "hi", "kind": "fact"}\n'
        "\n"
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]}\n'
    )
    rows = parse_prompts(text, "p.jsonl")
    assert [r.id for r in rows] == ["a", "line-3"]
    assert rows[0].messages == [{"role": "user", "content": "hi"}]
    assert rows[0].extra == {"kind": "fact"}
    assert parse_prompts(dump_prompts(rows), "again") == rows


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": "fine"\n', r"p\.jsonl:2, column 18: malformed JSON \(Expecting ',' delimiter at line 2, column 18\); fix the line$"),
        ('{"prompt": "ok"}\n{"prompt": "fine\n', r"^p\.jsonl:2, column 12: malformed JSON \(Unterminated string starting at line 2, column 12\); fix the line$"),
        ('{"prompt": "ok"}\n{"id": "s", "prompt": "a \\ud800 b"}\n', r"p\.jsonl:2 \(id s\): '\\ud800' is half of a UTF-16 surrogate pair"),
        ('{"id": "x", "prompt": "   "}\n', r"p\.jsonl:1 \(id x\): empty prompt"),
        ('{"prompt": 3}\n', r"p\.jsonl:1 \(id line-1\): 'prompt' must be a string, got int"),
        ('{"id": 1, "text": "a"}\n', r"p\.jsonl:1 \(id 1\): needs a 'prompt' string or a 'messages' list"),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', r"p\.jsonl:2: duplicate id 'a' \(first on line 1\)"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n',
            r"p\.jsonl:1 \(id line-1\): the last message must be the user's, got 'assistant'",
        ),
        ("\n\n", r"p\.jsonl: no prompts"),
    ],
)
def test_bad_lines_are_named(text: str, message: str):
    with pytest.raises(PromptsError, match=message):
        parse_prompts(text, "p.jsonl")


def test_a_byte_that_is_not_utf8_is_located_by_line_and_column():
    data = '{"prompt": "ok"}\n{"prompt": "caf'.encode() + b"\xe9" + b'"}\n'
    with pytest.raises(PromptsError, match=r"^p\.jsonl:2, column 16: byte 0xe9 is not UTF-8 \(save the file as UTF-8\)$"):
        decode_prompts(data, "p.jsonl")
    assert decode_prompts("\ufeff{}".encode(), "p.jsonl") == "{}"


def test_fact_spans_are_checked_when_the_eval_prompts_are_parsed_naming_file_and_line():
    good = '{"id": "eval-06", "prompt": "hi", "reference": "<think>red</think>", "fact_spans": [[7, 10]]}\n'
    bad = '{"id": "eval-07", "prompt": "hi", "reference": "<think>red</think>", "fact_spans": [[7, 99]]}\n'
    with pytest.raises(PromptsError) as e:
        parse_prompts(good + bad, "eval.jsonl")
    assert str(e.value) == (
        "eval.jsonl:2 (id eval-07): fact_spans must be [[start, end], ...] character offsets with 0 <= start < end "
        "<= 18 (the reference's length), got [[7, 99]]"
    )
    with pytest.raises(PromptsError, match=r"^e:1 \(id x\): fact_spans are character offsets into 'reference'; give"):
        parse_prompts('{"id": "x", "prompt": "hi", "fact_spans": []}\n', "e")
    with pytest.raises(PromptsError, match=r"^e:1 \(id x\): fact_spans must be .* got \[\[True, 3\]\]"):
        parse_prompts('{"id": "x", "prompt": "hi", "reference": "abc", "fact_spans": [[true, 3]]}\n', "e")
    assert parse_prompts(good, "eval.jsonl")[0].extra["fact_spans"] == [[7, 10]]


def test_held_out_prompts_that_are_training_prompts_are_named_with_file_and_line():
    from eagle3_assets.prompts import heldout_overlap

    train = parse_prompts('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n', "train.jsonl")
    held = parse_prompts(
        '{"id": "a", "prompt": "other"}\n{"id": "c", "prompt": "two"}\n{"id": "d", "prompt": "new"}\n', "held.jsonl"
    )
    assert heldout_overlap(train, held) == ["a (held.jsonl:1)", "c (held.jsonl:2)"]  # the same id; the same messages
    assert heldout_overlap(train, held[2:]) == []
