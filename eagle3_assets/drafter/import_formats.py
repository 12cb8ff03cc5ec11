"""Read a published drafter from any store URL and know its format (`importing.py` converts and checks it).

Three formats, told apart by their `config.json`:
  - `eagle3`: the layout vLLM reads as is, as the EAGLE reference and SpecForge write it (and as our own export is):
    a one-layer Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, weights `midlayer.*` (or `layers.0.*`),
    `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, maybe `embed_tokens.weight`. Its options are read as
    vLLM reads them: a norm flag it does not state is off; aux layer ids from the top level, else `eagle_config`'s,
    else vLLM's default for the target, [2, N//2, N-3].
  - `speculators`: speculators' `config.json` (`speculators_model_type: "eagle3"`, the decoder layer's config under
    `transformer_layer_config`, `speculators_config.verifier` naming the target it was trained for), weights
    `layers.0.*`, `fc.weight`, `input_norm.weight` (with `norm_before_fc`), `norm.weight`, `lm_head.weight`,
    `embed_tokens.weight`, and `d2t`/`t2d` only when the draft vocab is reduced. Its options are read with speculators'
    own defaults (each off): they are what it trained with. The decoder layer's config is saved as a diff against
    transformers' defaults for its `model_type`, so those defaults are filled from transformers, as speculators does.

  - `dflash`: z-lab's DFlash drafter (`architectures: ["DFlashDraftModel"]`), converted by `dflash_import.py`.

Weights are read as safetensors only (one file, or shards under `model.safetensors.index.json`): a
`pytorch_model.bin` is a pickle, which this project never loads (docs/DESIGN.md §2).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load

from eagle3_assets.errors import Refusal
from eagle3_assets.storage import ArtifactStore

FORMATS = ("eagle3", "speculators", "dflash")
# `architectures[0]` of a drafter vLLM serves as its Llama-form EAGLE-3 model, and of z-lab's DFlash drafter
# (`dflash_import.py`; DFlash2's selector and convolutions are another model).
DFLASH_ARCHITECTURE = "DFlashDraftModel"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class ImportRefusal(Refusal, ValueError):
    """A published drafter that cannot start this project's release; the message names both values and the file."""


@dataclass(frozen=True)
class Source:
    """A drafter directory as read: its config, its tensors under their own names, and each file's sha256."""

    url: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    files: dict[str, str]  # file name -> sha256 of its bytes

    @property
    def config_url(self) -> str:
        return f"{self.url}/config.json"

    @property
    def weights_url(self) -> str:
        return f"{self.url}/{INDEX_FILE if INDEX_FILE in self.files else WEIGHTS_FILE}"

    @property
    def digest(self) -> str:
        """sha256 of the files it is made of (name and sha256 of each): what the release's provenance names."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()


def source_url(url: str) -> str:
    """`url` as a person can paste it and records compare it: `/m/d`, `file:///m/d` and `/m/d/` are one source."""
    return ArtifactStore(url).url_of("").rstrip("/")


def read_source(url: str) -> Source:
    """The drafter at `url` (a local directory or any fsspec URL): `config.json` and its safetensors weights."""
    store = ArtifactStore(url)
    where = source_url(url)
    names = store.listdir("")
    if "config.json" not in names:
        raise ImportRefusal(f"imported drafter: no config.json in {where}" + (" (the directory is empty or missing)"
                            if not names else f" (it holds {', '.join(names[:8])})"))  # fmt: skip
    raw = {"config.json": store.read_bytes("config.json")}
    if INDEX_FILE in names:
        raw[INDEX_FILE] = store.read_bytes(INDEX_FILE)
        shards = sorted(set(json.loads(raw[INDEX_FILE])["weight_map"].values()))
    elif WEIGHTS_FILE in names:
        shards = [WEIGHTS_FILE]
    else:
        pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
        raise ImportRefusal(
            f"imported drafter: no {WEIGHTS_FILE} or {INDEX_FILE} in {where}"
            + (f"; {', '.join(pickled)} is a pickle, which this project never loads: save the weights as safetensors"
               if pickled else "")
        )  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for name in shards:
        raw[name] = store.read_bytes(name)
        tensors |= st_load(raw[name])
    try:
        config = json.loads(raw["config.json"])
    except json.JSONDecodeError as e:
        raise ImportRefusal(f"imported drafter: {where}/config.json is not JSON ({e})") from None
    files = {name: hashlib.sha256(data).hexdigest() for name, data in raw.items()}
    return Source(url=where, config=config, tensors=tensors, files=files)


def detect_format(config: Mapping[str, Any], where: str) -> str:
    """`speculators` when the config says `speculators_model_type`, `eagle3` for the EAGLE-3 layout vLLM reads."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ImportRefusal(
                f"imported drafter: speculators_model_type {kind!r}, this project imports 'eagle3' ({where})"
            )
        return "speculators"
    arch = list(config.get("architectures") or [])
    if arch[:1] and arch[0] in EAGLE3_ARCHITECTURES:
        return "eagle3"
    if arch[:1] == [DFLASH_ARCHITECTURE]:
        return "dflash"
    raise ImportRefusal(
        f"imported drafter: architectures {arch} is no drafter this project imports (an EAGLE-3 drafter, one of "
        f"{', '.join(EAGLE3_ARCHITECTURES)}, or a speculators config with speculators_model_type 'eagle3'; or a "
        f"DFlash drafter in z-lab's layout, {DFLASH_ARCHITECTURE}) ({where})"
    )


