"""Importing a published drafter (issue 53, item 1): each layout converts to our export tensor for tensor, loads in our
drafter, becomes the release with its provenance, and every mismatch with the target is refused, naming both values."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from transformers import LlamaConfig

from eagle3_assets.drafter.export import export_drafter, load_export
from eagle3_assets.drafter.import_formats import ImportRefusal
from eagle3_assets.drafter.continuation import ContinuationPlan, continuation_plan, read_release
from eagle3_assets.drafter.imported_release import install_release, install_start_from, start_from
from eagle3_assets.drafter.importing import import_drafter
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.release import RELEASE_DIR, export_digest
from eagle3_assets.provenance import Provenance, Record, write_record
from eagle3_assets.release_record import IMPORTED, RELEASE_RECORD
from eagle3_assets.settings import Settings, SettingsError, parse_settings
from eagle3_assets.storage import ArtifactStore

from .helpers import DRAFT_VOCAB, HIDDEN, REPO, VOCAB, random_vocab_map, target_of, tiny_llama

NORMS = ("norm_before_fc", "norm_before_residual", "norm_output")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama target (4 layers, aux layers [1, 2, 3]) and its embedding."""
    out = tmp_path_factory.mktemp("import-target") / "target"
    model = tiny_llama(out)
    return target_of(out), model.model.embed_tokens.weight.detach().clone()


def drafter(target, *, norms: bool = True, draft: int = DRAFT_VOCAB, seed: int = 1) -> Eagle3Drafter:
    """A drafter of our own for `target`, its norms away from 1 so a dropped or swapped one shows."""
    torch.manual_seed(seed)
    vmap = random_vocab_map(draft=draft, seed=seed)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=draft, **dict.fromkeys(NORMS, norms))
    model = Eagle3Drafter(cfg, vmap.d2t, vmap.t2d)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def weights(model: Eagle3Drafter, embed: torch.Tensor, *, prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """Its weights in bf16 as a published checkpoint holds them: the layer under `prefix`, the target's embedding."""
    out = {k.replace("midlayer.", prefix): v if k in ("d2t", "t2d") else v.bfloat16()
           for k, v in model.trainable_state_dict().items()}  # fmt: skip
    return out | {"embed_tokens.weight": embed.bfloat16()}


def write(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return str(directory)


def eagle_layout(directory: Path, model: Eagle3Drafter, embed: torch.Tensor, **config) -> str:
    """The layout vLLM reads, as the EAGLE reference writes it: a one-layer Llama config with no norm options (vLLM
    reads them as off) and the aux layers in `eagle_config`, `midlayer.*`, the vocab map and the embedding."""
    cfg = model.config
    body = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    }  # fmt: skip
    return write(directory, body | config, weights(model, embed))


def speculators_layout(directory: Path, model: Eagle3Drafter, embed: torch.Tensor, **config) -> str:
    """speculators 0.9.0's layout, as its `save_pretrained` wrote it in `write_speculators_drafter.py`: the layer's
    config as transformers' diff against its defaults (with the 2048-token sliding window its trainer sets by default),
    `layers.0.*`, the embedding, and `d2t`/`t2d` only for a reduced draft vocab (the real package's own checkpoint:
    `test_a_drafter_written_by_speculators_…`)."""
    cfg = model.config
    layer = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, max_position_embeddings=512, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
        sliding_window=2048, use_sliding_window=True, layer_types=["sliding_attention"],
    ).to_diff_dict()  # fmt: skip
    body = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "embed_requires_grad": False, "fc_norm": False, "target_hidden_size": None,
        **{f: getattr(cfg, f) for f in NORMS},
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "/models/tiny"},
        },
        "transformer_layer_config": layer, "torch_dtype": "bfloat16",
    }  # fmt: skip
    tensors = weights(model, embed, prefix="layers.0.")
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    return write(directory, body | config, tensors)


