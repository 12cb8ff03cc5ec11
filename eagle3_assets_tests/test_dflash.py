"""The DFlash block drafter: its attention pattern, its scoring, its export, and vLLM serving what it trained.

The serving test replays vLLM's drafting rounds over our own model: a round at newest token index a drafts the
block at anchor index a - 1, and vLLM accepts its leading slots that equal the target's greedy tokens. vLLM's
counters equal the replay's only when the context layers, fc, hidden_norm, the per-head norms, rotary positions,
the mask embedding, the non-causal block and every weight name match what vLLM computes: a weight the loader left
uninitialised would move them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_assets.drafter.dflash_export import (
    MASK_EMBEDDING_FILE,
    expected_dflash_tensors,
    export_dflash,
    load_dflash_export,
)
from eagle3_assets.drafter.dflash_import import import_dflash
from eagle3_assets.drafter.dflash_loss import choose_anchors, dflash_forward
from eagle3_assets.drafter.dflash_model import DFlashConfig, DFlashDrafter, block_attention_mask
from eagle3_assets.drafter.export import EXPORT_DIR, ExportError
from eagle3_assets.drafter.family import DFlash
from eagle3_assets.drafter.import_formats import read_source
from eagle3_assets.drafter.served_replay import SERVED_AS, trained_served_as
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.settings import DFlashSettings, TrainingSettings
from eagle3_assets.storage import ArtifactStore

from .drafter_serving import PROMPT_LEN, assert_served_as_replayed, confident_target_with_text, replayed
from .helpers import AUX_IDS, random_vocab_map, target_of
from .test_dflash_import import published_dflash


def tiny_config(**overrides) -> DFlashConfig:
    return DFlashConfig(
        **{"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "intermediate_size": 128, "vocab_size": 300, "draft_vocab_size": 300, "num_aux_layers": 3,
           "num_layers": 2, "block_size": 3, "mask_token_id": 0} | overrides
    )  # fmt: skip


def test_a_block_sees_the_context_up_to_its_anchor_and_its_whole_block():
    anchors = torch.tensor([[1, 3], [2, -1]])
    mask = block_attention_mask(anchors, seq_len=5, block=1)  # [B, 1, Q=4, T + Q = 9]
    assert mask.shape == (2, 1, 4, 9)
    # row 0, block at anchor 1: context keys 0..1, and its own two query slots (non-causal between them)
    assert mask[0, 0, 0].tolist() == [True, True, False, False, False, True, True, False, False]
    assert mask[0, 0, 1].tolist() == mask[0, 0, 0].tolist()
    # block at anchor 3: context 0..3, its own slots 2..3
    assert mask[0, 0, 3].tolist() == [True, True, True, True, False, False, False, True, True]
    # row 1's second block is padding: it sees only itself
    assert mask[1, 0, 2].tolist() == [False] * 5 + [False, False, True, True]
    # packed rows: the context is cut to the anchor's own sample
    segments = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    packed = block_attention_mask(anchors, 5, 1, segments)
    assert packed[0, 0, 2, :5].tolist() == [False, False, True, True, False]


def test_anchors_are_drawn_from_the_trained_indices_only():
    starts = torch.tensor([[False, True, True, False, True], [False, False, False, True, False]])
    assert choose_anchors(starts, None).tolist() == [[1, 2, 4], [3, -1, -1]]
    drawn = choose_anchors(starts, 2, torch.Generator().manual_seed(0))
    assert drawn.shape == (2, 2)
    assert set(drawn[0].tolist()) <= {1, 2, 4} and drawn[0, 0] < drawn[0, 1]
    assert drawn[1].tolist() == [3, -1]
    again = choose_anchors(starts, 2, torch.Generator().manual_seed(0))
    assert torch.equal(drawn, again)  # the same generator state draws the same anchors (resume)


def test_slot_k_of_a_block_is_scored_as_eagle3s_step_k_at_the_anchor_index():
    """A block at anchor t drafts tokens t+2.. with its slots; slot k's loss and accuracy are taken at t against
    the target at t+1+k, so a drafter that always proposes the right tokens scores acc_k = 1 and a run of K."""
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=64, draft_vocab_size=64, block_size=3, num_layers=1)
    model = DFlashDrafter(cfg, torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool))
    ids = torch.randint(1, 64, (1, 12))
    lengths, loss_mask = torch.tensor([12]), torch.tensor([[0] * 4 + [1] * 8])
    probs = torch.nn.functional.one_hot(torch.roll(ids, -1, 1), 64).float()  # target at p predicts token p+1
    from eagle3_assets.drafter.target_head import Targets

    targets = Targets(probs, probs.argmax(-1), torch.ones(1, 12, dtype=torch.bool))

    def oracle(input_ids, aux, anchors, positions=None, segments=None):
        # slot k of the block at t proposes token t+2+k: the right one
        at = (anchors[..., None] + 2 + torch.arange(3)).clamp(max=11)  # [B, N, K]
        logits = torch.nn.functional.one_hot(input_ids.gather(1, at.flatten(1)).view(at.shape), 64).float() * 50
        return list(logits.unbind(2))

    model.forward = oracle  # type: ignore[method-assign]
    out = dflash_forward(model, ids, torch.zeros(1, 12, 192), loss_mask, lengths, targets, loss_decay=7.0,
                         anchors_per_row=None)  # fmt: skip
    # trained step-0 predictions: token t+2 generated (t+2 >= 4) and existing (t+2 < 12): t = 2..9
    assert out.kept.tolist() == [8, 7, 6]
    assert out.correct.tolist() == out.kept.tolist()
    assert out.runs.tolist() == [0, 1, 1, 6]  # anchors 9, 8 end early only because the row ends


def test_the_export_holds_exactly_what_vllm_loads_and_refuses_a_missing_or_extra_weight(tmp_path: Path):
    cfg = tiny_config(draft_vocab_size=128)
    vmap = random_vocab_map(300, 128)
    model = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=torch.randn(300, 64))
    tensors = model.trainable_state_dict()
    assert set(tensors) - {"mask_embedding"} == set(expected_dflash_tensors(cfg))
    store = ArtifactStore(tmp_path / "store")
    for broken, named in (
        ({k: v for k, v in tensors.items() if k != "layers.1.self_attn.k_norm.weight"}, "missing tensor layers.1.self_attn.k_norm.weight [32]"),
        (tensors | {"layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}, "unexpected tensor layers.2.mlp.up_proj.weight [128, 64]"),
        (tensors | {"fc.weight": torch.zeros(64, 128)}, "tensor fc.weight is [64, 128], expected [64, 192]"),
    ):  # fmt: skip
        with pytest.raises(ExportError) as err:
            export_dflash(store, broken, cfg, aux_layer_ids=AUX_IDS, rel="export")
        assert named in str(err.value)
        assert not store.exists("export")

    url = export_dflash(store, tensors, cfg, aux_layer_ids=AUX_IDS, rel="export", dtype="float32")
    out = store.local_path("export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 0,
        "target_layer_ids": [i - 1 for i in AUX_IDS],
        "causal": False,
    }
    assert config["num_hidden_layers"] == 2 and config["draft_vocab_size"] == 128
    assert url.endswith("/export")
    mask = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == 0 and torch.equal(mask["embedding"], tensors["mask_embedding"])

    loaded, aux = load_dflash_export(out, model.embed_tokens.weight)
    assert aux == AUX_IDS
    ids, feats = torch.randint(1, 300, (2, 10)), torch.randn(2, 10, 192)
    anchors = torch.tensor([[2, 5], [0, 7]])
    for a, b in zip(model.eval()(ids, feats, anchors), loaded(ids, feats, anchors), strict=True):
        torch.testing.assert_close(a, b)


def test_a_released_dflash_export_warm_starts_a_fresh_drafter_mask_embedding_included(tmp_path: Path):
    """Issue 45: a continuation starts from the release's weights, and a DFlash release's mask embedding is in a
    file of its own; a release of another shape is refused, naming the tensor."""
    cfg = tiny_config(draft_vocab_size=128)
    vmap = random_vocab_map(300, 128)
    released = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=torch.randn(300, 64))
    with torch.no_grad():
        released.mask_embedding.normal_()
    store = ArtifactStore(tmp_path / "store")
    export_dflash(store, released.trainable_state_dict(), cfg, aux_layer_ids=AUX_IDS, rel="release", dtype="float32")
    family = DFlash(TrainingSettings(), DFlashSettings(), mask_token_id=0)
    fresh = DFlashDrafter(cfg, vmap.d2t, vmap.t2d, embed_tokens=released.embed_tokens.weight)
    family.warm_start(fresh, store, "release")
    for name, tensor in released.trainable_state_dict().items():
        assert torch.equal(fresh.trainable_state_dict()[name], tensor), name
    other = DFlashDrafter(tiny_config(draft_vocab_size=128, num_layers=3), vmap.d2t, vmap.t2d)
    with pytest.raises(Exception, match="layers.2"):
        family.warm_start(other, store, "release")


# -- served by vLLM ---------------------------------------------------------------------------------------------

SERVED, EXTRA, K = 24, 8, 3


@pytest.fixture(scope="module")
def served_target(tmp_path_factory):
    """A confident tiny target, greedy text from it, and one shard of that text (as the EAGLE-3 serving test)."""
    pytest.importorskip("vllm")
    return confident_target_with_text(
        tmp_path_factory.mktemp("dflash-vllm"), prompts=16, new_tokens=SERVED + EXTRA, shard_rows=16
    )


def train_dflash(served_target) -> tuple[DFlashDrafter, Path, DFlash]:
    """Trained by the one training loop (`train_drafter` with the DFlash family), checkpointed and exported into
    the family's own directory."""
    target_dir, _, _, store, keys, vmap = served_target
    settings = TrainingSettings(lr=1e-2, warmup_steps=5, epochs=60.0, batch_tokens=256, checkpoint_every=1000,
                                heldout_rows=0)  # fmt: skip
    # Two layers, the demo's: vLLM must load and run every `layers.N.*` as trained, not the first alone.
    family = DFlash(settings, DFlashSettings(block_size=K, anchors_per_row=8, num_layers=2), mask_token_id=0)
    result = train_drafter(store, keys, vmap=vmap, target=target_of(target_dir), settings=settings, family=family,
                           log=lambda _: None)  # fmt: skip
    assert result.finished and result.model.config.block_size == K
    out = store.child(family.root)
    assert result.checkpoint.startswith("drafter/checkpoints/") and out.exists(f"{result.checkpoint}/state.json")
    assert not store.exists(result.checkpoint)  # nothing of it in EAGLE-3's directory
    trained_on = {SERVED_AS: family.served_as(result.config, result.aux_layer_ids)}  # as the trainer records it
    family.export(out, result.model.trainable_state_dict(), result.config, result.aux_layer_ids, EXPORT_DIR,
                  trained_on=trained_on)  # fmt: skip
    return result.model.eval(), out.local_path(EXPORT_DIR), family


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_vllm_serves_the_dflash_export_greedy_and_accepts_the_predicted_blocks(served_target):
    from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess

    target_dir, prompts, generated, store, keys, _ = served_target
    model, export_dir, family = train_dflash(served_target)
    assert json.loads((export_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    # Issue 54, item 3: the same weights, the config telling vLLM the other rotary layout.
    misaligned = export_dir.parent / "misaligned"
    shutil.copytree(export_dir, misaligned)
    config = json.loads((misaligned / "config.json").read_text())
    (misaligned / "config.json").write_text(json.dumps(config | {"is_neox_style": False}))
    # Issue 53: a drafter z-lab's own package saved, imported (its head the target's, over the whole vocabulary).
    weights = load_target_weights(target_of(target_dir))
    imported_dir = export_dir.parent / "imported"
    published_dflash(imported_dir.with_name("published"), mask=0, seed=2)
    imported = import_dflash(read_source(str(imported_dir.with_name("published"))), target_of(target_dir), weights)
    imported.publish(ArtifactStore(imported_dir.parent), imported_dir.name, write_extra=lambda _: None)
    *runs, served_misaligned, served_imported = generate_runs_in_subprocess(
        target_dir, prompts,
        [{"num_speculative_tokens": K}, {"num_speculative_tokens": 2},
         {"num_speculative_tokens": K, "draft_dir": misaligned},
         {"num_speculative_tokens": K, "draft_dir": imported_dir}],
        common={"draft_dir": export_dir, "method": "dflash", "max_tokens": SERVED},
    )  # fmt: skip
    served_as, suspects = trained_served_as(family, imported_dir)
    as_published, _ = family.load_as(imported_dir, weights.embed_tokens, served_as)
    check = replayed(family, as_published, store, keys, served_imported, K, suspects)
    assert served_imported.outputs == [g[PROMPT_LEN : PROMPT_LEN + SERVED] for g in generated] and check.passed, (
        check.describe()
    )
    want = [g[PROMPT_LEN : PROMPT_LEN + SERVED] for g in generated]
    for spec, k in zip(runs, (K, 2), strict=True):
        assert spec.outputs == want  # speculation keeps greedy
        assert_served_as_replayed(replayed(family, model, store, keys, spec, k))
    assert runs[0].mean_acceptance_length > 1.5, runs[0].to_json()
    _, suspects = trained_served_as(family, misaligned)
    check = replayed(family, model, store, keys, served_misaligned, K, suspects)
    assert served_misaligned.outputs == want and not check.passed, check.as_json()
    assert check.describe().endswith(
        f"they part at position {check.parted_at} (by more than {check.allowed:.3f}). Suspects: the export says "
        "is_neox_style False, the drafter trained with True"
    )
    # Decoding is timed per pass (engine start excluded): the speedup drafter_eval reports is a ratio of these.
    assert all(r.seconds > 0 and r.decode_tokens_per_s == sum(map(len, r.outputs)) / r.seconds for r in runs)
