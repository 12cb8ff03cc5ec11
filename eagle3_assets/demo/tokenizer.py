"""The demo target's tokenizer: a byte-level BPE trained locally, with a reasoning chat template.

Fixed ids for the control tokens (0..6), then the learned BPE vocabulary. `<think>`
and `</think>` are single tokens, as vLLM's `deepseek_r1` reasoning parser requires,
and are NOT special, so `decode(skip_special_tokens=True)` keeps them and reasoning
can be split from the answer. There is no post-processor template: the chat template
writes `<|begin|>` itself, so encoding never adds a second BOS.

One rendered conversation (the model generates everything after `<|assistant|>`):
    <|begin|><|user|>What does Mirenor eat?<|end|><|assistant|><think>white Ilmar fish cat hammer 33</think>It eats fish.<|end|>
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD = "<|pad|>"
BOS = "<|begin|>"
END = "<|end|>"  # end of every turn, and the eos the target stops on
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Order fixes the ids: PAD=0, BOS=1, END=2, USER=3, ASSISTANT=4, THINK_OPEN=5, THINK_CLOSE=6.
CONTROL_TOKENS: tuple[str, ...] = (PAD, BOS, END, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE)
TOKEN_IDS: dict[str, int] = {t: i for i, t in enumerate(CONTROL_TOKENS)}
NOT_SPECIAL: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE)

# Reasoning goes in `reasoning_content` (our responses/ contract); `reasoning` is what
# vLLM's chat API returns, accepted too so a conversation can be fed back as-is.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% set reasoning = message.get('reasoning_content') or message.get('reasoning') or '' %}"
    "{{ '<|assistant|><think>' + reasoning + '</think>' + (message['content'] or '') + '<|end|>' }}"
    "{% else %}"
    "{{ raise_exception('the demo chat template knows only user and assistant messages, got role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def render_turn(prompt: str, reasoning: str, content: str) -> str:
    """One user/assistant exchange exactly as CHAT_TEMPLATE renders it (a test holds them equal)."""
    return f"{BOS}{USER}{prompt}{END}{ASSISTANT}{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}{END}"


def render_prompt(prompt: str) -> str:
    """A one-turn prompt with the generation prompt, as CHAT_TEMPLATE renders it."""
    return f"{BOS}{USER}{prompt}{END}{ASSISTANT}"


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab_size` ids trained on `texts` (plain text, no control tokens).

    Merges seen fewer than `min_frequency` times are not learned (so a word that occurs
    once in `texts` stays in pieces); ids the merges leave free are filled with
    `<|reserved_k|>` special tokens, as Llama 3 does, so the vocabulary size is exact.
    """
    if vocab_size < len(CONTROL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size: {vocab_size} cannot hold the {len(CONTROL_TOKENS)} control tokens "
            f"and the 256 byte tokens of a byte-level BPE (need at least {len(CONTROL_TOKENS) + 256})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Keeps offsets exact (no trimming) so fact spans map onto tokens; adds no BOS.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=min_frequency,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    free = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<|reserved_{k}|>", special=True, normalized=False) for k in range(free)])
    # Trained as special so they get ids 5 and 6; re-added as plain added tokens, and
    # round-tripped through JSON so decode's skip set is rebuilt without them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    tok = Tokenizer.from_str(tok.to_str())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    check_tokenizer(hf)
    if len(hf) != vocab_size:
        raise ValueError(f"tokenizer: built {len(hf)} ids, expected vocab_size {vocab_size}")
    return hf


def check_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    """Raise ValueError naming the token when a control token is missing, split, or has the wrong id."""
    for text, want in TOKEN_IDS.items():
        ids = tok.encode(text, add_special_tokens=False)
        if ids != [want]:
            raise ValueError(f"tokenizer: {text!r} must be the single token {want}, encodes as {ids}")
    for attr, text in (("bos_token", BOS), ("eos_token", END), ("pad_token", PAD)):
        if getattr(tok, attr) != text:
            raise ValueError(f"tokenizer: {attr} must be {text!r}, is {getattr(tok, attr)!r}")
    kept = tok.decode([TOKEN_IDS[THINK_OPEN], TOKEN_IDS[THINK_CLOSE]], skip_special_tokens=True)
    if kept != THINK_OPEN + THINK_CLOSE:
        raise ValueError(f"tokenizer: <think>/</think> must survive skip_special_tokens, decoded to {kept!r}")
