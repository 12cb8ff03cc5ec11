"""The target model: where it lives and what the pipeline needs to know about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from eagle3_assets.chat import require_chat_template


class TargetModelError(ValueError):
    """A target model directory that cannot be used; the message names the path and what is wrong."""


@dataclass(frozen=True)
class TargetInfo:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    architecture: str
    dtype: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise TargetModelError(f"{model_dir}: no usable tokenizer ({e})") from None
    require_chat_template(tokenizer, str(model_dir))
    return tokenizer


def inspect_target(model_dir: str | Path) -> TargetInfo:
    """Validate a local HF model directory: readable config, tokenizer with a chat template, known vocab."""
    path = Path(model_dir)
    if not path.is_dir():
        raise TargetModelError(f"target model path {path} is not a readable directory")
    if not (path / "config.json").is_file():
        raise TargetModelError(f"target model path {path} has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise TargetModelError(f"{path}/config.json cannot be read: {e}") from None
    text = config.get_text_config()
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not getattr(text, k, None)]
    if missing:
        raise TargetModelError(f"{path}/config.json does not say {', '.join(missing)}")
    load_tokenizer(path)
    return TargetInfo(
        path=str(path),
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_context=int(getattr(text, "max_position_embeddings", 0) or 0),
        architecture=(config.architectures or ["unknown"])[0],
        dtype=str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "unknown"),
    )
