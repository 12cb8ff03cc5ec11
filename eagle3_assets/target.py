"""The target model as the pipeline sees it: read once from its directory, then handed down.

`TargetModel.read` is the one reader of the target's `config.json`: every stage that
needs the target's shape (extraction backends, the vLLM server plan, the disk
projection, drafter training and its export) takes the `TargetModel` an asset read at
its start instead of reading the file again. The config is read as JSON, not through
`AutoConfig`, so a target whose config class lives in remote code (Kimi) is described
without running that code; `text_config` wrappers (vision-language targets) are unwrapped.

Aux layer ids use the "input of layer i" convention (docs/DESIGN.md §4): id i is HF's
`hidden_states[i]`, the output of decoder layer i-1; valid ids are 1..N-1.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.errors import Refusal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TargetModelError(Refusal, ValueError):
    """A target model that cannot be used as configured; the message names the path or setting."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """[2, N//2, N-3] (Kimi, 61 layers: [2, 30, 58])."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The configured ids (or the default), sorted and checked against a model of `num_layers` layers."""
    explicit = aux_layer_ids is not None
    ids = sorted(int(i) for i in (aux_layer_ids if explicit else default_aux_layer_ids(num_layers)))
    if len(set(ids)) != len(ids):
        what = "appear twice" if explicit else f"are the defaults for a {num_layers}-layer model and collide"
        raise TargetModelError(f"aux_layer_ids: {ids} {what}; set three distinct ids explicitly")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise TargetModelError(
            f"aux_layer_ids: layer id(s) {bad} outside the model, which has {num_layers} layers "
            f"(valid 'input of layer i' ids: 1..{num_layers - 1})"
        )
    return tuple(ids)


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary embedding as `{"rope_type", "rope_theta", <scaling fields>}`, whichever way the config says it
    (transformers 5 `rope_parameters`, older `rope_scaling` + `rope_theta`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    return {"rope_type": str(rope_type), "rope_theta": float(theta), **params}


@dataclass(frozen=True)
class TargetModel:
    path: Path
    architecture: str
    dtype: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings; 0 when the config does not say
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: dict[str, Any]
    tie_word_embeddings: bool
    aux_layer_ids: tuple[int, ...] = ()  # resolved and checked by `read`; () when only the shape was parsed
    trust_remote_code: bool = False
    quantization: str | None = None  # `quantization_config.quant_method` (Kimi-K2.5: compressed-tensors); None = none
    # A vision-language wrapper (Kimi-K2.5) around the text model: every engine serves it text-only, building no
    # vision tower (the pipeline sends token ids, never images).
    wrapped: bool = False
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the text model's config

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        path: str | Path,
        aux_layer_ids: tuple[int, ...] = (),
        trust_remote_code: bool = False,
    ) -> TargetModel:
        """The shape described by an HF config dict (a VLM's `text_config` is used)."""
        where = f"{path}/config.json"
        cfg = text_config(config, where)
        missing = [k for k in SHAPE_FIELDS if not cfg.get(k)]
        if missing:
            raise TargetModelError(f"{where} does not say {', '.join(missing)}")
        try:
            heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
            return cls(
                path=Path(path),
                architecture=str((config.get("architectures") or ["unknown"])[0]),
                dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "unknown"),
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                vocab_size=int(cfg["vocab_size"]),
                max_context=int(cfg.get("max_position_embeddings") or 0),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
                rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                rope=rope_parameters(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
                aux_layer_ids=aux_layer_ids,
                trust_remote_code=trust_remote_code,
                quantization=quant_method(config),
                wrapped=bool(config.get("text_config")),
                config=cfg,
            )
        except (TypeError, ValueError) as e:
            raise TargetModelError(f"{where}: unreadable shape ({e})") from None

    @classmethod
    def read(
        cls, path: str | Path, *, aux_layer_ids: Sequence[int] | None = None, trust_remote_code: bool = False
    ) -> TargetModel:
        """The target in local directory `path`, with its aux layer ids resolved (the default when None)."""
        path = Path(path)
        if not path.is_dir():
            raise TargetModelError(f"target model path {path} is not a readable directory")
        config = read_config(path)
        shape = cls.from_config(config, path=path, trust_remote_code=trust_remote_code)
        ids = resolve_aux_layer_ids(aux_layer_ids, shape.num_layers)
        return cls.from_config(config, path=path, aux_layer_ids=ids, trust_remote_code=trust_remote_code)

    @property
    def extraction_layer_ids(self) -> list[int]:
        """What vLLM extracts for us: the aux ids and N (the last layer's output, pre-norm), sorted."""
        return sorted({*self.aux_layer_ids, self.num_layers})

    def as_metadata(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("config")
        d["path"] = str(self.path)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")


def text_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The text model's config: a wrapper's `text_config` (Kimi-K2.5, vision-language models), else `config`.

    A wrapper (an `…ForConditionalGeneration` or a config with a `vision_config`) that says no shape of its own and
    has no `text_config` is refused naming it: its text model's shape is nowhere to be read."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise TargetModelError(
            f"{where}: `text_config` must be an object holding the text model's config, got {text!r:.80}"
        )
    if text:
        return dict(text)
    arch = str((config.get("architectures") or [""])[0])
    wrapper = arch.endswith("ForConditionalGeneration") or "vision_config" in config
    if wrapper and not any(config.get(k) for k in SHAPE_FIELDS):
        raise TargetModelError(
            f"{where}: {arch or config.get('model_type')} wraps a text model but has no `text_config`; the text "
            f"model's shape ({', '.join(SHAPE_FIELDS)}) is read from there"
        )
    return dict(config)


def quant_method(config: Mapping[str, Any]) -> str | None:
    """How the checkpoint's weights are quantized, from `quantization_config` (a wrapper's or its text model's)."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return str(quant.get("quant_method") or "unknown") if isinstance(quant, Mapping) else None


def read_config(path: str | Path) -> dict[str, Any]:
    """The target's config.json as a dict; TargetModelError naming the file when it cannot be read."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise TargetModelError(f"target model path {path} has no config.json") from None
    except (OSError, ValueError) as e:
        raise TargetModelError(f"{file} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise TargetModelError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def stop_token_ids(target: TargetModel) -> set[int]:
    """What ends a completion: `generation_config.json`'s eos ids (chat models list several), else config.json's."""
    eos = None
    file = target.path / "generation_config.json"
    if file.is_file():
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError) as e:
            raise TargetModelError(f"{file} cannot be read: {e}") from None
    if eos is None:
        eos = target.config.get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}


