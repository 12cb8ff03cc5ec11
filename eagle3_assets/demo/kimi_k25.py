"""Wrap a DeepSeek-V3 text model directory as Kimi-K2.5 ships it: `KimiK25ForConditionalGeneration`.

Kimi-K2.5 is a vision-language model whose text model is DeepSeek-V3's architecture: its
config.json holds the text model under `text_config` and its weights are named
`language_model.model.…` and `language_model.lm_head.weight`. vLLM serves it text-only when the
vision modality's limit is 0 (`limit_mm_per_prompt={"vision_chunk": 0}` or
`language_model_only=True`): the vision tower and projector are then not built, so the wrapper
carries a vision config (vLLM reads its head count) but no vision weights.

A quantized text model (compressed-tensors, `quantize.py`) stays quantized: its
`quantization_config` moves to the wrapper's top level, where compressed-tensors and vLLM read it,
and its module patterns (`re:.*self_attn.*`, …) match under the new prefix as they did before.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MODEL_TYPE = "kimi_k25"
# (text model's prefix, wrapper's prefix), as the published checkpoint names its tensors.
RENAMES: tuple[tuple[str, str], ...] = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
# The smallest vision tower the config classes accept; never built in text-only serving.
TINY_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
}
# Kimi-K2.5's media token ids; the vision path (unused here) reads them from the config.
MEDIA_TOKEN_IDS: dict[str, int] = {
    "image_token_id": 163605,
    "video_token_id": 163840,
    "vision_start_token_id": 163602,
    "vision_end_token_id": 163604,
}
INDEX = "model.safetensors.index.json"


def wrapped_name(name: str) -> str:
    """The published Kimi-K2.5 name of a DeepSeek-V3 checkpoint tensor."""
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"{name}: not a DeepSeek-V3 text model tensor (expected a name under 'model.' or 'lm_head.')")


def wrapper_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's config.json for the text model's config.json."""
    if text_config.get("model_type") != "deepseek_v3":
        raise ValueError(
            f"text model's model_type is {text_config.get('model_type')!r}: Kimi-K2.5 wraps 'deepseek_v3'"
        )
    text = {k: v for k, v in text_config.items() if k not in ("quantization_config", "transformers_version")}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": TINY_VISION_CONFIG,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        **MEDIA_TOKEN_IDS,
    }
    for key in ("dtype", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in text:
            config[key] = text[key]
    if "quantization_config" in text_config:
        config["quantization_config"] = text_config["quantization_config"]
    return config


def _write_weights(text_model_dir: Path, out_dir: Path) -> None:
    shards = sorted(text_model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{text_model_dir}: no *.safetensors weights")
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            tensors = {wrapped_name(name): f.get_tensor(name) for name in f.keys()}
        save_file(tensors, out_dir / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_kimi_k25_wrapper(text_model_dir: Path, out_dir: Path) -> None:
    """Write `text_model_dir` (a DeepSeek-V3 model directory, bf16 or compressed-tensors INT4) to `out_dir`
    as a Kimi-K2.5 checkpoint; every other file (tokenizer, templates, remote code) is copied.
    `out_dir` appears complete or not at all."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: the wrapper's directory exists already")
    config_path = text_model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{text_model_dir}: no config.json, not a Hugging Face model directory")
    config = wrapper_config(json.loads(config_path.read_text()))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for path in text_model_dir.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX):
                shutil.copy2(path, staging / path.name)
        _write_weights(text_model_dir, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it owner-only; a model directory is shared
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
