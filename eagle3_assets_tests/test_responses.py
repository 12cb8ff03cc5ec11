import json

import pytest

from eagle3_assets.chat import TemplateKwargsError, generation_prompt_ids
from eagle3_assets.generation.base import Generated
from eagle3_assets.generation.hf import HFGenerator
from eagle3_assets.prompts import Prompt
from eagle3_assets.provenance import RETRY, Provenance, Record, current_problem, write_record
from eagle3_assets.reasoning import detect_format
from eagle3_assets.responses import (
    RESPONSES_FILE,
    Renderer,
    ResponsesError,
    generate_responses,
    part_path,
    read_responses,
    rows_to_generate,
)
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer, stop_token_ids

from .helpers import hybrid_demo_tokenizer

pytestmark = pytest.mark.slow  # generates with a model

SETTINGS = GenerationSettings(max_new_tokens=6, batch_size=4, rows_per_part=10, max_error_rate=0.5)


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", [{"role": "user", "content": f"What does entity {i} eat?"}]) for i in range(n)]


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetModel:
    return TargetModel.read(tiny_target_dir, aux_layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def generator(target):
    return HFGenerator(target, SETTINGS)


@pytest.fixture(scope="module")
def renderer(target) -> Renderer:
    tok = load_tokenizer(target)
    return Renderer(tok, detect_format(tok), stop_token_ids(target), max_seq_len=256)


def test_interrupted_generation_resumes_and_every_row_is_present_once(tmp_path, generator, renderer):
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(40)

    def stop_after_two_parts(progress):
        if progress.rows_done == 20:
            raise Interrupt

    with pytest.raises(Interrupt):
        generate_responses(store, prompts, generator, renderer, SETTINGS, on_progress=stop_after_two_parts)
    assert store.listdir("responses/parts") == ["part-00000.jsonl", "part-00001.jsonl"]
    assert not store.exists(RESPONSES_FILE)
    first_parts = [store.read_text(part_path(i)) for i in range(2)]

    summary = generate_responses(store, prompts, generator, renderer, SETTINGS)
    assert (summary.rows, summary.rows_reused, summary.rows_generated, summary.rows_failed) == (40, 20, 20, 0)
    assert [store.read_text(part_path(i)) for i in range(2)] == first_parts  # kept, not regenerated
    records = read_responses(store)
    assert [r["id"] for r in records] == [f"p{i}" for i in range(40)]
    assert [r["row"] for r in records] == list(range(40))
    for r in records:
        assert r["messages"][0] == {"role": "user", "content": f"What does entity {r['row']} eat?"}
        assistant = r["messages"][1]
        assert assistant["role"] == "assistant" and set(assistant) == {"role", "content", "reasoning_content"}
        # The prompt exactly as the engine got it, and exactly the 6 tokens it produced (cut by the budget).
        assert r["prompt_token_ids"] == generation_prompt_ids(renderer.tokenizer, r["messages"][:1])
        assert len(r["completion_token_ids"]) == r["usage"]["completion_tokens"] == 6 and r["finish_reason"] == "length"
        assert r["usage"]["prompt_tokens"] == len(r["prompt_token_ids"])


def test_a_corrupt_part_and_a_part_of_the_text_only_format_are_regenerated(tmp_path, generator, renderer):
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(22)
    generate_responses(store, prompts, generator, renderer, SETTINGS)
    store.write_text(part_path(1), '{"id": "p10"}\n{"id": "p11", "trunc')
    old = [{k: v for k, v in json.loads(line).items() if not k.endswith("_token_ids")}
           for line in store.read_text(part_path(2)).splitlines()]  # fmt: skip
    store.write_text(part_path(2), "".join(json.dumps(r) + "\n" for r in old))
    summary = generate_responses(store, prompts, generator, renderer, SETTINGS)
    assert (summary.rows_reused, summary.rows_generated) == (10, 12)
    records = read_responses(store)
    assert [r["id"] for r in records] == [f"p{i}" for i in range(22)]
    assert all(len(r["completion_token_ids"]) == 6 for r in records)


def test_failed_rows_are_recorded_named_and_retried(tmp_path, generator, renderer):
    store = ArtifactStore(tmp_path / "root")
    too_long = "plums " * 300  # more tokens than max_seq_len (256): no room for an answer
    prompts = make_prompts(3) + [Prompt("long", [{"role": "user", "content": too_long}])]
    summary = generate_responses(store, prompts, generator, renderer, SETTINGS)
    assert summary.rows_failed == 1 and summary.rows_generated == 4
    assert summary.first_errors[0].startswith("row 3 (id long): prompt has ")
    assert summary.first_errors[0].endswith("tokens, max_seq_len is 256: no room for an answer in a training row (not generated)")
    failed = read_responses(store)[3]
    assert failed["finish_reason"] == "error" and failed["completion_token_ids"] == []
    assert [m["role"] for m in failed["messages"]] == ["user"]

    strict = SETTINGS.model_copy(update={"max_error_rate": 0.1})
    with pytest.raises(ResponsesError, match=r"1 of 4 rows failed \(25\.0%\), above generation\.max_error_rate \(10\.0%\)"):
        generate_responses(store, prompts, generator, renderer, strict)
    # nothing lost: the file still holds every row, and only the failed row was retried
    assert [json.loads(line)["id"] for line in store.read_text(RESPONSES_FILE).splitlines()] == ["p0", "p1", "p2", "long"]


def test_rows_of_a_store_made_before_provenance_are_generated_again_and_it_is_said(tmp_path, generator, renderer):
    """Issue 44, item 6: rows written before rows were stamped with what made them were regenerated without a word;
    they still are (what made them is unknown), and the log says how many, and why, before generating."""
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(12)
    generate_responses(store, prompts, generator, renderer, SETTINGS)
    old = [{k: v for k, v in json.loads(line).items() if k != "made_by"} for line in store.read_text(part_path(0)).splitlines()]
    store.write_text(part_path(0), "".join(json.dumps(r) + "\n" for r in old))  # as an earlier version wrote it
    lines: list[str] = []
    summary = generate_responses(store, prompts, generator, renderer, SETTINGS, log=lines.append)
    assert (summary.rows_reused, summary.rows_generated, summary.rows_failed) == (2, 10, 0)
    assert lines[0] == (
        "responses: 10 of 12 rows generated before are generated again: 10 made before provenance was kept (no "
        "record of the target and settings that made it): generated again"
    )
    assert all("made_by" in r for r in read_responses(store))


class FailsOnce:
    """A generator whose engine fails the first prompt of its first call (a dropped request), then works."""

    def __init__(self, inner):
        self.inner, self.name, self.stop_token_ids, self.calls = inner, inner.name, inner.stop_token_ids, 0

    def generate(self, prompts):
        self.calls += 1
        out = self.inner.generate(prompts)
        return [Generated.failed("the engine dropped the request"), *out[1:]] if self.calls == 1 else out

    def close(self) -> None:
        pass


def test_rows_the_engine_failed_keep_the_asset_due_and_are_retried_in_place(tmp_path, generator, renderer):
    """Issue 44, item 9: a row the engine failed is retried by the next materialization (its record says why it is
    due), in its own place; a prompt that cannot be generated as set is not counted for a retry."""
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(3) + [Prompt("long", [{"role": "user", "content": "plums " * 300}])]
    first = generate_responses(store, prompts, FailsOnce(generator), renderer, SETTINGS)
    assert (first.rows_failed, first.rows_to_retry) == (2, 1)
    assert first.retry == (
        "1 row(s) failed in the engine and are retried on the next materialization (first: row 0 (id p0): the engine "
        "dropped the request; row 3 (id long): prompt has "
    ) + first.first_errors[1].split("prompt has ", 1)[1] + ")"
    assert [r.get("retryable") for r in read_responses(store)] == [True, None, None, False]
    want = Provenance("responses", {}, {}, 1)
    write_record(store, Record(want, "v1", {RETRY: first.retry}))
    assert current_problem(store, want) == first.retry  # due, and the start command and the daemon say why

    again = generate_responses(store, prompts, generator, renderer, SETTINGS)
    assert (again.rows_failed, again.rows_to_retry, again.retry, again.rows_reused) == (1, 0, None, 2)
    records = read_responses(store)
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "long"] and len(records[0]["completion_token_ids"]) == 6
    write_record(store, Record(want, "v2"))
    assert current_problem(store, want) is None


