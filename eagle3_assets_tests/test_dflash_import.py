"""A DFlash drafter published in z-lab's layout, as the real `dflash` package (PyPI 0.1.0) saves its DFlashDraftModel,
imports as this project's DFlash export: it drafts exactly what z-lab's own forward drafts through the target's head,
each misfit is refused naming both values, and `start_from` installs it as the release (issue 53, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.drafter.dflash_export import load_dflash_export
from eagle3_assets.drafter.dflash_import import import_dflash
from eagle3_assets.drafter.import_formats import ImportRefusal, read_source
from eagle3_assets.drafter.imported_release import start_from
from eagle3_assets.drafter.release import RELEASE_DIR
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.release_record import read_release_record
from eagle3_assets.storage import ArtifactStore

from .helpers import HIDDEN, VOCAB, target_of, tiny_llama

K, MASK = 3, 5


def published_dflash(out: Path, *, vocab: int = VOCAB, mask: int = MASK, seed: int = 0):
    """A DFlash drafter saved in `out` by z-lab's own package: two Qwen3 layers reading the outputs of target layers
    0, 1, 2 of a 4-layer target (the shards' aux ids 1, 2, 3), norms drawn away from one. Returns the model."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False,
        layer_types=["full_attention"] * 2, num_target_layers=4, block_size=K,
        dflash_config={"mask_token_id": mask, "target_layer_ids": [0, 1, 2]},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(a tiny target, a DFlash drafter for it as z-lab's package saves it, that model)."""
    pytest.importorskip("dflash")
    base = tmp_path_factory.mktemp("dflash-import")
    tiny_llama(base / "target", seed=1)
    model = published_dflash(base / "published")
    return target_of(base / "target"), base / "published", model


def test_the_import_drafts_what_z_labs_own_forward_drafts_through_the_targets_head(published, tmp_path: Path):
    target, published_dir, theirs = published
    assert json.loads((published_dir / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    weights = load_target_weights(target)
    imported = import_dflash(read_source(str(published_dir)), target, weights)
    assert imported.aux_layer_ids == [1, 2, 3] and imported.cfg.draft_vocab_size == VOCAB
    assert (imported.cfg.num_layers, imported.cfg.block_size, imported.cfg.mask_token_id) == (2, K, MASK)
    # Published through our exporter, read back as vLLM and the replay read it.
    store = ArtifactStore(tmp_path / "store")
    imported.publish(store, "export", write_extra=lambda _: None)
    ours, aux_layer_ids = load_dflash_export(store.local_path("export"), weights.embed_tokens)
    assert aux_layer_ids == [1, 2, 3]

    torch.manual_seed(1)
    C = 7  # context tokens 0..6; the block starts at the last verified token, index 7
    input_ids = torch.randint(3, VOCAB, (1, C + 1))
    aux = torch.randn(1, C + 1, 3 * HIDDEN)
    with torch.no_grad():
        drafted = ours(input_ids, aux, torch.tensor([[C - 1]]), block_size=K)  # K x [1, 1, V]
        block = torch.cat([input_ids[:, C:], torch.full((1, K), MASK)], dim=1)  # the anchor token, then K masks
        hidden = theirs(
            position_ids=torch.arange(C + K + 1)[None], noise_embedding=weights.embed_tokens[block].float(),
            target_hidden=aux[:, :C],
        )  # fmt: skip
        expected = hidden[:, 1:] @ weights.lm_head.float().T  # [1, K, V]: z-lab drafts through the target's head
    for slot in range(K):
        torch.testing.assert_close(drafted[slot][0, 0], expected[0, slot], rtol=1e-4, atol=1e-4)


def _edited(published_dir: Path, tmp_path: Path, *, drop: str = "", add: str = "", **changes) -> str:
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((published_dir / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_config__"):
            config["dflash_config"][key.removeprefix("dflash_config__")] = value
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(published_dir / "model.safetensors"))
    tensors.pop(drop, None)
    if add:
        tensors[add] = torch.zeros(4)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 128}, "hidden_size 128 does not match the target's 64"),
        ({"vocab_size": 300}, "vocab_size 300 does not match the target's 256"),
        ({"num_target_layers": 8}, "num_target_layers 8 does not match the target's 4"),
        ({"dflash_config__mask_token_id": 256}, "dflash_config.mask_token_id 256 is no id of the target's 256"),
        ({"dflash_config__target_layer_ids": [1, 2, 3]},
         "dflash_config.target_layer_ids [1, 2, 3] reads the output of layers [3], which the shards do not store "
         "(aux_layer_ids [1, 2, 3], inputs of layers); set aux_layer_ids to hold [2, 3, 4] and dflash.aux_layer_ids: "
         "[2, 3, 4]"),
        ({"output_multiplier": 0.5}, "output_multiplier is 0.5, which this project's DFlash drafter does not have"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types holds 'sliding_attention': causal"),
        ({"drop": "norm.weight"}, "its weights do not fit this project's DFlash drafter"),
        ({"add": "layers.0.attention_conv.base_kernel"}, "unexpected tensor layers.0.attention_conv.base_kernel [4]"),
    ],
)  # fmt: skip
def test_each_misfit_is_refused_naming_both_values(published, tmp_path: Path, changes: dict, message: str):
    target, published_dir, _ = published
    source = read_source(_edited(published_dir, tmp_path, **changes))
    with pytest.raises(ImportRefusal, match="^imported drafter: ") as refused:
        import_dflash(source, target, load_target_weights(target))
    assert message in str(refused.value)
    if changes.get("drop"):
        assert str(refused.value).endswith(f"model.safetensors): missing tensor norm.weight [{HIDDEN}]")


def test_dflash2_is_refused_by_name(published, tmp_path: Path):
    target, published_dir, _ = published
    edited = _edited(published_dir, tmp_path, architectures=["DFlash2DraftModel"])
    refused = r"architectures \['DFlash2DraftModel'\] is no drafter this project imports"
    with pytest.raises(ImportRefusal, match=refused):
        start_from(ArtifactStore(tmp_path / "store"), edited, target, target_version="v1")


def test_start_from_installs_it_as_a_dflash_release(published, tmp_path: Path):
    target, published_dir, _ = published
    store = ArtifactStore(tmp_path / "store")
    installed = start_from(store, str(published_dir), target, target_version="v1", fmt="dflash")
    assert installed.installed
    assert installed.reason.startswith(f"imported from file://{published_dir} (dflash format, sha256 ")
    record = read_release_record(store)
    assert (record.family, record.target, record.imported["format"]) == ("dflash", "v1", "dflash")
    assert "drafts through the target's lm_head over its whole vocabulary (256 ids)" in record.imported["notes"][0]
    model, aux_layer_ids = load_dflash_export(store.local_path(RELEASE_DIR), load_target_weights(target).embed_tokens)
    assert aux_layer_ids == [1, 2, 3] and model.config.draft_vocab_size == VOCAB
    # Its mask slots are the target's embedding of the mask token, as published.
    torch.testing.assert_close(model.mask_embedding.data, load_target_weights(target).embed_tokens[MASK].float())
