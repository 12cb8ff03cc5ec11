"""A DFlash drafter published in z-lab's layout, as the real `dflash` package (PyPI 0.1.0) saves its DFlashDraftModel,
imports as this project's DFlash export: it drafts exactly what z-lab's own forward drafts through the target's head,
each misfit is refused naming both values, `start_from` installs it as the release, and the first DFlash drafter
continues it on the store's vocab map (issue 53, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from eagle3_assets.drafter.continuation import ContinuationPlan
from eagle3_assets.drafter.dflash_export import load_dflash_export
from eagle3_assets.drafter.dflash_import import import_dflash
from eagle3_assets.drafter.errors import TrainingError
from eagle3_assets.drafter.eval_report import ServedReport
from eagle3_assets.drafter.export import EXPORT_DIR, TRAINED_ON_FILE
from eagle3_assets.drafter.family import head_on_map
from eagle3_assets.drafter.import_formats import ImportRefusal, read_source
from eagle3_assets.drafter.imported_release import start_from, uncovered
from eagle3_assets.drafter.release import RELEASE_DIR, RELEASED, decide, export_digest, promote, target_version
from eagle3_assets.drafter.run import run_plan, train_and_export
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.families import DFLASH
from eagle3_assets.release_record import read_release_record
from eagle3_assets.settings import DFlashSettings, TrainingSettings
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings
from .helpers import DRAFT_VOCAB, HIDDEN, VOCAB, random_rows, random_vocab_map, target_of, tiny_llama, write_shard

K, MASK = 3, 5


def published_dflash(out: Path, *, vocab: int = VOCAB, mask: int = MASK, seed: int = 0, **shape):
    """A DFlash drafter saved in `out` by z-lab's own package: two Qwen3 layers reading the outputs of target layers
    0, 1, 2 of a 4-layer target (the shards' aux ids 1, 2, 3), norms drawn away from one; `shape` overrides the
    layers' config (`intermediate_size`, `num_key_value_heads`, ...). Returns the model."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**{
        "vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2,
        "num_target_layers": 4, "block_size": K, "dflash_config": {"mask_token_id": mask, "target_layer_ids": [0, 1, 2]},
    } | shape)  # fmt: skip
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


def test_an_imported_dflash_release_continues_on_the_stores_map_from_its_weights(published, tmp_path: Path):
    """Its head drafts over the whole vocabulary through the target's; continued on the store's map of 64 draft ids,
    it starts from those ids' rows of it (the rows a fresh head starts from) and every other weight as published."""
    target, published_dir, _ = published
    store = ArtifactStore(tmp_path / "store")
    hf = LlamaForCausalLM.from_pretrained(target.path)
    rows = random_rows(24, seed=0, min_len=8, max_len=16)
    keys = [write_shard(store, hf, rows[:12], 0), write_shard(store, hf, rows[12:], 12)]
    assert start_from(store, str(published_dir), target, target_version=target_version(store), fmt="dflash").installed
    vmap = random_vocab_map(seed=1)  # the store's own: a DFlash import's map is not adopted
    vmap.save(store)
    training = TrainingSettings(batch_tokens=96, warmup_steps=2, checkpoint_every=100, heldout_rows=4, device="cpu")
    # Published with blocks of K = 3 mask slots, continued with 7: no weight depends on the slots' count.
    dflash = DFlashSettings(num_layers=2, block_size=7, mask_token_id=MASK, epochs=4.0, lr=3e-3)
    settings = tiny_settings(drafters=["dflash"], training=training, dflash=dflash)
    trained, _, plan, _, _ = run_plan(store, target, settings, keys, DFLASH)
    record = read_release_record(store)
    imported = {"source": f"file://{published_dir}", "format": "dflash", "sha256": record.imported["sha256"]}
    assert plan == ContinuationPlan(True, "", record.export_sha256, [], keys, imported=imported)

    # Before its first step: the published weights, its head on the store's map.
    start = train_drafter(store, keys, vmap=vmap, target=target, settings=trained.training, family=trained,
                          continuation=plan, max_steps=0, resume=False, log=lambda _: None)  # fmt: skip
    released = {k: v.float() for k, v in load_file(str(store.local_path(f"{RELEASE_DIR}/model.safetensors"))).items()}
    state = start.model.trainable_state_dict()
    ids = torch.from_numpy(vmap.d2t) + torch.arange(len(vmap.d2t))
    assert torch.equal(state["lm_head.weight"], released["lm_head.weight"][ids])
    assert torch.equal(state["lm_head.weight"], load_target_weights(target).lm_head[ids].float())
    assert torch.equal(state["t2d"], torch.from_numpy(vmap.t2d)) and torch.equal(state["d2t"], torch.from_numpy(vmap.d2t))
    published_mask = torch.load(store.local_path(f"{RELEASE_DIR}/mask_embedding.pt"), weights_only=True)["embedding"]
    assert torch.equal(state["mask_embedding"], published_mask.float())
    others = set(state) - {"lm_head.weight", "t2d", "d2t", "mask_embedding"}
    assert others == set(released) - {"lm_head.weight", "t2d"} and len(others) == 2 * 11 + 3
    for name in others:
        assert torch.equal(state[name], released[name]), name

    # The drafter asset's run: trained warm, on every shard; its export says from what.
    run = train_and_export(store, target, settings, keys, log=lambda _: None, family=DFLASH)
    c = run.result.continued
    assert c is not None and run.result.step == c.steps and (c.new_rows, c.replayed) == (20, 0)
    assert run.summary["trained"].startswith(f"continued from the imported release (file://{published_dir}, dflash ")
    on = store.child(DFLASH.root).read_json(f"{EXPORT_DIR}/{TRAINED_ON_FILE}")
    assert (list(on["shards"]), on["continued_from"], on["imported"]) == (keys, record.export_sha256, imported)

    # A drafter the settings shape otherwise is trained from scratch, the plan naming each difference.
    def differences(**changes) -> list[str]:
        other = tiny_settings(drafters=["dflash"], dflash=dflash.model_copy(update=changes))
        return run_plan(store, target, other, keys, DFLASH)[0].import_differences(store, target, vmap)

    assert differences(num_layers=5, mask_token_id=6) == [
        "num_layers: release 2, now 5 (dflash.num_layers)", "mask_token_id: release 5, now 6 (dflash.mask_token_id)",
    ]  # fmt: skip
    assert differences(aux_layer_ids=[2, 3]) == ["aux layer ids: release [1, 2, 3], now [2, 3] (dflash.aux_layer_ids)"]


