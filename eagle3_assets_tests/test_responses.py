import json

import pytest

from eagle3_assets.generation.hf import HFGenerator
from eagle3_assets.prompts import Prompt
from eagle3_assets.responses import RESPONSES_FILE, ResponsesError, generate_responses, part_path, read_responses
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.storage import ArtifactStore

SETTINGS = GenerationSettings(max_new_tokens=6, batch_size=4, rows_per_part=10, max_error_rate=0.5)


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", [{"role": "user", "content": f"What does entity {i} eat?"}]) for i in range(n)]


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def generator(tiny_target_dir):
    return HFGenerator(tiny_target_dir, SETTINGS)


def test_interrupted_generation_resumes_and_every_row_is_present_once(tmp_path, generator):
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(40)

    def stop_after_two_parts(progress):
        if progress.rows_done == 20:
            raise Interrupt

    with pytest.raises(Interrupt):
        generate_responses(store, prompts, generator, SETTINGS, on_progress=stop_after_two_parts)
    assert store.listdir("responses/parts") == ["part-00000.jsonl", "part-00001.jsonl"]
    assert not store.exists(RESPONSES_FILE)
    first_parts = [store.read_text(part_path(i)) for i in range(2)]

    summary = generate_responses(store, prompts, generator, SETTINGS)
    assert (summary.rows, summary.rows_reused, summary.rows_generated, summary.rows_failed) == (40, 20, 20, 0)
    assert [store.read_text(part_path(i)) for i in range(2)] == first_parts  # kept, not regenerated
    records = read_responses(store)
    assert [r["id"] for r in records] == [f"p{i}" for i in range(40)]
    assert [r["row"] for r in records] == list(range(40))
    for r in records:
        assert r["messages"][0] == {"role": "user", "content": f"What does entity {r['row']} eat?"}
        assistant = r["messages"][1]
        assert assistant["role"] == "assistant" and set(assistant) == {"role", "content", "reasoning_content"}
        assert r["usage"]["completion_tokens"] == 6 and r["finish_reason"] == "length"


def test_a_corrupt_part_is_regenerated(tmp_path, generator):
    store = ArtifactStore(tmp_path / "root")
    prompts = make_prompts(12)
    generate_responses(store, prompts, generator, SETTINGS)
    store.write_text(part_path(1), '{"id": "p10"}\n{"id": "p11", "trunc')
    summary = generate_responses(store, prompts, generator, SETTINGS)
    assert (summary.rows_reused, summary.rows_generated) == (10, 2)
    assert [r["id"] for r in read_responses(store)] == [f"p{i}" for i in range(12)]


def test_failed_rows_are_recorded_counted_and_retried(tmp_path, generator):
    store = ArtifactStore(tmp_path / "root")
    too_long = "plums " * 2500  # more tokens than the demo target's 2048-token context
    prompts = make_prompts(3) + [Prompt("long", [{"role": "user", "content": too_long}])]
    summary = generate_responses(store, prompts, generator, SETTINGS)
    assert summary.rows_failed == 1
    assert summary.first_errors[0].startswith("row 3 (id long): prompt has ")
    assert summary.first_errors[0].endswith("tokens; the model context is 2048")
    failed = read_responses(store)[3]
    assert failed["error"].startswith("prompt has ") and failed["finish_reason"] == "error"
    assert [m["role"] for m in failed["messages"]] == ["user"]

    strict = SETTINGS.model_copy(update={"max_error_rate": 0.1})
    with pytest.raises(ResponsesError, match=r"1 of 4 rows failed \(25\.0%\), above generation\.max_error_rate \(10\.0%\)"):
        generate_responses(store, prompts, generator, strict)
    # nothing lost: the file still holds every row, and only the failed row was retried
    assert [json.loads(line)["id"] for line in store.read_text(RESPONSES_FILE).splitlines()] == ["p0", "p1", "p2", "long"]
