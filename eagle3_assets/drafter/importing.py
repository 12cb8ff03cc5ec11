"""Import a published EAGLE-3 drafter as this project's export, refused before anything runs when it does not fit
the target (issue 53, item 1; the formats it reads: `import_formats.py`; a DFlash drafter: `dflash_import.py`).

Checked against the target (a `TargetModel`, whose aux layer ids are the settings', the layers the shards hold), each
mismatch a refusal naming both values and the file:
  - an option this project's drafter has not (a per-aux-layer `fc_norm`, biases, a Qwen3 layer, more than one layer);
  - the hidden size (and `target_hidden_size`), the vocabulary size, a draft vocabulary within it;
  - the target architecture it says it was trained for (speculators' `verifier.architectures`);
  - the aux layer ids it reads against the target's `aux_layer_ids`: fed other layers than it trained on, a drafter
    drafts noise, and continuing it needs shards of its own layers;
  - every weight our drafter expects present with its shape, none left unused;
  - its own vocab map: `d2t` [draft vocab] and `t2d` [target vocab], consistent (docs/DESIGN.md §3);
  - a shipped embedding equal to the target's (ours reads the target's, as vLLM does for a drafter that ships none).

The converted drafter is our export: the config `export.export_config` writes, the weights under our names in the
source's dtype, bit for bit (only names change, and the embedding is dropped). Its draft vocabulary is kept, not
remapped to the store's vocab map: its `lm_head` rows are trained for its own ids, and a remap would leave the ids it
lacks untrained. So the release carries its own `d2t`/`t2d` in `model.safetensors`, where vLLM, `load_export` and a
warm start read the map from; the store's `vocab_map` is never put in its place (a warm start on another map is
refused, `family.load_export_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.drafter.dflash_import import ImportedDFlash, import_dflash
from eagle3_assets.drafter.export import (
    checked_tensors,
    dtype_name,
    expected_export_tensors,
    export_config,
    publish_export,
)
from eagle3_assets.drafter.import_formats import (
    Declared,
    ImportRefusal,
    Source,
    declared,
    detect_format,
    our_name,
    read_source,
)
from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.target_head import TargetWeights
from eagle3_assets.families import EAGLE3
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, TargetModelError, default_aux_layer_ids

EMBEDDING = "embed_tokens.weight"


@dataclass(frozen=True)
class Imported:
    """A published drafter converted to our export: what the release is written from."""

    source: str  # the URL it was read from
    format: str  # `import_formats.FORMATS`
    digest: str  # sha256 over its files (`Source.digest`)
    files: dict[str, str]  # file name -> sha256
    cfg: DrafterConfig
    aux_layer_ids: list[int]
    tensors: dict[str, torch.Tensor]  # our export's names (`export.expected_export_tensors`), the source's dtype
    dtype: str
    dropped: list[str] = field(default_factory=list)  # its tensors not carried over (the embedding)
    notes: list[str] = field(default_factory=list)  # what our drafter does otherwise (`Declared.notes`)
    family: str = EAGLE3.name

    def export_config(self) -> dict[str, Any]:
        return export_config(self.cfg, aux_layer_ids=self.aux_layer_ids, dtype=self.dtype)

    def publish(self, store: ArtifactStore, rel: str, write_extra: Callable[[Path], None]) -> str:
        """Write it as our export at `rel` (checked again as every export is), with what `write_extra` adds."""
        full_vocab = self.cfg.draft_vocab_size == self.cfg.vocab_size
        tensors = checked_tensors(store, rel, self.tensors, expected_export_tensors(self.cfg), full_vocab=full_vocab)
        return publish_export(store, rel, tensors, self.export_config(), self.dtype, write_extra=write_extra)

    def provenance(self) -> dict[str, Any]:
        """Where it came from, for `release.json`."""
        return {"source": self.source, "format": self.format, "sha256": self.digest, "files": dict(self.files),
                "dropped": list(self.dropped), "notes": list(self.notes)}  # fmt: skip


Embedding = torch.Tensor | Callable[[], torch.Tensor] | None  # the target's, or how to read it when it is needed


def import_published(
    url: str, target: TargetModel, *, fmt: str = "auto", weights: Callable[[], TargetWeights]
) -> Imported | ImportedDFlash:
    """The drafter at `url` converted to our export of its family, or ImportRefusal naming what does not fit
    `target`; `weights` reads the target's (an EAGLE-3 drafter that ships an embedding is compared with its, a DFlash
    drafter drafts through its head)."""
    source = read_source(url)
    found = source_format(source, fmt)
    if found == "dflash":
        return import_dflash(source, target, weights())
    return _imported_eagle3(source, found, target, lambda: weights().embed_tokens)


def import_drafter(url: str, target: TargetModel, *, fmt: str = "auto", embed_tokens: Embedding) -> Imported:
    """The EAGLE-3 drafter at `url` converted to our export, or ImportRefusal naming what does not fit `target`.
    `embed_tokens` is the target's embedding (or how to read it: only a drafter that ships one needs it), which a
    drafter that ships one must equal; None: not compared."""
    source = read_source(url)
    found = source_format(source, fmt)
    if found == "dflash":
        raise ImportRefusal(f"imported drafter: {source.config_url} is a DFlash drafter, not an EAGLE-3 one")
    return _imported_eagle3(source, found, target, embed_tokens)


def source_format(source: Source, fmt: str) -> str:
    """The format `source` is in, which must be `fmt` unless that is "auto"."""
    found = detect_format(source.config, source.config_url)
    if fmt not in ("auto", found):
        raise ImportRefusal(
            f"imported drafter: start_from.format is {fmt!r}, but {source.config_url} is in the {found!r} format"
        )
    return found


def _imported_eagle3(source: Source, found: str, target: TargetModel, embed_tokens: Embedding) -> Imported:
    decl = declared(source.config, found)
    ids = check_declared(decl, target, source.config_url)
    cfg = drafter_config(decl, source.config_url)
    tensors, dropped = converted_tensors(source, decl, cfg, embed_tokens)
    return Imported(
        source=source.url, format=found, digest=source.digest, files=source.files, cfg=cfg, aux_layer_ids=ids,
        tensors=tensors, dtype=dtype_name(tensors["fc.weight"].dtype), dropped=dropped,
        notes=decl.notes,
    )  # fmt: skip


def check_declared(decl: Declared, target: TargetModel, where: str) -> list[int]:
    """Refuse a config that does not fit `target` (module docstring); returns the aux layer ids it reads."""
    if decl.unsupported:
        name, value = decl.unsupported[0]
        raise ImportRefusal(
            f"imported drafter: {name} is {value!r}, which this project's EAGLE-3 drafter does not have (one Llama "
            f"layer, no biases, one norm over the fused features) ({where})"
        )
    layer = decl.layer
    if int(layer.get("num_hidden_layers") or 1) != 1:
        raise ImportRefusal(
            f"imported drafter: num_hidden_layers {layer['num_hidden_layers']}, this project's EAGLE-3 drafter has 1 "
            f"({where})"
        )
    hidden, vocab = int(layer["hidden_size"]), int(layer["vocab_size"])
    if hidden != target.hidden_size:
        raise ImportRefusal(
            f"imported drafter: hidden_size {hidden} does not match the target's {target.hidden_size} ({where})"
        )
    if decl.target_hidden_size is not None and int(decl.target_hidden_size) != target.hidden_size:
        raise ImportRefusal(
            f"imported drafter: target_hidden_size {decl.target_hidden_size} does not match the target's hidden_size "
            f"{target.hidden_size} ({where})"
        )
    if vocab != target.vocab_size:
        raise ImportRefusal(
            f"imported drafter: vocab_size {vocab} does not match the target's {target.vocab_size} ({where})"
        )
    if not 1 <= decl.draft_vocab_size <= vocab:
        raise ImportRefusal(
            f"imported drafter: draft_vocab_size {decl.draft_vocab_size} is outside 1..its vocab_size {vocab} ({where})"
        )
    if decl.verifier_architectures and target.architecture not in decl.verifier_architectures:
        raise ImportRefusal(
            f"imported drafter: trained for a {', '.join(decl.verifier_architectures)} target "
            f"(speculators_config.verifier.architectures), the target is a {target.architecture} ({where})"
        )
    return checked_aux_layer_ids(decl.aux_layer_ids, target, where)


def checked_aux_layer_ids(ids: list[int] | None, target: TargetModel, where: str) -> list[int]:
    """The aux layer ids the drafter reads (vLLM feeds them in layer order, so sorted), which must be the target's
    `aux_layer_ids`: the layers the shards hold and drafter_eval's engine feeds it."""
    n = target.num_layers
    said = "" if ids else f" (not stated: vLLM's default for a {n}-layer target)"
    ids = sorted(ids or default_aux_layer_ids(n))
    if len(set(ids)) != len(ids) or not all(1 <= i <= n - 1 for i in ids):
        raise ImportRefusal(
            f"imported drafter: aux layer ids {ids}{said} are not distinct 'input of layer i' ids of the target's {n} "
            f"layers (1..{n - 1}) ({where})"
        )
    wanted = sorted(target.aux_layer_ids)
    if len(ids) != len(wanted):
        raise ImportRefusal(
            f"imported drafter: reads {len(ids)} aux layers {ids}, the shards hold {len(wanted)} (aux_layer_ids "
            f"{wanted}) ({where})"
        )
    if ids != wanted:
        raise ImportRefusal(
            f"imported drafter: aux layer ids {ids}{said} do not match the target's aux_layer_ids {wanted} ({where}); "
            f"set aux_layer_ids: {ids} to extract the layers it reads"
        )
    return ids


