import pytest

from eagle3_assets.prompts import PromptsError, dump_prompts, parse_prompts


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
        ('{"prompt": "ok"}\n{"prompt": "fine"\n', r"p\.jsonl:2: malformed JSON \(Expecting ',' delimiter at column 18\)"),
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