class FailsRow:
    """A generator whose engine fails every send of one prompt (a server whose context is below the row), and keeps
    count of the prompts it was sent."""

    def __init__(self, inner, bad: list[int]):
        self.inner, self.name, self.stop_token_ids, self.bad, self.sent = inner, inner.name, inner.stop_token_ids, bad, 0

    def generate(self, prompts):
        self.sent += len(prompts)
        out = self.inner.generate(prompts)
        return [Generated.failed("HTTP 400: this model's maximum context length is 16") if p == self.bad else g
                for p, g in zip(prompts, out, strict=True)]  # fmt: skip

    def close(self) -> None:
        pass


def test_a_row_the_engine_keeps_failing_is_given_up_after_max_row_attempts_and_keeps_nothing_due(
    tmp_path, generator, renderer
):
    """Issue 52, item 4: every engine error was retryable and nothing counted the attempts, so one row the engine
    always fails kept `responses` due, and everything after it waiting, forever. After `generation.max_row_attempts`
    sends it is reported as not generated, with its last error; nothing stays due for it and it is not sent again,
    until the cap is raised or what makes the row changes."""
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(3)
    engine = FailsRow(generator, generation_prompt_ids(renderer.tokenizer, prompts[1].messages))
    capped = SETTINGS.model_copy(update={"max_row_attempts": 2})
    want = Provenance("responses", {}, {}, 1)

    first = generate_responses(store, prompts, engine, renderer, capped)
    assert (first.rows_failed, first.rows_to_retry, first.rows_given_up, first.given_up) == (1, 1, 0, [])
    assert first.retry == (
        "1 row(s) failed in the engine and are retried on the next materialization (first: row 1 (id p1): HTTP 400: "
        "this model's maximum context length is 16)"
    )
    second = generate_responses(store, prompts, engine, renderer, capped)
    given_up = (
        "row 1 (id p1): not generated: the engine failed it 2 times (generation.max_row_attempts 2), last: HTTP 400: "
        "this model's maximum context length is 16"
    )
    assert (second.rows_failed, second.rows_to_retry, second.rows_given_up, second.retry) == (1, 0, 1, None)
    assert second.given_up == second.first_errors == [given_up]
    write_record(store, Record(want, "v2"))  # as `responses` records it: no retry kept
    assert current_problem(store, want) is None  # `tokenized` and what follows go on
    records = read_responses(store)
    assert [(r["error"], r.get("attempts")) for r in records] == [
        (None, None), ("HTTP 400: this model's maximum context length is 16", 2), (None, None)
    ]  # fmt: skip

    sent = engine.sent
    third = generate_responses(store, prompts, engine, renderer, capped)
    assert (engine.sent, third.rows_generated, third.rows_given_up, third.retry) == (sent, 0, 1, None)
    assert rows_to_generate(store, prompts, renderer.stamps, 10, max_row_attempts=2) == 0  # `--plan` agrees
    # A raised cap sends it again; so does a change of what makes the row (another stamp starts the count over).
    assert rows_to_generate(store, prompts, renderer.stamps, 10, max_row_attempts=3) == 1
    fourth = generate_responses(store, prompts, engine, renderer, SETTINGS.model_copy(update={"max_row_attempts": 3}))
    assert (engine.sent, fourth.rows_given_up, read_responses(store)[1]["attempts"]) == (sent + 1, 1, 3)


