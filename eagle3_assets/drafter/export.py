"""Write the servable drafter: `drafter/export/config.json` + `model.safetensors` (docs/DESIGN.md §5).

`expected_export_tensors` is the one place that says which tensors an export holds and
their shapes. vLLM leaves a missing weight uninitialised without a word, so the
exporter checks the state dict against that list before anything is written and fails
naming every missing, extra or misshaped tensor. The directory is assembled locally
and published with one rename.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.drafter.checkpoint import non_finite
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.model import MLA_FIELDS, DrafterConfig, Eagle3Drafter
from eagle3_assets.processes import pid_prefix
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel

EXPORT_DIR = "drafter/export"
# The lease of the trainer that writes a family's export (`drafter/__main__.py`), in the family's directory: the owner
# that settles the export; other readers wait for it (`leases.settled`).
TRAINER_LEASE_DIR = "drafter"
EXPORT_STAGING = "drafter-export-"  # the local directory an export is assembled in (`processes.pid_prefix`)
# What the export was trained on (`continuation.py`), published with it and copied into the release.
TRAINED_ON_FILE = "trained_on.json"
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """The export dtype `dtype` is written as: itself when an export can hold it, else bfloat16."""
    return next((name for name, d in _DTYPES.items() if d == dtype), "bfloat16")


class ExportError(TrainingError, ValueError):
    """The drafter's tensors do not match what engines load; the message names each one."""


def expected_export_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in `model.safetensors`, under the names vLLM and SGLang load.

    vLLM renames `midlayer.` to `layers.0.` and stacks q/k/v and gate/up itself; SGLang
    reads `midlayer.` as is. The embedding is left out: both engines share the target's.
    `d2t` is left out when the draft vocab is the whole target vocab: vLLM then has no
    draft-to-target table to load it into and would reject the name.
    """
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_aux_layers * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        **{f"midlayer.self_attn.{n}.weight": s for n, s in attention_tensors(cfg).items()},
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.norm_before_fc and cfg.mla:
        shapes |= {f"fc_norm.{a}.weight": (h,) for a in range(cfg.num_aux_layers)}  # one per aux layer
    elif cfg.norm_before_fc:
        shapes["input_norm.weight"] = (cfg.num_aux_layers * h,)  # vLLM's name for the norm over the fused features
    if cfg.draft_vocab_size == cfg.vocab_size:
        del shapes["d2t"]
    return shapes


def attention_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The attention's weights (under `midlayer.self_attn.`, without `.weight`) and shapes: q/k/v/o, or MLA's."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if not cfg.mla:
        q, kv = nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {"q_proj": (q, 2 * h), "k_proj": (kv, 2 * h), "v_proj": (kv, 2 * h), "o_proj": (h, q)}
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    query = (
        {"q_a_proj": (cfg.q_lora_rank, 2 * h), "q_a_layernorm": (cfg.q_lora_rank,), "q_b_proj": (nh * qk, cfg.q_lora_rank)}
        if cfg.q_lora_rank
        else {"q_proj": (nh * qk, 2 * h)}
    )
    return query | {
        "kv_a_proj_with_mqa": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, 2 * h),
        "kv_a_layernorm": (cfg.kv_lora_rank,),
        "kv_b_proj": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "o_proj": (h, nh * cfg.v_head_dim),
    }


def export_problems(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> list[str]:
    """Everything that would make an engine misload the export; empty when it is right."""
    return tensor_problems(tensors, expected_export_tensors(cfg))


def tensor_problems(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Each tensor missing from, unexpected in or misshaped against `expected` (name -> shape), then the vocab
    map's consistency; empty when the export is right."""
    problems = [f"missing tensor {n} {list(s)}" for n, s in expected.items() if n not in tensors]
    problems += [f"unexpected tensor {n} {list(tensors[n].shape)}" for n in sorted(tensors) if n not in expected]
    problems += [
        f"tensor {n} is {list(tensors[n].shape)}, expected {list(s)}"
        for n, s in expected.items()
        if n in tensors and tuple(tensors[n].shape) != s
    ]
    return problems or vocab_map_tensor_problems(tensors)


