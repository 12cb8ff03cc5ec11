"""Kimi-K2's tokenizer shape, built locally: a 163,840-id tiktoken BPE shipped as remote code (issue 51, item 3).

Kimi's tokenizer is not a `tokenizer.json`: it is `tokenization_kimi.py` (a slow `PreTrainedTokenizer` over
`tiktoken`) plus its rank file `tiktoken.model`, named by `auto_map` in `tokenizer_config.json`, so it only loads
under `trust_remote_code`. `build_kimi_tokenizer(out_dir)` writes those three files into a model directory:

- the base vocabulary: the 256 bytes, then merges learnt on the demo world's text (`demo/world.py`, the corpus
  the demo's own tokenizer is trained on), then deterministic filler up to 163,584 ids. A filler token is two
  CJK ideographs (6 bytes): Kimi's vocabulary is mostly such text, and no filler can be merged from the world's
  ASCII, so the learnt tokens are what the world's text encodes to;
- the 256 ids above it (163,584..163,839) special, Kimi-K2's named ones at Kimi-K2's ids (`SPECIAL_TOKENS`), the
  rest `<|reserved_token_{id}|>`;
- Kimi-K2-Thinking's chat format (`CHAT_TEMPLATE`): `<|im_{role}|>{name}<|im_middle|>{content}<|im_end|>`, a
  default system turn, and the generation prompt opening the think block; `thinking=false` closes it empty.

Same bytes every build: the trainer is deterministic on one corpus, and the files are written in a fixed order.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eagle3_assets.demo.tokenization_kimi import NUM_RESERVED, byte_chars

VOCAB_SIZE = 163_840
NUM_BASE = VOCAB_SIZE - NUM_RESERVED  # 163,584: the first special id
REMOTE_CODE = "tokenization_kimi.py"
RANK_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (REMOTE_CODE, RANK_FILE, CONFIG_FILE)
TOKENIZER_CLASS = "TikTokenTokenizer"

# Kimi-K2's named special tokens, at its ids.
SPECIAL_TOKENS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
TOKEN_IDS: dict[str, int] = {t: i for i, t in SPECIAL_TOKENS.items()}
END_OF_TURN = "<|im_end|>"  # what the chat model stops on
# Not special: decode(skip_special_tokens=True) keeps them, so reasoning can be told from the answer.
NOT_SPECIAL = ("<think>", "</think>")
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# History turns lose their reasoning (an empty think block), turns after the last user message keep it.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set name = m.get('name') or m['role'] -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>{{ name }}<|im_middle|>{{ text(m['content']) }}"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>"
    "{%- set reasoning = m.get('reasoning_content') or m.get('reasoning') or '' -%}"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ reasoning }}</think>{%- else -%}<think></think>{%- endif -%}"
    "{{ text(m['content']) }}"
    "{%- elif m['role'] in ('system', 'tool') -%}<|im_system|>{{ name }}<|im_middle|>{{ text(m['content']) }}"
    "{%- else -%}{{ raise_exception('the Kimi chat template knows no role ' + m['role']) }}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

MERGE_BUDGET = 8192  # more than the world's text yields at min_frequency 2: every merge it supports is learnt
CJK_FIRST, CJK_COUNT = 0x4E00, 20992  # the CJK Unified Ideographs block, U+4E00..U+9FFF


def render_prompt(prompt: str) -> str:
    """A one-turn prompt with the generation prompt, as CHAT_TEMPLATE renders it (default system turn, thinking on)."""
    return (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>"
        f"<|im_user|>user<|im_middle|>{prompt}<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )


def learnt_tokens(seed: int = 0) -> list[bytes]:
    """The 256 bytes (rank = byte value), then the merges a byte-level BPE learns on the demo world's text, in the
    order it learns them."""
    from eagle3_assets.demo.target import tokenizer_corpus  # here: it imports torch, which a build never uses
    from eagle3_assets.demo.world import demo_world

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + MERGE_BUDGET,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(demo_world(seed), seed), trainer)
    to_byte = {c: b for b, c in enumerate(byte_chars())}
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merged = [bytes(to_byte[c] for c in text) for text, _ in by_id if len(text) > 1]
    return [bytes([b]) for b in range(256)] + merged


def filler_token(k: int) -> bytes:
    """The k-th filler token: two CJK ideographs, distinct for every k < 8 * 20,992."""
    first, second = divmod(k, CJK_COUNT)
    return (chr(CJK_FIRST + first) + chr(CJK_FIRST + second)).encode("utf-8")


def base_vocabulary(seed: int = 0) -> list[bytes]:
    """The 163,584 base tokens by rank: learnt, then filler."""
    learnt = learnt_tokens(seed)
    tokens = learnt + [filler_token(k) for k in range(NUM_BASE - len(learnt))]
    if len(set(tokens)) != NUM_BASE:
        raise ValueError("the Kimi vocabulary holds a token twice (a filler token equals a learnt one)")
    clash = sorted({t.encode() for t in SPECIAL_TOKENS.values()} & set(tokens))
    if clash:
        raise ValueError(f"base tokens {clash} equal special tokens; they would decode ambiguously")
    return tokens


def rank_file(tokens: list[bytes]) -> bytes:
    return b"".join(base64.b64encode(t) + b" " + str(rank).encode() + b"\n" for rank, t in enumerate(tokens))


def tokenizer_config() -> dict[str, Any]:
    """`tokenizer_config.json`: the remote class by `auto_map`, every special id, the chat template."""
    names = {i: SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_BASE, VOCAB_SIZE)}
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": t not in NOT_SPECIAL}
            for i, t in names.items()
        },  # fmt: skip
        "auto_map": {"AutoTokenizer": [f"{REMOTE_CODE.removesuffix('.py')}.{TOKENIZER_CLASS}", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": TOKENIZER_CLASS,
    }


def build_kimi_tokenizer(out_dir: str | Path, *, seed: int = 0) -> list[Path]:
    """Write Kimi's tokenizer files (`TOKENIZER_FILES`) into the model directory `out_dir`; the paths written.

    Each file is written under a temporary name and renamed into place: a crash leaves no half-written file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bodies = {
        REMOTE_CODE: (Path(__file__).parent / REMOTE_CODE).read_bytes(),
        RANK_FILE: rank_file(base_vocabulary(seed)),
        CONFIG_FILE: (json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n").encode(),
    }
    written = []
    for name, body in bodies.items():
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_bytes(body)
            os.replace(tmp, out / name)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(out / name)
    return written