def test_parts_rendered_with_other_template_kwargs_are_regenerated_and_an_unread_kwarg_is_refused(
    tmp_path, generator, target, renderer
):
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(4)
    tok = hybrid_demo_tokenizer(target)
    thinking = Renderer(tok, renderer.reasoning, renderer.stop_token_ids, 256)
    assert generate_responses(store, prompts, generator, thinking, SETTINGS).modes == {"{}": 4}
    off = Renderer(tok, renderer.reasoning, renderer.stop_token_ids, 256, {"enable_thinking": False})
    summary = generate_responses(store, prompts, generator, off, SETTINGS)
    assert (summary.rows_reused, summary.rows_generated, summary.modes) == (0, 4, {'{"enable_thinking": false}': 4})
    for r in read_responses(store):
        assert r["chat_template_kwargs"] == {"enable_thinking": False}
        assert tok.decode(r["prompt_token_ids"]).endswith("<|assistant|><think></think>")
    # The demo's own template never reads it: refused before anything is generated.
    plain = Renderer(renderer.tokenizer, renderer.reasoning, renderer.stop_token_ids, 256, {"enable_thinking": False})
    with pytest.raises(TemplateKwargsError, match=r"^generation.chat_template_kwargs: chat_template_kwargs 'enable_thi"):
        generate_responses(ArtifactStore(tmp_path / "other"), prompts, generator, plain, SETTINGS)
    assert not ArtifactStore(tmp_path / "other").exists("responses")