def assert_imports_as_itself(imported, model: Eagle3Drafter, target, embed, tmp_path: Path) -> None:
    """Converted tensor for tensor (bf16 as published, the vocab map as is), installed as the release, and loaded by
    our export loader into the same drafter."""
    original = {k: v if k in ("d2t", "t2d") else v.bfloat16() for k, v in model.trainable_state_dict().items()}
    if model.config.draft_vocab_size == model.config.vocab_size:
        del original["d2t"]
    assert imported.tensors.keys() == original.keys()
    for name, tensor in original.items():
        assert imported.tensors[name].dtype == tensor.dtype and torch.equal(imported.tensors[name], tensor), name
    store = ArtifactStore(tmp_path / "store")
    assert install_release(store, imported, target_version="v1").installed
    released = st_load(store.read_bytes(f"{RELEASE_DIR}/model.safetensors"))
    assert all(torch.equal(released[n], t) for n, t in original.items()) and released.keys() == original.keys()
    loaded, ids = load_export(store.local_path(RELEASE_DIR), embed)
    # Its shape is the published config's, its context included (ours were built for the target's).
    context = {"max_position_embeddings": 512}
    assert ids == [1, 2, 3] and replace(loaded.config, **context) == replace(model.config, **context)
    want = {k: v.float() if v.is_floating_point() else v for k, v in original.items()}
    assert all(torch.equal(loaded.trainable_state_dict()[n], t) for n, t in want.items())