def vocab_map_tensor_problems(tensors: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with an export's `t2d` (and `d2t`, present when the draft vocab is reduced)."""
    problems: list[str] = []
    t2d = tensors["t2d"]
    if t2d.dtype != torch.bool:
        problems.append(f"t2d is {t2d.dtype}, expected torch.bool")
    elif "d2t" in tensors:
        d2t = tensors["d2t"]
        if d2t.dtype != torch.int64:
            problems.append(f"d2t is {d2t.dtype}, expected torch.int64")
        elif not torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(len(d2t))):
            problems.append("d2t and t2d disagree: nonzero(t2d) != d2t + arange(draft_vocab_size)")
    elif not bool(t2d.all()):
        problems.append("draft vocab is the full vocab but t2d is not all True")
    return problems


def rope_scaling(rope: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` in the older `rope_scaling` shape: the scaling fields and their type, no theta."""
    return {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": rope["rope_type"]}


def rotary_config(rope: dict[str, Any]) -> dict[str, Any]:
    """The target's rotary embedding, scaling included, as a drafter's config.json declares it: transformers 5 and
    vLLM read `rope_parameters`; older readers `rope_theta` and `rope_scaling`."""
    scaled = rope.get("rope_type", "default") != "default"
    return {"rope_theta": rope["rope_theta"], "rope_parameters": dict(rope)} | (
        {"rope_scaling": rope_scaling(rope)} if scaled else {}
    )


def checked_aux_ids(aux_layer_ids: list[int], count: int) -> list[int]:
    """The aux layer ids an export declares: `count` distinct "input of layer i" ids >= 1, or ExportError."""
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != count or len(set(ids)) != len(ids) or min(ids) < 1:
        raise ExportError(f"aux_layer_ids {ids}: need {count} distinct 'input of layer i' ids >= 1")
    return ids


def export_config(
    cfg: DrafterConfig, *, aux_layer_ids: list[int], dtype: str, max_position_embeddings: int | None = None
) -> dict[str, Any]:
    """config.json: a one-layer Llama (or, with MLA, DeepSeek-V2) marked as an EAGLE-3 drafter, with the aux layers
    for both engines."""
    ids = checked_aux_ids(aux_layer_ids, cfg.num_aux_layers)
    return {
        **(mla_export_fields(cfg) if cfg.mla else {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}),
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rotary_config(cfg.rope),  # what the drafter was trained with
        # At least the target's context: a shorter one gave very low acceptance in SpecForge.
        "max_position_embeddings": int(max_position_embeddings or cfg.max_position_embeddings),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # The trained layer's norm placements, written out because vLLM's defaults for them
        # differ between checkpoint formats (model.py says what each one is).
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "norm_output": cfg.norm_output,
        # vLLM 0.32 reads the top-level ids ("input of layer i", as extracted) first;
        # SGLang reads eagle_config's and adds 1. Both then feed the trained layers.
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def mla_export_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """What vLLM's `Eagle3DeepseekV2ForCausalLM` reads besides a Llama drafter's fields. `deepseek_v2`, not v3:
    vLLM turns a `deepseek_v3` draft into DeepSeek's own MTP module."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **{name: getattr(cfg, name) or None for name in MLA_FIELDS},  # q_lora_rank None: no query latent
        "fc_norm": cfg.norm_before_fc,
        "target_hidden_size": cfg.hidden_size,
    }


def export_drafter(
    store: ArtifactStore,
    tensors: dict[str, torch.Tensor],
    cfg: DrafterConfig,
    *,
    aux_layer_ids: list[int],
    dtype: str = "bfloat16",
    max_position_embeddings: int | None = None,
    rel: str = EXPORT_DIR,
    trained_on: dict[str, Any] | None = None,
) -> str:
    """Check `tensors` (e.g. `model.trainable_state_dict()`), then publish `rel`/ atomically, with `trained_on.json`
    when given; returns its URL."""
    if dtype not in _DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    tensors = checked_tensors(store, rel, tensors, expected_export_tensors(cfg), full_vocab=full_vocab)
    config = export_config(cfg, aux_layer_ids=aux_layer_ids, dtype=dtype, max_position_embeddings=max_position_embeddings)
    return publish_export(store, rel, tensors, config, dtype, write_extra=trained_on_writer(trained_on))


def trained_on_writer(trained_on: dict[str, Any] | None) -> Callable[[Path], None] | None:
    """A `write_extra` that puts `trained_on.json` in the export directory (None: nothing to write)."""
    if trained_on is None:
        return None

    def write(directory: Path) -> None:
        (directory / TRAINED_ON_FILE).write_text(json.dumps(trained_on, indent=2) + "\n")

    return write


def checked_tensors(
    store: ArtifactStore, rel: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], *,
    full_vocab: bool,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """`tensors` as an engine loads them (no `d2t` when the draft vocab is the full vocab: vLLM then has no table to
    load it into), or ExportError naming every missing, extra, misshaped or non-finite tensor."""
    tensors = dict(tensors)
    if full_vocab and "d2t" in tensors:
        d2t = tensors.pop("d2t")
        if bool(d2t.any()):
            raise ExportError("draft vocab is the full vocab but d2t is not all zeros (not the identity map)")
    problems = tensor_problems(tensors, expected) + [f"tensor {n} holds non-finite values" for n in non_finite(tensors)]
    if problems:
        raise ExportError(f"drafter export to {store.url_of(rel)} refused:\n  " + "\n  ".join(problems))
    return tensors


def publish_export(
    store: ArtifactStore, rel: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], dtype: str,
    write_extra: Callable[[Path], None] | None = None,
) -> str:  # fmt: skip
    """Write `model.safetensors` (weights in `dtype`, the vocab map as is) and `config.json` (and what `write_extra`
    adds) to a local directory, then publish it as `rel`/ in one step (`ArtifactStore.put_dir`); returns its URL."""
    out = {
        n: t.detach().cpu().contiguous() if n in ("d2t", "t2d") else t.detach().to(_DTYPES[dtype]).cpu().contiguous()
        for n, t in tensors.items()
    }
    with tempfile.TemporaryDirectory(prefix=pid_prefix(EXPORT_STAGING)) as tmp:
        save_file(out, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if write_extra is not None:
            write_extra(Path(tmp))
        store.put_dir(tmp, rel)
    return store.url_of(rel)


def exported_config(config: dict[str, Any], where: str | Path) -> DrafterConfig:
    """The drafter an export's `config.json` describes (`export_config`'s inverse, its context as written)."""
    # config.json is an HF Llama config, the shape the drafter takes from its target.
    cfg = DrafterConfig.from_target(
        TargetModel.from_config(config, path=where), draft_vocab_size=config["draft_vocab_size"],
        **{flag: bool(config.get(flag, False)) for flag in NORM_FLAGS},
    )  # fmt: skip
    if cfg.mla:  # the MLA form says norm_before_fc as `fc_norm`
        cfg = replace(cfg, norm_before_fc=bool(config.get("fc_norm")))
    return cfg


def load_export(
    export_dir: str | Path, embed_tokens: torch.Tensor, cfg: DrafterConfig | None = None
) -> tuple[Eagle3Drafter, list[int]]:
    """(drafter with float32 weights, its aux layer ids) from an export, as an engine would see it, or in the drafter
    `cfg` describes (the one that trained: `served_replay`); `embed_tokens` is the target's embedding (any dtype),
    which exports leave out."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    cfg = cfg or exported_config(config, export_dir)
    tensors = load_file(str(export_dir / "model.safetensors"))
    problems = export_problems(tensors, cfg)
    if problems:
        raise ExportError(f"{export_dir} is not a loadable drafter export:\n  " + "\n  ".join(problems))
    tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    model = Eagle3Drafter(cfg, tensors["d2t"], tensors["t2d"], embed_tokens=embed_tokens)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    model.load_state_dict(weights, strict=False)  # everything but the embedding, checked above
    return model.eval(), [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