@dataclass(frozen=True)
class Declared:
    """What a drafter's config says, in one form whatever its format."""

    format: str
    layer: dict[str, Any]  # its decoder layer's config, as a Llama config (defaults filled)
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # None: not stated (vLLM then takes the target's default)
    norms: dict[str, bool]
    verifier_architectures: list[str] = field(default_factory=list)  # the targets it says it was trained for
    target_hidden_size: int | None = None
    # Options it uses that this project's drafter has not: (field, value), each a refusal.
    unsupported: list[tuple[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what differs, kept in the release's provenance


def sliding_window_notes(layer: Mapping[str, Any], prefix: str) -> list[str]:
    """A layer trained with a sliding window (speculators 0.9.0's default, 2048 tokens) is imported into our drafter,
    which attends to the whole context: the same computation on contexts within the window, not past it."""
    if "sliding_attention" not in (layer.get("layer_types") or [])[:1]:
        return []
    window = layer.get("sliding_window")
    return [
        f"{prefix}sliding_window {window}: trained attending to the last {window} tokens; this project's drafter, and "
        "so this release, attends to the whole context (the same within the window)"
    ]


def declared(config: Mapping[str, Any], fmt: str) -> Declared:
    """The config of a drafter of format `fmt`, read as the engine serving it (vLLM) or its trainer reads it."""
    if fmt == "speculators":
        return _declared_speculators(config)
    eagle = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    norms = {f: bool(config.get(f, False)) for f in NORM_FLAGS}
    norms["norm_before_fc"] = bool(eagle.get("norm_before_fc", norms["norm_before_fc"]))  # vLLM reads it first
    unsupported = [(f, config[f]) for f in ("fc_norm", "attention_bias", "mlp_bias") if config.get(f)]
    if eagle.get("use_aux_hidden_state") is False:
        unsupported.append(("eagle_config.use_aux_hidden_state", False))
    return Declared(
        format=fmt, layer=dict(config), draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        aux_layer_ids=[int(i) for i in ids] if ids else None, norms=norms,
        target_hidden_size=config.get("target_hidden_size"), unsupported=unsupported,
        notes=sliding_window_notes(config, ""),
    )  # fmt: skip


def _declared_speculators(config: Mapping[str, Any]) -> Declared:
    layer = filled_layer_config(dict(config.get("transformer_layer_config") or {}))
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    unsupported = [(f, config[f]) for f in ("fc_norm", "embed_requires_grad") if config.get(f)]
    unsupported += [(f"transformer_layer_config.{f}", layer[f]) for f in ("attention_bias", "mlp_bias") if layer.get(f)]
    if layer.get("model_type") != "llama":
        unsupported.append(("transformer_layer_config.model_type", layer.get("model_type")))
    return Declared(
        format="speculators", layer=layer, draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layer_ids=[int(i) for i in ids] if ids else None,
        norms={f: bool(config.get(f, False)) for f in NORM_FLAGS},
        verifier_architectures=[str(a) for a in verifier.get("architectures") or []],
        target_hidden_size=config.get("target_hidden_size"), unsupported=unsupported,
        notes=sliding_window_notes(layer, "transformer_layer_config."),
    )  # fmt: skip


def filled_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """speculators' decoder-layer config with transformers' defaults for its `model_type` filled in: it saves only
    what differs from them (`to_diff_dict`)."""
    from transformers import AutoConfig

    model_type = layer.pop("model_type", None) or "llama"
    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except ValueError:  # a model type this transformers does not know: what the config says, no defaults
        defaults = {}
    return {**defaults, **layer, "model_type": model_type}


def our_name(name: str) -> str:
    """A drafter weight's name in our export: speculators' and some SpecForge checkpoints' `layers.0.` is vLLM's
    and our `midlayer.` (vLLM renames `midlayer.` to `layers.0.` as it loads)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
