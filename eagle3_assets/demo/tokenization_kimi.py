"""A tiktoken BPE tokenizer laid out as Kimi-K2's, shipped inside a model directory as remote code.

`kimi_tokenizer.build_kimi_tokenizer` copies this file next to the model, where transformers runs it under
`trust_remote_code` (the package imports it only for `byte_chars` and `NUM_RESERVED`). It depends on nothing but
`tiktoken`, `tokenizers` and `transformers`, as code a model ships must.

Ids: `tiktoken.model` holds the base tokens (`base64(bytes) rank` per line, ranks 0..n-1); the 256 ids after
them are special, named by `added_tokens_decoder` in `tokenizer_config.json` (`<|reserved_token_{id}|>` where it
names none). Text between special tokens is split with Kimi's pre-tokenizer pattern and merged by tiktoken.
Decoding joins the tokens' bytes and reads them as UTF-8 once, so a character split across tokens comes back
whole.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import tiktoken
from tokenizers import AddedToken
from transformers import PreTrainedTokenizer

NUM_RESERVED = 256
# Kimi-K2's pre-tokenizer: Han runs apart, cased words with English contractions, numbers of up to 3 digits.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def byte_chars() -> list[str]:
    """The printable character byte-level BPE writes for each byte (GPT-2's table): token strings stay readable."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line[:80]!r}")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict[int, AddedToken] | None = None,
        **kwargs,
    ):
        self.vocab_file = vocab_file
        self._ranks = read_ranks(vocab_file)
        self._num_base = len(self._ranks)
        named = dict(added_tokens_decoder or {})
        added = {
            i: named.get(i) or AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False)
            for i in range(self._num_base, self._num_base + NUM_RESERVED)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=PAT_STR,
            mergeable_ranks=self._ranks,
            special_tokens={str(t): i for i, t in added.items()},
        )
        self._chars = byte_chars()
        self._char_bytes = {c: b for b, c in enumerate(self._chars)}
        self._vocab: dict[str, int] | None = None
        kwargs.setdefault("special_tokens_pattern", "none")  # the chat template writes every control token
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self._num_base + NUM_RESERVED

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._convert_id_to_token(i): i for i in range(self.vocab_size)}
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self._convert_id_to_token(i) for i in self.model.encode_ordinary(text)]

    def _token_bytes(self, token: str) -> bytes:
        if token in self._added_tokens_encoder:
            return token.encode("utf-8")
        return bytes(self._char_bytes[c] for c in token)

    def _convert_token_to_id(self, token: str) -> int:
        try:
            return self._ranks[self._token_bytes(token)]
        except KeyError:
            return self.unk_token_id

    def _convert_id_to_token(self, index: int) -> str:
        if index >= self._num_base:
            return str(self._added_tokens_decoder[index])
        return "".join(self._chars[b] for b in self.model.decode_single_token_bytes(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return b"".join(self._token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            # Only tokens marked special are skipped: <think> and </think> are not, so reasoning stays readable.
            ids = [i for i in ids if not (i in self._added_tokens_decoder and self._added_tokens_decoder[i].special)]
        return self.model.decode_bytes(ids).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        dest = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tiktoken.model"
        if Path(self.vocab_file).resolve() != dest.resolve():
            shutil.copyfile(self.vocab_file, dest)
        return (str(dest),)
