"""Target logits from stored final states: the final norm applied exactly once, compared with HF."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_assets.drafter.data import BatchLoader, index_samples
from eagle3_assets.target import TargetModelError
from eagle3_assets.drafter.target_head import TargetHead, TargetWeightsError, load_target_weights
from eagle3_assets.storage import ArtifactStore

from .helpers import random_rows, target_of, tiny_llama, write_shard


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    return d, tiny_llama(d)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("norm", ["post_norm", "pre_norm"])
def test_logits_from_stored_states_equal_hf_logits(tmp_path, target, norm):
    target_dir, model = target
    store = ArtifactStore(tmp_path / "store")
    rows = random_rows(3, seed=5)
    key = write_shard(store, model, rows, 0, norm=norm)
    samples, _ = index_samples(store, [key])
    batch = BatchLoader(store, samples, batch_tokens=1000, seed=0).load([0, 1, 2])
    assert batch.pre_norm.tolist() == [norm == "pre_norm"] * 3
    head = TargetHead.from_weights(load_target_weights(target_of(target_dir)))
    logits = head.logits(batch.last, batch.pre_norm)
    for i, (ids, _) in enumerate(rows):
        torch.testing.assert_close(logits[i, : len(ids)], hf_logits(model, ids), rtol=1e-5, atol=1e-5)
    # The wrong convention gives different logits: the test above would catch a double or missing norm.
    wrong = head.logits(batch.last, ~batch.pre_norm)
    assert not torch.allclose(wrong[0, : len(rows[0][0])], hf_logits(model, rows[0][0]), atol=1e-3)


def test_targets_restrict_to_the_draft_vocab(target):
    target_dir, model = target
    ids = random_rows(1, seed=2)[0][0]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[::2] = True
    head = TargetHead.from_weights(load_target_weights(target_of(target_dir)))
    tg = head.targets(out.hidden_states[-1], False, t2d, chunk_tokens=5)
    full = out.logits[0]
    torch.testing.assert_close(tg.probs[0], torch.softmax(full[:, ::2], -1), rtol=1e-5, atol=1e-6)
    assert tg.argmax[0].tolist() == full.argmax(-1).tolist()
    assert tg.in_draft[0].tolist() == [int(a) % 2 == 0 for a in full.argmax(-1)]


def test_tied_and_sharded_targets_load(tmp_path):
    tied = tiny_llama(tmp_path / "tied", tie=True)
    w = load_target_weights(target_of(tmp_path / "tied"))
    assert torch.equal(w.lm_head, tied.model.embed_tokens.weight.detach())
    model = tiny_llama(tmp_path / "one", seed=1)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    w = load_target_weights(target_of(tmp_path / "sharded"))
    assert torch.equal(w.lm_head, model.lm_head.weight.detach())
    assert torch.equal(w.final_norm, model.model.norm.weight.detach())
    assert w.rms_norm_eps == 1e-5


def test_missing_head_is_named(tmp_path):
    tiny_llama(tmp_path / "t")
    index = tmp_path / "t" / "model.safetensors.index.json"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "t" / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if n != "lm_head.weight"]
    index.write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    with pytest.raises(TargetWeightsError, match=r"lm_head \(tie_word_embeddings is false\) not found .*'lm_head.weight'"):
        load_target_weights(target_of(tmp_path / "t"))
    with pytest.raises(TargetModelError, match="is not a readable directory"):
        load_target_weights(target_of(tmp_path / "nowhere"))