def load_hf_model(target: TargetModel, dtype: Any) -> Any:
    """The target in transformers (`dtype` as `from_pretrained` takes it). A vision-language wrapper (Kimi-K2.5) is no
    causal LM to transformers' auto classes: it loads as image-text-to-text, and given token ids alone runs its text
    model, whose hidden states, final norm (`get_decoder().norm`) and logits are the ones a causal LM's would be."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # here: the supervisor reads targets

    auto = AutoModelForImageTextToText if target.wrapped else AutoModelForCausalLM
    return auto.from_pretrained(str(target.path), dtype=dtype, trust_remote_code=target.trust_remote_code)


def load_tokenizer(target: TargetModel | str | Path, *, trust_remote_code: bool | None = None) -> PreTrainedTokenizerBase:
    """The target's tokenizer (fast or slow), with a chat template; errors name the path and the setting to change."""
    from transformers import AutoTokenizer  # here, not at import: the vLLM supervisor reads targets too

    path = target.path if isinstance(target, TargetModel) else Path(target)
    if trust_remote_code is None:
        trust_remote_code = target.trust_remote_code if isinstance(target, TargetModel) else False
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise TargetModelError(
                f"{path}: the tokenizer's code ships with the model; set `trust_remote_code: true` in the "
                "settings to run it (only for a model you trust)"
            ) from None
        raise TargetModelError(f"{path}: no usable tokenizer ({e})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise TargetModelError(
            f"{path}: the tokenizer has no chat template (tokenizer_config.json has no 'chat_template' "
            "and there is no chat_template.jinja); conversations cannot be rendered"
        )
    return tokenizer
