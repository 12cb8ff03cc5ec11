import pytest

from eagle3_assets.chat import ChatTemplateError, render_with_loss_mask, require_chat_template
from eagle3_assets.demo.tokenizer import train_tokenizer

CORPUS = ["hello there, how are you? fine thanks. the answer is 42 plums", "think about it: red cats eat plums"] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, 300)


CONVERSATION = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "reasoning_content": "red cats", "content": "fine thanks"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "reasoning_content": "think about it", "content": "the answer is 42"},
]


def test_loss_mask_is_one_exactly_on_assistant_tokens_of_a_two_turn_conversation(tok):
    pieces = [  # (text, is assistant) in rendering order
        ("<|begin|><|user|>hello there<|end|><|assistant|>", 0),
        ("<think>red cats</think>fine thanks<|end|>", 1),
        ("<|user|>how are you?<|end|><|assistant|>", 0),
        ("<think>think about it</think>the answer is 42<|end|>", 1),
    ]
    want_ids, want_mask = [], []
    for text, label in pieces:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        want_ids += ids
        want_mask += [label] * len(ids)
    row = render_with_loss_mask(tok, CONVERSATION)
    assert row.input_ids == want_ids
    assert row.loss_mask == want_mask
    # the assistant part starts with <think> and each turn's mask ends on <|end|>
    end, think = tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<think>")
    first = row.loss_mask.index(1)
    assert row.input_ids[first] == think and row.input_ids[first - 1] == tok.convert_tokens_to_ids("<|assistant|>")
    ends = [i for i, t in enumerate(row.input_ids) if t == end]
    assert [row.loss_mask[i] for i in ends] == [0, 1, 0, 1]


def test_tokenizer_without_chat_template_is_named(tok):
    bare = train_tokenizer(CORPUS, 300)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="/models/x: the tokenizer has no chat template"):
        require_chat_template(bare, "/models/x")


def test_template_that_rewrites_earlier_turns_is_reported(tok):
    # Like templates that drop the reasoning of earlier turns: the prefix no longer extends.
    tok2 = train_tokenizer(CORPUS, 300)
    tok2.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
        "{% elif loop.last %}<|assistant|><think>{{ m['reasoning_content'] }}</think>{{ m['content'] }}<|end|>"
        "{% else %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="not prefix-consistent at message 1"):
        render_with_loss_mask(tok2, CONVERSATION)
