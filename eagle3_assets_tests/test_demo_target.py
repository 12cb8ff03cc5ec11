"""The embedded demo target: its world, tokenizer, prompt sets and model build."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_assets.chat import span_token_flags
from eagle3_assets.demo.prompts import (
    EVAL_PROMPTS,
    demo_extra_eval_conversations,
    demo_extra_eval_prompts,
    demo_prompt_sets,
    demo_references,
    reference_response,
)
from eagle3_assets.demo.target import (
    BUILD_INFO_FILE,
    build_demo_target,
    read_build_info,
    tokenizer_corpus,
)
from eagle3_assets.demo.tokenizer import (
    CHAT_TEMPLATE,
    TOKEN_IDS,
    render_prompt,
    render_turn,
    train_tokenizer,
)
from eagle3_assets.demo.world import (
    ATTRIBUTE_NAMES,
    Entity,
    build_world,
    demo_world,
    pair_fact_conversation,
    single_fact_conversation,
    template_conversation,
)
from eagle3_assets.provenance import target_identity
from eagle3_assets.settings import DemoSettings


UNTRAINED_FACT_VALUES = 0.05  # an untrained target's recall of attribute values is below this


def demo_settings(**overrides) -> DemoSettings:
    # model_construct: settings.py bounds train_steps at >= 1, and the untrained build needs 0.
    return DemoSettings.model_construct(**(DemoSettings().model_dump() | overrides))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(tokenizer_corpus(demo_world(0), 0), 1024)


# -- world ------------------------------------------------------------------


def test_world_is_a_pure_function_of_the_seed():
    w = demo_world(0)
    assert w == demo_world(0)
    assert w.entities[0] == Entity(
        name="Mirenor",
        attributes={"color": "white", "city": "Ilmar", "food": "fish", "pet": "cat", "tool": "hammer", "number": "33"},
        split="train",
    )
    assert [e.name for e in w.heldout[:3]] == ["Tholobo", "Mikodi", "Quipabo"]
    other = demo_world(1)
    assert other.entities[0].name == "Gaquibo"
    assert [e.name for e in other.entities] != [e.name for e in w.entities]


def test_entities_are_split_disjointly_with_distinct_names():
    w = demo_world(0)
    train, heldout = {e.name for e in w.train}, {e.name for e in w.heldout}
    assert (len(train), len(heldout)) == (200, 50)
    assert not train & heldout
    assert len(train | heldout) == len(w.entities) == 250
    assert all(list(e.attributes) == list(ATTRIBUTE_NAMES) for e in w.entities)


def test_build_world_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_entities: need at least 2"):
        build_world(0, num_entities=1)
    with pytest.raises(ValueError, match="heldout_fraction: must be strictly between 0 and 1, got 1.0"):
        build_world(0, heldout_fraction=1.0)


def test_single_fact_conversation_marks_first_mentions_of_facts():
    c = single_fact_conversation(demo_world(0).entities[0], "food")
    assert c.prompt == "What does Mirenor eat?"
    assert c.assistant_text == "<think>white Ilmar fish cat hammer 33</think>It eats fish."
    assert c.fact_spans == ((7, 12), (13, 18), (19, 23), (24, 27), (28, 34), (35, 37))
    assert c.fact_texts() == ["white", "Ilmar", "fish", "cat", "hammer", "33"]  # the repeat in the answer is not marked


def test_pair_question_answer_follows_from_the_two_profiles():
    a, b = demo_world(0).entities[:2]  # both live in Ilmar; numbers 33 and 26
    same = pair_fact_conversation(a, b, "same_city")
    assert same.prompt == "Do Mirenor and Bothojo live in the same city?"
    assert same.reasoning == "Mirenor: white Ilmar fish cat hammer 33. Bothojo: orange Ilmar apples hen needle 26."
    assert same.content == "Yes."
    assert same.fact_texts() == ["white", "Ilmar", "fish", "cat", "hammer", "33", "orange", "Ilmar", "apples", "hen", "needle", "26"]
    assert pair_fact_conversation(b, a, "larger_number").content == "Mirenor."
    with pytest.raises(ValueError, match="two different entities, got Mirenor twice"):
        pair_fact_conversation(a, a, "same_city")


def test_template_answers_are_derivable_from_the_prompt():
    rng = random.Random(0)
    count = template_conversation("count", rng)
    assert (count.prompt, count.assistant_text) == (
        "How many words are in: shoe kiwi book boat",
        "<think>shoe kiwi book boat</think>4",
    )
    add = template_conversation("add", random.Random(3))
    x, y = (int(t) for t in add.prompt.removeprefix("What is ").removesuffix("?").split(" + "))
    assert add.content == str(x + y) and add.fact_spans == ()
    rev = template_conversation("reverse", random.Random(1))
    assert rev.content.split() == rev.prompt.removeprefix("Reverse these words: ").split()[::-1]
    with pytest.raises(ValueError, match="unknown template task 'sort'"):
        template_conversation("sort", rng)


# -- prompt sets ------------------------------------------------------------


def test_prompt_sets_are_deterministic_and_sized():
    demo = DemoSettings(num_prompts=2000)
    pipeline, evaluation = demo_prompt_sets(demo)
    assert len(pipeline) == demo.num_prompts == 2000 and len(evaluation) == EVAL_PROMPTS == 64
    assert pipeline[0] == {"id": "demo-0000", "prompt": "What tool does Reshare use?", "kind": "fact"}
    reference = "<think>purple Harrow soup rat hammer 22</think>It is purple."
    assert evaluation[0] == {
        "id": "eval-00",
        "prompt": "What color is Xuquilin?",
        "kind": "fact",
        "reference": reference,  # drafter_eval scores the fact spans of the answer apart
        "fact_spans": [[7, 13], [14, 20], [21, 25], [26, 29], [30, 36], [37, 39]],
    }
    assert [reference[a:b] for a, b in evaluation[0]["fact_spans"]] == "purple Harrow soup rat hammer 22".split()
    assert [p["kind"] for p in pipeline].count("fact") == 1200
    assert [p["kind"] for p in evaluation].count("fact") == 48
    ids = [p["id"] for p in pipeline + evaluation]
    assert len(set(ids)) == len(ids)
    assert len({p["prompt"] for p in pipeline + evaluation}) == 2064  # no prompt asked twice
    # The evaluation set does not depend on how many pipeline prompts there are.
    assert demo_prompt_sets(DemoSettings(num_prompts=45))[1] == evaluation
    other = demo_prompt_sets(DemoSettings(seed=1))[0]
    assert [p["prompt"] for p in other] != [p["prompt"] for p in pipeline]


def test_eval_prompts_name_only_heldout_entities_and_pipeline_only_train():
    world = demo_world(0)
    pipeline, evaluation = demo_prompt_sets(DemoSettings())
    refs = demo_references(DemoSettings())

    def named(prompt: str) -> set[str]:
        return {e.split for e in world.entities if e.name in prompt}

    assert all(named(p["prompt"]) == {"heldout"} for p in evaluation if p["kind"] == "fact")
    assert all(named(p["prompt"]) == {"train"} for p in pipeline if p["kind"] == "fact")
    assert all(not named(p["prompt"]) for p in pipeline + evaluation if p["kind"] == "template")
    heldout_values = {(e.name, tuple(e.profile())) for e in world.heldout}
    for p in evaluation:
        ref = refs[p["id"]]
        assert ref.prompt == p["prompt"]
        for name in ref.entities:  # the facts in the reference are exactly those of the named entities
            assert (name, tuple(world.entity(name).profile())) in heldout_values


def test_extra_eval_prompts_are_held_out_new_and_leave_both_sets_as_they_were():
    world, demo = demo_world(0), DemoSettings()
    before = demo_prompt_sets(demo)
    extra = demo_extra_eval_prompts(demo, 448)
    assert demo_prompt_sets(demo) == before and demo_extra_eval_prompts(demo, 448) == extra
    assert extra[0] == {"id": "extra-0", "prompt": "Where does Quifenor live?", "kind": "fact"}
    assert [p["kind"] for p in extra].count("fact") == 336  # the eval set's share, 3 in 4
    pipeline, evaluation = before
    assert not {p["prompt"] for p in extra} & {p["prompt"] for p in pipeline + evaluation}
    # 262 single questions about held-out entities are left after the eval set's: each once, then a few repeats.
    assert len({p["prompt"] for p in extra}) == 441
    named = [{e.split for e in world.entities if e.name in p["prompt"]} for p in extra if p["kind"] == "fact"]
    assert all(n == {"heldout"} for n in named)
    # The same prompts with the world's answers (benchmarks/bench_demo_answers.py scores targets against them).
    answered = demo_extra_eval_conversations(demo, 448)
    assert [{"id": i, "prompt": c.prompt, "kind": c.kind} for i, c in answered] == extra
    quifenor = world.entity("Quifenor")
    assert answered[0][1].assistant_text == single_fact_conversation(quifenor, "city").assistant_text


def test_reference_response_by_id():
    demo = DemoSettings(num_prompts=2000)
    ref = reference_response(demo, "demo-0001")
    assert ref.prompt == "Where does Padaryen live?"
    assert ref.assistant_text == "<think>yellow Fenwick beans goat ladder 57</think>It lives in Fenwick."
    with pytest.raises(KeyError, match="'demo-9999' is not a demo prompt id for seed 0 and 2000 prompts"):
        reference_response(demo, "demo-9999")


def test_more_prompts_than_questions_repeats_rather_than_failing():
    pipeline, _ = demo_prompt_sets(DemoSettings(num_prompts=3000))  # 1,800 fact rows > 1,200 single questions
    assert len(pipeline) == 3000 and pipeline[-1]["id"] == "demo-2999"


def test_fact_tokens_are_at_least_40_percent_of_fact_row_answers(tok):
    refs = demo_references(DemoSettings())
    fact = total = 0
    for ref in refs.values():
        if ref.kind == "fact":
            _, flags = span_token_flags(tok, ref.assistant_text, ref.fact_spans)
            fact += sum(flags)
            total += len(flags) + 1  # + <|end|>
    assert fact / total >= 0.40, f"fact tokens are {fact / total:.1%} of assistant tokens on fact rows"


# -- tokenizer --------------------------------------------------------------


def test_control_tokens_are_single_tokens_with_fixed_ids(tok):
    assert TOKEN_IDS == {
        "<|pad|>": 0, "<|begin|>": 1, "<|end|>": 2, "<|user|>": 3, "<|assistant|>": 4, "<think>": 5, "</think>": 6,
    }  # fmt: skip
    for text, i in TOKEN_IDS.items():
        assert tok.encode(text, add_special_tokens=False) == [i]
        assert tok.convert_ids_to_tokens(i) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert len(tok) == 1024  # learned merges, then <|reserved_k|> fill
    assert tok.convert_ids_to_tokens(1023).startswith("<|reserved_")
    assert 1 not in tok("What is 2 + 3?")["input_ids"]  # no BOS added outside the template


def test_think_tags_survive_skipping_special_tokens(tok):
    ids = tok.encode(render_turn("Hi", "2 + 3 = 5", "5"), add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "Hi<think>2 + 3 = 5</think>5"


def test_entity_names_split_into_several_tokens(tok):
    lengths = [len(tok.encode(" " + e.name, add_special_tokens=False)) for e in demo_world(0).entities]
    assert min(lengths) == 2 and max(lengths) == 4
    assert tok.convert_ids_to_tokens(tok.encode(" Mirenor", add_special_tokens=False)) == ["ĠMi", "ren", "or"]


TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 = 5"},
    {"role": "user", "content": "What does Mirenor eat?"},
    {"role": "assistant", "content": "It eats fish.", "reasoning_content": "white Ilmar fish cat hammer 33"},
]


def test_chat_template_renders_a_two_turn_conversation_exactly(tok):
    assert tok.apply_chat_template(TWO_TURNS, tokenize=False) == (
        "<|begin|><|user|>What is 2 + 3?<|end|><|assistant|><think>2 + 3 = 5</think>5<|end|>"
        "<|user|>What does Mirenor eat?<|end|><|assistant|><think>white Ilmar fish cat hammer 33</think>It eats fish.<|end|>"
    )
    assert tok.apply_chat_template(TWO_TURNS[:1], tokenize=False, add_generation_prompt=True) == render_prompt(
        "What is 2 + 3?"
    )
    assert tok.apply_chat_template(TWO_TURNS[:2], tokenize=False) == render_turn("What is 2 + 3?", "2 + 3 = 5", "5")
    # vLLM returns reasoning as `reasoning`; an assistant turn without any renders an empty <think></think>.
    vllm_style = [TWO_TURNS[0], {"role": "assistant", "content": "5", "reasoning": "2 + 3 = 5"}]
    assert tok.apply_chat_template(vllm_style, tokenize=False) == render_turn("What is 2 + 3?", "2 + 3 = 5", "5")
    bare = [TWO_TURNS[0], {"role": "assistant", "content": "5"}]
    assert tok.apply_chat_template(bare, tokenize=False).endswith("<|assistant|><think></think>5<|end|>")


def test_generation_prompt_is_a_prefix_of_the_answered_conversation(tok):
    for i, message in enumerate(TWO_TURNS):
        if message["role"] != "assistant":
            continue
        asked = tok.apply_chat_template(TWO_TURNS[:i], tokenize=False, add_generation_prompt=True)
        answered = tok.apply_chat_template(TWO_TURNS[: i + 1], tokenize=False)
        assert answered.startswith(asked)
        asked_ids = tok.encode(asked, add_special_tokens=False)
        assert tok.encode(answered, add_special_tokens=False)[: len(asked_ids)] == asked_ids


def test_system_messages_are_refused_by_name(tok):
    with pytest.raises(Exception, match="knows only user and assistant messages, got role system"):
        tok.apply_chat_template([{"role": "system", "content": "Be brief."}, TWO_TURNS[0]], tokenize=False)


def test_span_token_flags_mark_tokens_overlapping_spans(tok):
    c = single_fact_conversation(demo_world(0).entities[0], "food")
    tokens = tok.convert_ids_to_tokens(tok.encode(c.assistant_text, add_special_tokens=False))
    _, flags = span_token_flags(tok, c.assistant_text, c.fact_spans)
    assert [t for t, f in zip(tokens, flags) if f] == ["white", "ĠIlmar", "Ġfish", "Ġcat", "Ġhammer", "Ġ33"]
    assert [t for t, f in zip(tokens, flags) if not f] == ["<think>", "</think>", "It", "Ġeats", "Ġfish", "."]


def test_tokenizer_training_is_deterministic(tok):
    again = train_tokenizer(tokenizer_corpus(demo_world(0), 0), 1024)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_tokenizer_rejects_a_vocab_too_small_for_bytes():
    with pytest.raises(ValueError, match="vocab_size: 200 cannot hold the 7 control tokens and the 256 byte tokens"):
        train_tokenizer(["hello"], 200)


# -- target build -----------------------------------------------------------


def test_untrained_build_writes_a_loadable_model_dir(tmp_path: Path):
    out = tmp_path / "target"
    logs: list[str] = []
    info = build_demo_target(out, demo_settings(train_steps=0), log=logs.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temporaries left beside it
    assert (info.path, info.vocab_size, info.num_layers, info.hidden_size, info.head_dim) == (str(out), 1024, 4, 128, 32)
    assert info.train_loss is None and info.fact_accuracy_train == 0.0
    assert read_build_info(out) == replace(info, build_seconds=None)  # the file keeps what the target is, not the run
    assert any("tokenizer trained, 1024 ids" in line for line in logs)

    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads) == (4, 128, 32, 4)
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings >= 1024
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1024, 1, 2, 0)
    assert next(model.parameters()).dtype == torch.float32
    assert (model.generation_config.do_sample, model.generation_config.eos_token_id) == (False, 2)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.apply_chat_template(TWO_TURNS[:2], tokenize=False) == render_turn("What is 2 + 3?", "2 + 3 = 5", "5")
    assert loaded.encode("<think></think>", add_special_tokens=False) == [5, 6]
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)
    assert json.loads((out / BUILD_INFO_FILE).read_text())["train_steps"] == 0
    # The template lives with the saved tokenizer, wherever transformers puts it.
    assert CHAT_TEMPLATE in "".join(p.read_text() for p in out.iterdir() if p.suffix in (".json", ".jinja"))


def test_rebuild_replaces_the_dir_with_identical_files(tmp_path: Path):
    out = tmp_path / "target"
    build_demo_target(out, demo_settings(train_steps=0), log=lambda _: None)
    first = load_file(out / "model.safetensors")
    tokenizer_json = (out / "tokenizer.json").read_text()
    (out / "stale.txt").write_text("from an older build")
    build_demo_target(out, demo_settings(train_steps=0), log=lambda _: None)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    second = load_file(out / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert (out / "tokenizer.json").read_text() == tokenizer_json


def test_two_builds_are_one_target_identity(tmp_path: Path):
    # Issue 43, item 6: the build info file held the build's temporary path and its seconds, so every fresh
    # demo of one commit was a new target (its identity digests every content file).
    a = build_demo_target(tmp_path / "a", demo_settings(train_steps=0), log=lambda _: None)
    b = build_demo_target(tmp_path / "b", demo_settings(train_steps=0), log=lambda _: None)
    assert a.build_seconds is not None and b.build_seconds is not None  # still reported by the build itself
    assert target_identity(str(tmp_path / "a")) == target_identity(str(tmp_path / "b"))
    assert "build_seconds" not in json.loads((tmp_path / "a" / BUILD_INFO_FILE).read_text())


def test_the_build_trains_on_one_thread_whatever_the_process_has(tmp_path: Path):
    # Issue 43, item 6: a build on the threads the process was given let each machine's core count (or
    # OMP_NUM_THREADS) into the float reduction order. One thread, then the caller's count back.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    try:
        demo = demo_settings(train_steps=1, hidden_size=64)
        build_demo_target(tmp_path / "t", demo, log=lambda _: seen.append(torch.get_num_threads()))
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_build_failing_midway_leaves_nothing(tmp_path: Path):
    out = tmp_path / "target"

    def fail_when_saving(line: str) -> None:
        if "saving to" in line:
            raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        build_demo_target(out, demo_settings(train_steps=0), log=fail_when_saving)
    assert list(tmp_path.iterdir()) == []


def test_a_build_failing_midway_keeps_the_previous_target(tmp_path: Path):
    out = tmp_path / "target"
    build_demo_target(out, demo_settings(train_steps=0), log=lambda _: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail_when_saving(line: str) -> None:
        if "saving to" in line:
            raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        build_demo_target(out, demo_settings(train_steps=0, seed=1), log=fail_when_saving)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_invalid_settings_are_named_and_leave_nothing(tmp_path: Path):
    with pytest.raises(ValueError, match=r"demo.hidden_size: 100 is not a multiple of demo.head_dim \(32\)"):
        build_demo_target(tmp_path / "target", demo_settings(train_steps=0, hidden_size=100), log=lambda _: None)
    with pytest.raises(ValueError, match="demo.train_steps: must be >= 0, got -1"):
        build_demo_target(tmp_path / "target", demo_settings(train_steps=-1), log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_an_untrained_target_recalls_no_facts(tmp_path: Path):
    """What brief training is measured against: the trained demo target's recall is asserted on the target the demo
    itself builds (test_demo_quality.py, `test_the_demo_target_trained_briefly_recalls_facts`)."""
    untrained = build_demo_target(tmp_path / "untrained", demo_settings(train_steps=0), log=lambda _: None)
    assert untrained.fact_value_accuracy < UNTRAINED_FACT_VALUES  # measured: 0.002 of attribute values
    assert untrained.train_loss is None
