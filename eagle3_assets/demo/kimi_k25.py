"""Wrap a DeepSeek-V3 text model directory as Kimi-K2.5 ships it: `KimiK25ForConditionalGeneration`.

Kimi-K2.5 is a vision-language model whose text model is DeepSeek-V3's architecture: its config.json holds the
text model under `text_config` beside a `vision_config`, and its tensors are named `language_model.model.…` and
`language_model.lm_head.weight`. The pipeline's readers (the shape in `target.TargetModel.read`, the drafter's
embedding, norm and head in `drafter/target_head.load_target_weights`) then meet the published names.

vLLM serves it text-only when the vision modality's limit is 0 (`limit_mm_per_prompt={"vision_chunk": 0}` or
`language_model_only=True`): the vision tower and projector are then not built, so the wrapper carries a vision
config (vLLM reads its head count) but no vision weights.

A quantized text model (compressed-tensors, `quantize.py`) stays quantized: its `quantization_config` moves to the
wrapper's top level, where compressed-tensors and vLLM read it, and its module patterns (`re:.*self_attn.*`, …)
match under the new prefix as they did before.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MODEL_TYPE = "kimi_k25"
PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"
# The smallest vision tower transformers' `Kimi_K25VisionConfig` accepts; its defaults are the real 27-layer tower,
# which HF would build (randomly) on load. Never built in vLLM's text-only serving.
TINY_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
}
# The image processor's config (`preprocessor_config.json`). vLLM builds Kimi-K2.5's processing info when it starts,
# text-only too, and its processor reads these `media_proc_cfg` fields (the vision tower's patch 14, 2x2 merge and
# 4-frame chunks; the limits as transformers' Kimi-K2.5 image processor defaults them); without the file the server
# exits before it is ready. Text-only serving never processes an image with them.
PREPROCESSOR_FILE = "preprocessor_config.json"
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "media_proc_cfg": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "in_patch_limit": 16384,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None,
    },
}
# Kimi-K2.5's media token ids. vLLM's model reads `image_token_id`; its EAGLE-3 proposer reads a KimiK25 target's
# `media_placeholder_token_id` (the hub schema's name for the same `<|media_pad|>` id), so both are written.
MEDIA_TOKEN_IDS: dict[str, int] = {
    "image_token_id": 163605,
    "media_placeholder_token_id": 163605,
    "video_token_id": 163840,
    "vision_start_token_id": 163602,
    "vision_end_token_id": 163604,
}


def wrapped_name(name: str) -> str:
    """A DeepSeek-V3 tensor's name as the wrapper's checkpoint spells it (`model.norm.weight` ->
    `language_model.model.norm.weight`, `lm_head.weight` -> `language_model.lm_head.weight`)."""
    if not name.startswith(("model.", "lm_head.")):
        raise ValueError(f"{name}: not a causal-LM tensor name (expected model.… or lm_head.…)")
    return PREFIX + name


def wrapper_config(text_config: Mapping[str, Any]) -> dict[str, Any]:
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
        # explicit: Kimi_K25Config defaults to tied embeddings, DeepSeek-V3 does not tie them
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        **MEDIA_TOKEN_IDS,
    }
    dtype = text.get("dtype") or text.get("torch_dtype")
    if dtype:
        config["dtype"] = dtype
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in text:
            config[key] = text[key]
    if "quantization_config" in text_config:
        config["quantization_config"] = text_config["quantization_config"]
    return config


def _weight_files(src: Path) -> list[str]:
    """The shards the index names, else the single file: a stray *.safetensors beside them is no weight."""
    index = src / INDEX_FILE
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{src}: no model.safetensors or {INDEX_FILE}")


def _write_weights(src: Path, out: Path) -> None:
    """Every tensor renamed, in the same shards (metadata kept), and an index naming them."""
    weight_map: dict[str, str] = {}
    total = 0
    for file in _weight_files(src):
        with safe_open(str(src / file), framework="pt") as f:
            tensors = {wrapped_name(k): f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {"format": "pt"}
        save_file(tensors, str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_kimi_k25_wrapper(text_model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `text_model_dir` (a DeepSeek-V3 model directory, bf16 or compressed-tensors INT4, one file or shards)
    to `out_dir` as a Kimi-K2.5 checkpoint; every other file (tokenizer, templates, remote code) is copied.
    `out_dir` appears complete or not at all. Returns `out_dir`."""
    src, out = Path(text_model_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out}: the wrapper's directory exists already")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{src}: no config.json, not a Hugging Face model directory")
    config = wrapper_config(json.loads(config_path.read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for path in sorted(src.iterdir()):
            if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_FILE):
                shutil.copy2(path, staging / path.name)
        _write_weights(src, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if not (staging / PREPROCESSOR_FILE).exists():
            (staging / PREPROCESSOR_FILE).write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it owner-only; a model directory is shared
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