def test_a_head_is_continued_only_on_a_map_its_own_holds():
    own, store_map = random_vocab_map(seed=1), random_vocab_map(seed=2)
    head = {"lm_head.weight": torch.randn(DRAFT_VOCAB, HIDDEN), "d2t": torch.from_numpy(own.d2t),
            "t2d": torch.from_numpy(own.t2d)}  # fmt: skip
    assert head_on_map(head, torch.from_numpy(own.d2t), torch.from_numpy(own.t2d)) is head
    outside = np.flatnonzero(store_map.t2d & ~own.t2d)
    with pytest.raises(TrainingError) as e:
        head_on_map(head, torch.from_numpy(store_map.d2t), torch.from_numpy(store_map.t2d))
    assert str(e.value) == (
        f"the release cannot continue on the store's vocab map: {len(outside)} of its draft tokens (the first, target "
        f"id {outside[0]}) are not among the release's {DRAFT_VOCAB} draft ids"
    )
    assert uncovered(own, store_map) == outside.tolist()


def test_an_imported_dflash_release_is_replaced_only_by_an_export_that_serves_better_beside_it(published, tmp_path: Path):
    """The gate holds a DFlash import as it holds any release: by what it served beside the export (here a report as
    drafter_eval writes it; the serving itself: test_dflash.py serves an import, test_drafter_eval_beside.py the gate on
    a served one). Beaten, it is replaced, and the new release keeps its figures as the ones it replaced."""
    target, published_dir, _ = published
    store = ArtifactStore(tmp_path / "store")
    start_from(store, str(published_dir), target, target_version="v1", fmt="dflash")
    imported = read_release_record(store)
    source = store.child(DFLASH.root)
    source.write_bytes(f"{EXPORT_DIR}/model.safetensors", b"a DFlash export")
    source.write_json(f"{EXPORT_DIR}/config.json", {"architectures": ["DFlashDraftModel"]})

    def report(k3: float, k7: float) -> ServedReport:
        released = {"export_sha256": imported.export_sha256, "mean_acceptance_length_k3": 1.5,
                    "mean_acceptance_length_k7": 1.6, "outputs_match_greedy": True}  # fmt: skip
        return ServedReport.from_json({
            "export_sha256": export_digest(source), "mean_acceptance_length_k3": k3, "mean_acceptance_length_k7": k7,
            "outputs_match_greedy": True, "beside": {RELEASED: released},
        })  # fmt: skip

    worse = decide(store, report(1.4, 1.7), "v1", 1.1, source, family="dflash")
    assert not worse.promote and worse.reason == (
        "the new export serves at mean acceptance length 1.400 at k=3, the released drafter at 1.500 (same prompts, k "
        "and engine): not promoted, the released drafter stays"
    )
    better = decide(store, report(1.9, 2.2), "v1", 1.1, source, family="dflash")
    assert better.promote and better.released == {"k3": 1.5, "k7": 1.6}
    promote(store, better, report(1.9, 2.2), "v1", source, "dflash")
    record = read_release_record(store)
    assert (record.family, record.imported, record.replaced) == ("dflash", {}, {"k3": 1.5, "k7": 1.6})
    assert record.export_sha256 == export_digest(source) and record.released_on.acceptance == {"k3": 1.9, "k7": 2.2}
