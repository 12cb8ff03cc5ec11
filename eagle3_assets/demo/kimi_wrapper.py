"""Kimi-K2.5's wrapper around a text model, engine-free (issue 51, item 1): its `config.json` and weight names.

Kimi-K2.5 is published as a vision-language model, `KimiK25ForConditionalGeneration`: the DeepSeek-V3 text model's
config sits under `text_config`, beside a `vision_config`, and its tensors under `language_model.` (the decoder
`language_model.model.…`, the head `language_model.lm_head.weight`), the vision tower and projector beside them.
`wrap_text_checkpoint` turns a plain causal-LM directory into that layout, so the pipeline's readers (the shape in
`target.TargetModel.read`, the drafter's embedding, norm and head in `drafter/target_head.load_target_weights`)
meet the published names. No vision weights are written: the `vision_config` is the smallest that describes a
tower, for readers that look at the config; nothing here loads one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MODEL_TYPE = "kimi_k25"
MEDIA_PLACEHOLDER = 163605  # `<|media_pad|>` in Kimi's vocabulary (`kimi_tokenizer.SPECIAL_TOKENS`)
PAD = 163839  # `[PAD]`
INDEX_FILE = "model.safetensors.index.json"


def kimi_k25_config(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapper's config.json as a dict, `text_config` held whole under its key."""
    text = dict(text_config)
    hidden = int(text["hidden_size"])
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": {
            "patch_size": 14,
            "merge_kernel_size": [2, 2],
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
            "mm_hidden_size": 32,
            "text_hidden_size": hidden,
        },
        "media_placeholder_token_id": MEDIA_PLACEHOLDER,
        "pad_token_id": PAD,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "dtype": text.get("dtype") or text.get("torch_dtype") or "bfloat16",
    }


def _write_atomic(path: Path, body: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(body)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_kimi_k25_config(out_dir: str | Path, text_config: Mapping[str, Any]) -> Path:
    """Write the wrapper's config.json around `text_config` into `out_dir`; its path."""
    path = Path(out_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, (json.dumps(kimi_k25_config(text_config), indent=2, sort_keys=True) + "\n").encode())
    return path


def wrapper_weight_name(name: str) -> str:
    """A causal LM's tensor name as the wrapper's checkpoint spells it (`model.norm.weight` ->
    `language_model.model.norm.weight`, `lm_head.weight` -> `language_model.lm_head.weight`)."""
    if not name.startswith(("model.", "lm_head.")):
        raise ValueError(f"{name}: not a causal-LM tensor name (expected model.… or lm_head.…)")
    return f"language_model.{name}"


def _weight_files(src: Path) -> list[str]:
    index = src / INDEX_FILE
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{src}: no model.safetensors or {INDEX_FILE}")


def wrap_text_checkpoint(src_dir: str | Path, out_dir: str | Path) -> Path:
    """The causal-LM directory `src_dir` as Kimi-K2.5 publishes it, in `out_dir`: the wrapper's config around
    `src_dir`'s config, every tensor renamed (`wrapper_weight_name`) in the same shards, an index naming them, and
    every other file (generation config, tokenizer, code) copied as it is. Returns `out_dir`."""
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for file in _weight_files(src):
        with safe_open(str(src / file), framework="pt") as f:
            tensors = {wrapper_weight_name(k): f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        tmp = out / f".{file}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, out / file)
        finally:
            tmp.unlink(missing_ok=True)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    _write_atomic(out / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    for path in sorted(src.iterdir()):
        weights = path.name in ("config.json", INDEX_FILE) or path.name.endswith(".safetensors")
        if path.is_file() and not weights:
            shutil.copy2(path, out / path.name)
    write_kimi_k25_config(out, json.loads((src / "config.json").read_text()))
    return out
