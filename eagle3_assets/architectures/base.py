"""What a target architecture is to this project, declared once per architecture (as vLLM registers a model).

An `Architecture` names the Hugging Face model class and `model_type` it covers, whether its layers route
tokens through experts, the dtype its miniature is saved and served in, and the `config.json` fields of that
miniature: the small, locally trained target the tests and `make demo` run the whole graph on. Torch-free:
the settings read it to refuse a target before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MiniatureShape:
    """The size a miniature is built at (the demo settings) and the ids its tokenizer fixed."""

    hidden_size: int
    num_layers: int
    head_dim: int
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    max_position_embeddings: int
    mlp_ratio: int  # a dense MLP's width over hidden_size

    def common_fields(self, *, rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False) -> dict[str, Any]:
        """The config fields every miniature has in the same words: size, vocabulary, special ids, float32 (trained
        so; `Architecture.served_dtype` says how it is saved)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": rms_norm_eps,
            "tie_word_embeddings": tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": "float32",
        }


@dataclass(frozen=True)
class Architecture:
    name: str  # `demo.architecture`, the matrix's leg, the make variable
    hf_architecture: str  # config.json `architectures[0]` of a checkpoint of this kind
    model_type: str
    moe: bool
    attention: str  # "gqa" (grouped-query, Llama's kind) or "mla" (DeepSeek's latent attention)
    # The dtype the miniature is saved in, so the engine's "auto" runs it so: vLLM's CPU MoE kernel takes bf16
    # (or int8/fp8/int4) weights and no float32 (docs/DESIGN.md §6).
    served_dtype: str
    miniature: Callable[[MiniatureShape], dict[str, Any]]  # config fields transformers' config class takes
    # Fields vLLM reads that transformers' config class drops on save (DeepSeek-V3's routing): written into
    # config.json after `save_pretrained`.
    config_extras: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    # A vision-language wrapper's text model (Kimi-K2.5's is DeepSeek-V3): the miniature is that model, trained as it
    # is, then written in the wrapper's layout (`demo/target.py`); `miniature` and `config_extras` are then unused.
    text_model: Architecture | None = None

    @property
    def text(self) -> Architecture:
        """The architecture of the model that computes: the wrapped text model's, or this one."""
        return self.text_model or self