def drafter_config(decl: Declared, where: str) -> DrafterConfig:
    """Our drafter's config for its shape: its layer's heads, widths, norm eps and rotary, as its config says."""
    try:
        # A drafter's layer config is an HF Llama config: the shape reader the targets use reads it too.
        shape = TargetModel.from_config(decl.layer, path=where.removesuffix("/config.json"))
        return DrafterConfig.from_target(shape, draft_vocab_size=decl.draft_vocab_size, **decl.norms)
    except (TargetModelError, ValueError) as e:
        raise ImportRefusal(f"imported drafter: {e} ({where})") from None


def their_name(name: str, fmt: str) -> str:
    """Our export's name of a weight as the source's format names it (speculators: `layers.0.`)."""
    if fmt == "speculators" and name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


def converted_tensors(
    source: Source, decl: Declared, cfg: DrafterConfig, embed_tokens: Embedding
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(its tensors under our names, the names left out), or ImportRefusal naming every weight missing, unused or
    misshaped against what our drafter of `cfg` loads, then what is wrong with its vocab map or its embedding."""
    where = source.weights_url
    tensors = {our_name(n): t for n, t in source.tensors.items() if n != EMBEDDING}
    expected = expected_export_tensors(cfg)
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    expected.setdefault("d2t", (cfg.draft_vocab_size,))  # a full vocab's may be there: the identity (`vocab_map`)
    # The vocab map may be left out in part (`vocab_map` says when, and what then): its shapes are checked here.
    problems = [
        f"missing {their_name(n, decl.format)} {list(s)}"
        for n, s in expected.items()
        if n not in tensors and n not in ("d2t", "t2d")
    ]
    unused = [n for n in source.tensors if our_name(n) not in expected and n != EMBEDDING]
    problems += [f"unused {n} {list(source.tensors[n].shape)}" for n in unused]
    problems += [
        f"{their_name(n, decl.format)} is {list(tensors[n].shape)}, expected {list(s)}"
        for n, s in expected.items()
        if n in tensors and tuple(tensors[n].shape) != s
    ]
    if problems:
        raise ImportRefusal(
            f"imported drafter: its weights do not fit this project's EAGLE-3 drafter ({where}): " + "; ".join(problems)
        )
    tensors |= vocab_map(tensors.get("d2t"), tensors.get("t2d"), cfg, where)
    if full_vocab:
        del tensors["d2t"]  # vLLM has no draft-to-target table to load it into (export.expected_export_tensors)
    dropped = []
    if EMBEDDING in source.tensors:
        check_embedding(source.tensors[EMBEDDING], embed_tokens, where)
        dropped.append(EMBEDDING)
    return tensors, dropped


def vocab_map(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, cfg: DrafterConfig, where: str
) -> dict[str, torch.Tensor]:
    """Its `d2t` (int64) and `t2d` (bool) as our export holds them, or ImportRefusal naming what is wrong. A full
    draft vocab may leave both out (the identity); a reduced one needs `d2t` (without it vLLM maps draft id i to target
    id i, silently), and `t2d` follows from it when left out."""
    draft, vocab = cfg.draft_vocab_size, cfg.vocab_size

    def refuse(what: str) -> ImportRefusal:
        return ImportRefusal(f"imported drafter: {what} ({where})")

    if d2t is None:
        if draft != vocab:
            raise refuse(f"no d2t: a draft vocab of {draft} ids needs its map to the target's {vocab}")
        d2t = torch.zeros(draft, dtype=torch.int64)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise refuse(f"d2t is {d2t.dtype}, expected integer ids")
    d2t = d2t.to(torch.int64)
    targets = d2t + torch.arange(draft)
    if bool((targets < 0).any()) or bool((targets >= vocab).any()) or len(set(targets.tolist())) != draft:
        raise refuse(f"d2t maps draft ids to target ids outside 0..{vocab - 1} or to one id twice")
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
    if t2d.dtype.is_floating_point or not bool(((t2d == 0) | (t2d == 1)).all()):
        raise refuse(f"t2d is {t2d.dtype} with values other than 0 and 1, expected a bool mask")
    t2d = t2d.to(torch.bool)
    if not torch.equal(torch.nonzero(t2d).flatten(), targets):
        raise refuse(
            f"d2t and t2d disagree: t2d marks {int(t2d.sum())} target ids, d2t maps to {draft} others "
            "(nonzero(t2d) != d2t + arange(draft_vocab_size))"
        )
    return {"d2t": d2t, "t2d": t2d}


def check_embedding(shipped: torch.Tensor, embed_tokens: Embedding, where: str) -> None:
    """A drafter that ships an embedding must ship the target's: ours reads the target's own."""
    if embed_tokens is None:
        return
    if callable(embed_tokens):
        embed_tokens = embed_tokens()
    if tuple(shipped.shape) != tuple(embed_tokens.shape):
        raise ImportRefusal(
            f"imported drafter: {EMBEDDING} is {list(shipped.shape)}, the target's embedding "
            f"{list(embed_tokens.shape)} ({where})"
        )
    theirs, ours = shipped.float(), embed_tokens.to(shipped.dtype).float()  # compared at the precision it ships
    if not torch.equal(theirs, ours):
        raise ImportRefusal(
            f"imported drafter: {EMBEDDING} differs from the target's embedding (largest difference "
            f"{float((theirs - ours).abs().max()):.4g}): this project's drafter reads the target's own, as vLLM "
            f"does for a drafter that ships none ({where})"
        )
