"""acc_k by token class (drafter_eval): labelling answers, and scoring them with the training objective."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from eagle3_assets.demo.world import demo_world, single_fact_conversation, template_conversation
from eagle3_assets.drafter.data import BatchLoader, heldout_batches, index_samples
from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.evaluate import EvalReport
from eagle3_assets.drafter.family import Eagle3
from eagle3_assets.drafter.target_head import TargetHead, load_target_weights
from eagle3_assets.drafter.token_accuracy import TOKEN_CLASSES, ClassAccuracy, LabeledRow, class_accuracy, label_rows
from eagle3_assets.drafter.train import evaluate
from eagle3_assets.hidden_states import ExtractionRequest, extract_in_order
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.prompts import Prompt
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer

from .helpers import random_rows, target_of, tiny_llama, write_shard
from .test_drafter_model import make_model

pytestmark = pytest.mark.slow  # extracts and scores a drafter


def _prompt(pid: str, conversation, *, reference: bool = True) -> Prompt:
    extra = {"kind": conversation.kind}
    if reference:
        extra |= {"reference": conversation.assistant_text, "fact_spans": [list(s) for s in conversation.fact_spans]}
    return Prompt(pid, [{"role": "user", "content": conversation.prompt}], extra)


def test_answers_are_labelled_fact_template_or_off_reference(tiny_target_dir):
    tok = load_tokenizer(tiny_target_dir)
    entity = demo_world(0).heldout[0]
    fact = single_fact_conversation(entity, "food")
    template = template_conversation("add", random.Random(3))
    prompts = [_prompt("f", fact), _prompt("t", template), _prompt("wrong", fact)]
    prompt_ids = [[1, 3, 9, 2, 4]] * 3
    end = tok.convert_tokens_to_ids("<|end|>")
    right = tok.encode(fact.assistant_text, add_special_tokens=False) + [end]
    wrong = tok.encode(fact.assistant_text.replace(entity.attributes["food"], "nothing"), add_special_tokens=False)
    answers = [right, tok.encode(template.assistant_text, add_special_tokens=False) + [end], wrong]

    rows, off_reference = label_rows(prompts, prompt_ids, answers, tok)

    assert off_reference == ["wrong"]
    assert [r.input_ids for r in rows] == [p + a for p, a in zip(prompt_ids, answers)]
    fact_text = tok.decode([t for t, f in zip(rows[0].input_ids, rows[0].classes["fact"]) if f])
    # The first mentions only (the answer's repeat is copyable); this small BPE may split off the spaces.
    assert fact_text.replace(" ", "") == "".join(entity.profile())
    assert rows[0].classes["all"] == [False] * 5 + [True] * len(right)
    assert rows[0].classes["fact_prompt"] == rows[0].classes["all"] and not any(rows[0].classes["template"])
    assert rows[1].classes["template"] == rows[1].classes["all"]
    assert not any(rows[1].classes["fact"]) and not any(rows[1].classes["fact_prompt"])
    assert not any(rows[2].classes["fact"]) and sum(rows[2].classes["fact_prompt"]) == len(wrong)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A tiny target, 12 rows as a shard and as extracted samples, a drafter over its vocab."""
    root = tmp_path_factory.mktemp("token-accuracy")
    target = tiny_llama(root / "target")
    rows = random_rows(12, seed=4, min_len=10, max_len=20)
    store = ArtifactStore(root / "store")
    key = write_shard(store, target, rows, 0)
    extractor = HFExtractor(target_of(root / "target"), batch_tokens=64, device="cpu")
    requests = [ExtractionRequest(i, np.asarray(ids, dtype=np.int32)) for i, (ids, _) in enumerate(rows)]
    samples = extract_in_order(extractor, requests)
    weights = load_target_weights(target_of(root / "target"))
    return rows, store, key, samples, TargetHead.from_weights(weights)


def test_class_accuracy_is_the_training_objectives_acc_k_restricted_to_each_class(scored):
    rows, store, key, samples, head = scored
    model = make_model(seed=1)
    labelled = []
    for ids, mask in rows:
        # "template" and "fact" split the answer tokens by parity of position.
        even = [bool(m) and t % 2 == 0 for t, m in enumerate(mask)]
        odd = [bool(m) and t % 2 == 1 for t, m in enumerate(mask)]
        answer = [bool(m) for m in mask]
        labelled.append(LabeledRow(ids, {"all": answer, "template": even, "fact_prompt": answer, "fact": odd}))

    acc = class_accuracy(model, head, labelled, samples, pre_norm=False, num_steps=3, batch_rows=5)

    refs, _ = index_samples(store, [key])
    loader = BatchLoader(store, refs, batch_tokens=1000, seed=0)
    settings = TrainingSettings(ttt_steps=3, step_weight=0.8)
    trained = evaluate(
        model, head, loader, heldout_batches(refs, 1000), family=Eagle3(settings), device=torch.device("cpu")
    )
    assert acc["all"].acc == pytest.approx([trained[f"acc_{k}"] for k in range(3)], abs=1e-6)
    for k in range(3):
        n_all, n_even, n_odd = (acc[c].predictions[k] for c in ("all", "template", "fact"))
        assert n_all == n_even + n_odd > 0 and acc["fact_prompt"] == acc["all"]
        correct = acc["template"].acc[k] * n_even + acc["fact"].acc[k] * n_odd
        assert correct == pytest.approx(acc["all"].acc[k] * n_all)


def test_features_extracted_for_other_tokens_are_refused(scored):
    rows, _, _, samples, head = scored
    ids, mask = rows[0]
    row = LabeledRow([*ids[:-1], (ids[-1] + 1) % 256], {c: [bool(m) for m in mask] for c in TOKEN_CLASSES})
    with pytest.raises(EvaluationError, match="features of row 0 were extracted for other tokens"):
        class_accuracy(make_model(), head, [row], samples[:1], pre_norm=False, num_steps=1)


def test_report_metadata_lists_only_classes_present_in_the_eval_set():
    report = EvalReport(
        prompts=2, max_tokens=8,
        acceptance={"k3": 2.5, "k7": 3.0}, acceptance_zeroed={"k3": 1.25, "k7": 1.5},
        per_position={"k3": [0.5, 0.5, 0.5], "k7": [0.5] * 7},
        token_accuracy={
            "all": ClassAccuracy(acc=[0.75, 0.5], predictions=[40, 38]),
            "template": ClassAccuracy(acc=[0.0, 0.0], predictions=[0, 0]),
            "fact": ClassAccuracy(acc=[0.5, 0.25], predictions=[12, 12]),
        },
        off_reference=["p7"],
    )  # fmt: skip
    meta = report.as_metadata()
    assert {k: v for k, v in meta.items() if k.startswith("eval_")} == {
        "eval_acc_0_all": 0.75, "eval_acc_k_all": [0.75, 0.5], "eval_tokens_all": 40,
        "eval_acc_0_fact": 0.5, "eval_acc_k_fact": [0.5, 0.25], "eval_tokens_fact": 12,
        "eval_rows_off_reference": 1,
    }  # fmt: skip
    assert (meta["feature_gain_k3"], meta["feature_gain_k7"]) == (2.0, 2.0)