def test_the_eagle_layout_imports_tensor_for_tensor_and_loads_in_our_drafter(target, tmp_path):
    tgt, embed = target
    model = drafter(tgt, norms=False)
    imported = import_drafter(eagle_layout(tmp_path / "eagle", model, embed), tgt, embed_tokens=embed)
    assert (imported.format, imported.dropped, imported.notes) == ("eagle3", ["embed_tokens.weight"], [])
    assert imported.export_config()["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert all(imported.export_config()[f] is False for f in NORMS)  # unstated: off, as vLLM reads them
    assert_imports_as_itself(imported, model, tgt, embed, tmp_path)


def test_our_own_export_imports_as_itself(target, tmp_path):
    tgt, embed = target
    model = drafter(tgt)
    store = ArtifactStore(tmp_path / "ours")
    url = export_drafter(store, model.trainable_state_dict(), model.config, aux_layer_ids=[1, 2, 3])
    imported = import_drafter(url, tgt, embed_tokens=embed)
    assert (imported.format, imported.dropped) == ("eagle3", [])
    exported = json.loads((tmp_path / "ours/drafter/export/config.json").read_text())
    assert imported.export_config() == exported
    assert_imports_as_itself(imported, model, tgt, embed, tmp_path)


def test_the_speculators_layout_imports_tensor_for_tensor_and_loads_in_our_drafter(target, tmp_path):
    tgt, embed = target
    model = drafter(tgt)
    imported = import_drafter(speculators_layout(tmp_path / "spec", model, embed), tgt, fmt="speculators",
                              embed_tokens=embed)  # fmt: skip
    assert (imported.format, imported.dropped) == ("speculators", ["embed_tokens.weight"])
    assert imported.notes == [
        "transformer_layer_config.sliding_window 2048: trained attending to the last 2048 tokens; this project's "
        "drafter, and so this release, attends to the whole context (the same within the window)"
    ]
    assert all(imported.export_config()[f] is True for f in NORMS)
    assert_imports_as_itself(imported, model, tgt, embed, tmp_path)


def test_a_full_draft_vocab_without_a_vocab_map_imports_as_the_identity(target, tmp_path):
    tgt, embed = target
    model = drafter(tgt, draft=VOCAB)
    imported = import_drafter(speculators_layout(tmp_path / "spec", model, embed), tgt, embed_tokens=embed)
    assert "d2t" not in imported.tensors and bool(imported.tensors["t2d"].all())
    assert_imports_as_itself(imported, model, tgt, embed, tmp_path)


def test_the_release_records_where_it_came_from_and_is_never_replaced_by_an_import(target, tmp_path):
    tgt, embed = target
    source = speculators_layout(tmp_path / "spec", drafter(tgt), embed)
    store = ArtifactStore(tmp_path / "store")
    done = start_from(store, source, tgt, target_version="v1")
    url, src = store.url_of(RELEASE_DIR), f"file://{source}"
    record = store.read_json(RELEASE_RECORD)
    digest = record[IMPORTED]["sha256"]
    assert done.installed
    assert done.reason == f"imported from {src} (speculators format, sha256 {digest}): not yet served here"
    assert record["target"] == "v1" and record["family"] == "eagle3" and record["acceptance"] == {}
    assert record["export_sha256"] == export_digest(store, RELEASE_DIR)
    assert record[IMPORTED]["source"] == src and record[IMPORTED]["format"] == "speculators"
    assert sorted(record[IMPORTED]["files"]) == ["config.json", "model.safetensors"]
    assert sorted(store.listdir(RELEASE_DIR)) == ["config.json", "model.safetensors", "release.json"]
    # Continued on every shard when its weights load into the drafter trained now (test_drafter_import_continue.py).
    now = {"family": "eagle3", "target": "v1", "vocab_map": "m", "settings": {}, "shards": {"rows_0-20": "r"}}
    assert continuation_plan(*read_release(store), now, []) == ContinuationPlan(
        True, "", record["export_sha256"], [], ["rows_0-20"],
        imported={"source": src, "format": "speculators", "sha256": digest},
    )  # fmt: skip
    # Again: the release is that import, and nothing of the source is read (it may be gone).
    (Path(source) / "model.safetensors").unlink()
    again = start_from(store, source + "/", tgt, target_version="v1")
    assert not again.installed and again.reason == f"{src} is already the release at {url} (imported, sha256 {digest})"
    other = eagle_layout(tmp_path / "eagle", drafter(tgt, norms=False), embed)
    kept = start_from(store, other, tgt, target_version="v1")
    assert not kept.installed and kept.reason == (
        f"a drafter is released at {url} already ({done.reason}): an import starts a store with none and never "
        f"replaces a release; remove {url} to start from file://{other}"
    )


def edited(path: str, **changes) -> str:
    """`path`'s config.json with `changes` (None removes a field)."""
    config = json.loads((Path(path) / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (Path(path) / "config.json").write_text(json.dumps(config))
    return path


def refusal(source: str, target, **kwargs) -> str:
    with pytest.raises(ImportRefusal) as e:
        import_drafter(source, target[0], embed_tokens=target[1], **kwargs)
    return str(e.value)


@pytest.fixture()
def eagle_source(target, tmp_path) -> str:
    return eagle_layout(tmp_path / "eagle", drafter(target[0], norms=False), target[1])


@pytest.fixture()
def spec_source(target, tmp_path) -> str:
    return speculators_layout(tmp_path / "spec", drafter(target[0]), target[1])


def test_a_config_that_does_not_fit_the_target_is_refused_naming_both_values(target, eagle_source, spec_source):
    cfg, spec_cfg = f"file://{eagle_source}/config.json", f"file://{spec_source}/config.json"
    assert refusal(edited(eagle_source, hidden_size=128), target) == (
        f"imported drafter: hidden_size 128 does not match the target's {HIDDEN} ({cfg})"
    )
    assert refusal(edited(eagle_source, hidden_size=HIDDEN, vocab_size=512), target) == (
        f"imported drafter: vocab_size 512 does not match the target's {VOCAB} ({cfg})"
    )
    assert refusal(edited(eagle_source, vocab_size=VOCAB, draft_vocab_size=300), target) == (
        f"imported drafter: draft_vocab_size 300 is outside 1..its vocab_size {VOCAB} ({cfg})"
    )
    assert refusal(edited(eagle_source, draft_vocab_size=DRAFT_VOCAB, num_hidden_layers=2), target) == (
        f"imported drafter: num_hidden_layers 2, this project's EAGLE-3 drafter has 1 ({cfg})"
    )
    assert refusal(edited(eagle_source, num_hidden_layers=1, fc_norm=True), target) == (
        "imported drafter: fc_norm is True, which this project's EAGLE-3 drafter does not have (one Llama layer, no "
        f"biases, one norm over the fused features) ({cfg})"
    )
    assert refusal(edited(eagle_source, fc_norm=None, head_dim=16), target) == (
        f"imported drafter: head_dim 16 < 32: vLLM cannot serve it (docs/DESIGN.md §6) ({cfg})"
    )
    verifier = {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"}
    spec = json.loads((Path(spec_source) / "config.json").read_text())["speculators_config"]
    assert refusal(edited(spec_source, speculators_config=spec | {"verifier": verifier}), target) == (
        "imported drafter: trained for a Qwen3ForCausalLM target (speculators_config.verifier.architectures), the "
        f"target is a LlamaForCausalLM ({spec_cfg})"
    )
    assert refusal(edited(spec_source, speculators_config=spec, target_hidden_size=128), target) == (
        f"imported drafter: target_hidden_size 128 does not match the target's hidden_size {HIDDEN} ({spec_cfg})"
    )
    layer = json.loads((Path(spec_source) / "config.json").read_text())["transformer_layer_config"]
    qwen3 = edited(spec_source, target_hidden_size=None, transformer_layer_config=layer | {"model_type": "qwen3"})
    assert refusal(qwen3, target) == (
        "imported drafter: transformer_layer_config.model_type is 'qwen3', which this project's EAGLE-3 drafter does "
        f"not have (one Llama layer, no biases, one norm over the fused features) ({spec_cfg})"
    )
    assert refusal(edited(spec_source, transformer_layer_config=layer), target, fmt="eagle3") == (
        f"imported drafter: start_from.format is 'eagle3', but {spec_cfg} is in the 'speculators' format"
    )


def test_aux_layers_other_than_the_targets_are_refused_naming_both(target, eagle_source):
    tgt, embed = target
    cfg = f"file://{eagle_source}/config.json"
    # Listed in any order: vLLM feeds the aux states in layer order.
    assert import_drafter(edited(eagle_source, eagle_aux_hidden_state_layer_ids=[3, 1, 2]), tgt,
                          embed_tokens=embed).aux_layer_ids == [1, 2, 3]  # fmt: skip
    assert refusal(edited(eagle_source, eagle_aux_hidden_state_layer_ids=[1, 2, 4]), target) == (
        f"imported drafter: aux layer ids [1, 2, 4] are not distinct 'input of layer i' ids of the target's 4 layers "
        f"(1..3) ({cfg})"
    )
    assert refusal(edited(eagle_source, eagle_aux_hidden_state_layer_ids=[1, 2]), target) == (
        f"imported drafter: reads 2 aux layers [1, 2], the shards hold 3 (aux_layer_ids [1, 2, 3]) ({cfg})"
    )
    # Unstated, vLLM takes the target's default [2, N//2, N-3]: on 4 layers two of them collide.
    unstated = edited(eagle_source, eagle_aux_hidden_state_layer_ids=None, eagle_config=None)
    assert refusal(unstated, target) == (
        "imported drafter: aux layer ids [1, 2, 2] (not stated: vLLM's default for a 4-layer target) are not distinct "
        f"'input of layer i' ids of the target's 4 layers (1..3) ({cfg})"
    )
    deeper = replace(tgt, num_layers=8, aux_layer_ids=(2, 4, 5))  # a deeper target's shape, its default layers
    assert import_drafter(unstated, deeper, embed_tokens=embed).aux_layer_ids == [2, 4, 5]
    assert refusal(edited(unstated, eagle_aux_hidden_state_layer_ids=[1, 2, 3]), (deeper, embed)) == (
        "imported drafter: aux layer ids [1, 2, 3] do not match the target's aux_layer_ids [2, 4, 5] "
        f"({cfg}); set aux_layer_ids: [1, 2, 3] to extract the layers it reads"
    )


def rewrite(path: str, change) -> str:
    """`path`'s weights after `change(tensors)`."""
    file = Path(path) / "model.safetensors"
    tensors = st_load(file.read_bytes())
    change(tensors)
    save_file(tensors, str(file))
    return path


def test_weights_missing_unused_or_misshaped_are_refused_naming_each(target, spec_source):
    where = f"file://{spec_source}/model.safetensors"

    def change(t):
        del t["layers.0.mlp.up_proj.weight"]
        t["layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        t["fc.weight"] = t["fc.weight"][:, :128].contiguous()

    assert refusal(rewrite(spec_source, change), target) == (
        f"imported drafter: its weights do not fit this project's EAGLE-3 drafter ({where}): missing "
        "layers.0.mlp.up_proj.weight [128, 64]; unused layers.0.self_attn.q_proj.bias [64]; fc.weight is [64, 128], "
        "expected [64, 192]"
    )


def test_its_own_vocab_map_is_checked(target, eagle_source):
    where = f"file://{eagle_source}/model.safetensors"

    def short_d2t(t):
        t["d2t"] = t["d2t"][:-1].contiguous()

    assert refusal(rewrite(eagle_source, short_d2t), target) == (
        f"imported drafter: its weights do not fit this project's EAGLE-3 drafter ({where}): d2t is "
        f"[{DRAFT_VOCAB - 1}], expected [{DRAFT_VOCAB}]"
    )
    right = random_vocab_map(seed=1)

    def disagree(t):
        t["d2t"] = torch.as_tensor(right.d2t)
        t["t2d"] = torch.as_tensor(random_vocab_map(seed=2).t2d)

    assert refusal(rewrite(eagle_source, disagree), target) == (
        f"imported drafter: d2t and t2d disagree: t2d marks {DRAFT_VOCAB} target ids, d2t maps to {DRAFT_VOCAB} others "
        f"(nonzero(t2d) != d2t + arange(draft_vocab_size)) ({where})"
    )

    def no_map(t):
        del t["d2t"], t["t2d"]

    assert refusal(rewrite(eagle_source, no_map), target) == (
        f"imported drafter: no d2t: a draft vocab of {DRAFT_VOCAB} ids needs its map to the target's {VOCAB} ({where})"
    )

    def only_d2t(t):
        t["d2t"] = torch.as_tensor(right.d2t).to(torch.int32)

    imported = import_drafter(rewrite(eagle_source, only_d2t), target[0], embed_tokens=target[1])
    assert imported.tensors["d2t"].dtype == torch.int64
    assert torch.equal(imported.tensors["d2t"], torch.as_tensor(right.d2t))
    assert torch.equal(imported.tensors["t2d"], torch.as_tensor(right.t2d))  # made from d2t


def test_an_embedding_other_than_the_targets_is_refused(target, eagle_source):
    def trained(t):
        t["embed_tokens.weight"][5] = 0.0

    largest = float(target[1][5].bfloat16().float().abs().max())
    assert refusal(rewrite(eagle_source, trained), target) == (
        "imported drafter: embed_tokens.weight differs from the target's embedding (largest difference "
        f"{largest:.4g}): this project's drafter reads the target's own, as vLLM does for a drafter that ships none "
        f"(file://{eagle_source}/model.safetensors)"
    )


def test_pickled_weights_and_other_drafters_are_refused(target, tmp_path, eagle_source):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((Path(eagle_source) / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    assert refusal(str(pickled), target) == (
        f"imported drafter: no model.safetensors or model.safetensors.index.json in file://{pickled}; "
        "pytorch_model.bin is a pickle, which this project never loads: save the weights as safetensors"
    )
    assert refusal(str(tmp_path / "nothing"), target) == (
        f"imported drafter: no config.json in file://{tmp_path}/nothing (the directory is empty or missing)"
    )
    assert refusal(edited(eagle_source, architectures=["MedusaModel"]), target) == (
        "imported drafter: architectures ['MedusaModel'] is no drafter this project imports (an EAGLE-3 drafter, one "
        "of LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, or a speculators config with speculators_model_type "
        f"'eagle3'; or a DFlash drafter in z-lab's layout, DFlashDraftModel) (file://{eagle_source}/config.json)"
    )
    # A DFlash drafter is imported by its own path (test_dflash_import.py), never as an EAGLE-3 one.
    assert refusal(edited(eagle_source, architectures=["DFlashDraftModel"]), target) == (
        f"imported drafter: file://{eagle_source}/config.json is a DFlash drafter, not an EAGLE-3 one"
    )


def test_drafter_eval_installs_start_from_as_the_release_of_the_stores_target(target, tmp_path, spec_source):
    """What `drafter_eval` calls before it serves the release beside a new export: the release is for the target
    version the store's `target_model` record holds, so it is the baseline (`release.other_target`)."""
    tgt, _ = target
    store = ArtifactStore(tmp_path / "store")
    write_record(store, Record(Provenance("target_model", {}, {}, 1), version="target-v7"))
    settings = Settings(start_from={"drafter": spec_source, "format": "speculators"})
    assert install_start_from(store, settings, tgt).installed
    assert store.read_json(RELEASE_RECORD)["target"] == "target-v7"
    assert not install_start_from(store, settings, tgt).installed


def test_the_start_from_setting_names_the_drafter_and_its_format():
    settings = Settings(start_from={"drafter": "s3://bucket/eagle3-drafter"})
    assert (settings.start_from.drafter, settings.start_from.format) == ("s3://bucket/eagle3-drafter", "auto")
    assert Settings().start_from is None
    with pytest.raises(SettingsError) as e:
        parse_settings({"start_from": {"drafter": "/m", "format": "bin"}})
    assert str(e.value) == (
        "invalid settings in settings:\n  start_from.format: Input should be 'auto', 'eagle3', 'speculators' or 'dflash'"
    )


# speculators pins its own stack, so it lives in a venv of its own (`make test-peer-import` builds it and runs this).
SPECULATORS_PYTHON = Path(os.environ.get("EAGLE3_SPECULATORS_PYTHON", REPO / ".peer/speculators/bin/python"))


@pytest.mark.slow
@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason=f"no speculators venv at {SPECULATORS_PYTHON}: "
                    "`make test-peer-import` builds it (benchmarks/peer/setup_speculators_venv.sh)")  # fmt: skip
def test_a_drafter_written_by_speculators_imports_and_drafts_what_speculators_drafts(target, tmp_path):
    """The real package (PyPI 0.9.0) writes the checkpoint, as its trainer builds one; imported and released, our
    drafter drafts exactly what speculators' own forward drafts on the same inputs, every TTT step."""
    tgt, embed = target
    vmap = random_vocab_map(seed=3)
    np.save(tmp_path / "d2t.npy", vmap.d2t)
    np.save(tmp_path / "t2d.npy", vmap.t2d)
    out = tmp_path / "speculators"
    subprocess.run(
        [str(SPECULATORS_PYTHON), str(REPO / "benchmarks/peer/write_speculators_drafter.py"), "--target", str(tgt.path),
         "--out", str(out), "--d2t", str(tmp_path / "d2t.npy"), "--t2d", str(tmp_path / "t2d.npy"),
         "--aux-layer-ids", "1", "2", "3", "--reference", "48"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    store = ArtifactStore(tmp_path / "store")
    done = start_from(store, str(out), tgt, target_version="v1")
    record = store.read_json(RELEASE_RECORD)[IMPORTED]
    assert done.installed and record["format"] == "speculators" and record["dropped"] == ["embed_tokens.weight"]
    written = st_load((out / "model.safetensors").read_bytes())
    released = st_load(store.read_bytes(f"{RELEASE_DIR}/model.safetensors"))
    assert {k.replace("layers.0.", "midlayer.") for k in written} - {"embed_tokens.weight"} == set(released)
    assert all(torch.equal(released[k.replace("layers.0.", "midlayer.")], t) for k, t in written.items()
               if k != "embed_tokens.weight")  # fmt: skip
    model, _ = load_export(store.local_path(RELEASE_DIR), embed)
    ref = st_load((out / "reference.safetensors").read_bytes())
    tokens = ref["aux"].shape[0]
    with torch.no_grad():
        logits = model(ref["input_ids"][None, :tokens], ref["aux"][None], 3)
    for k, step in enumerate(logits):  # the last k + 1 indices read past our row's end: not compared
        assert torch.equal(step[0, : tokens - 1 - k].argmax(-1), ref["draft_tokens"][k, : tokens - 1 - k]), k
