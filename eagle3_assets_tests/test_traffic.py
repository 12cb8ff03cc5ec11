"""Prompts from traffic (issue 53, item 2): a request log read as prompts for the target, each line kept (train or
held out) or dropped with its file:line and why; appending keeps every old prompt's split and place; a logged reply
stands for generation only when it is the target's greedy output, decided and said per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import AssetKey, AssetSelection

from eagle3_assets.demo.tokenizer import render_prompt
from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project
from eagle3_assets.prompts import Prompt, parse_prompts
from eagle3_assets.provenance import Inputs, expected, read_record
from eagle3_assets.responses import read_responses
from eagle3_assets.settings import SettingsError, parse_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import load_tokenizer
from eagle3_assets.traffic import (
    TRAFFIC_HELDOUT_FILE,
    TRAFFIC_REPORT_FILE,
    TrafficBuild,
    kept_lines,
    read_prompt_set,
    write_traffic,
)
from eagle3_assets.traffic_log import LoggedCall, read_log, reply_decision
from eagle3_assets.traffic_settings import TrafficSettings

from .conftest import TINY_DEMO, tiny_settings
from .helpers import gpu_instance, target_of

MODEL = "acme/demo-target"
BASE = parse_prompts('{"id": "p-0", "prompt": "How many words are in: ring hat"}\n', "prompts.jsonl")
BASE_HELDOUT = parse_prompts('{"id": "e-0", "prompt": "What color is Xuquilin?"}\n', "eval.jsonl")


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return load_tokenizer(target_of(tiny_target_dir))


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def call(tokenizer, prompt: str, *, reply: str | None = "It is purple.<|end|>", model: str = MODEL, flat: bool = False,
         token_ids: bool = True, **request) -> str:  # fmt: skip
    """One logged call, as vLLM's OpenAI server answers it with `return_token_ids` (or without ids, `token_ids`)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **request}
    response = None
    if reply is not None:
        choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
        response = {"model": model, "choices": [choice]}
        if token_ids:
            choice["token_ids"] = ids_of(tokenizer, reply)
            response["prompt_token_ids"] = ids_of(tokenizer, render_prompt(prompt))
    line = {**body, **(response or {})} if flat else {"request": body, "response": response}
    return json.dumps(line)


def judge(tokenizer, share: float = 0.3, model: str | None = MODEL, temperature: float = 0.0) -> TrafficBuild:
    return TrafficBuild(tokenizer, len(tokenizer), {}, 64, share, model, temperature)


def build(tokenizer, log: Path, **kw):
    return judge(tokenizer, **kw).build(*read_log(str(log)), BASE, BASE_HELDOUT)


def first_log(tokenizer) -> list[str]:
    return [
        call(tokenizer, "Who founded Arvel?"),  # 1: kept, its reply logged
        call(tokenizer, "Who founded Arvel?", flat=True),  # 2: the same prompt, another shape
        '{"request": {"messages": [',  # 3: cut mid-line
        json.dumps({"request": {"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}]}}),  # 4  # fmt: skip
        call(tokenizer, "What color is Xuquilin?"),  # 5: a held-out prompt of the store
        call(tokenizer, "How many words are in: ring hat"),  # 6: a training prompt of the store
        call(tokenizer, "Where is Harrow?", temperature=0.7),  # 7
        call(tokenizer, "Where is Pemberly?", model="other/model"),  # 8
        call(tokenizer, "What does Ulla eat?", token_ids=False),  # 9
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}),  # 10
        call(tokenizer, "Who founded Harrow?", reply=None),  # 11: the request alone
        "[1, 2]",  # 12
        call(tokenizer, "Who lives in Arvel?", top_k=1, temperature=0.8),  # 13: greedy by top_k
        "",  # a blank line is no line
        call(tokenizer, "Name a fruit.", presence_penalty=0.5),  # 15
        call(tokenizer, "What color is Harrow?"),  # 16: its hash holds it out
    ]


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_log_gives_the_expected_rows_and_names_each_line_it_dropped(tmp_path, tokenizer):
    log = write_log(tmp_path / "gateway.jsonl", first_log(tokenizer))
    result = build(tokenizer, log)
    assert [str(d) for d in result.dropped] == [
        f"{log}:2: duplicate of {log}:1 (the same prompt as the target's template renders it)",
        f"{log}:3: malformed JSON (Expecting value at column 27)",
        f"{log}:4: the chat template cannot render this conversation: TemplateError: the demo chat template knows only "
        "user and assistant messages, got role system",
        f"{log}:5: a held-out prompt of `eval_prompts` (id e-0): never trained on",
        f"{log}:6: a training prompt of `prompts` already (id p-0)",
        f"{log}:10: messages[1] is a tool call or its result: only text chats are prompts here",
        f"{log}:12: expected a JSON object, got list",
    ]
    rows = [(r.prompt.messages[-1]["content"], r.heldout, r.reply and (r.reply.source, r.reply.why)) for r in result.rows]
    assert rows == [
        ("Who founded Arvel?", False, ("logged", "the greedy output of 'acme/demo-target', token ids logged")),
        ("Where is Harrow?", False, ("generated", "sampled, not greedy: temperature 0.7")),
        ("Where is Pemberly?", False, ("generated", "answered by 'other/model', not the target ('acme/demo-target', "
                                       "traffic.model)")),  # fmt: skip
        ("What does Ulla eat?", False, ("generated", "token ids not logged (a training row is the ids the engine "
                                        "produced, docs/DESIGN.md §3; vLLM logs them with return_token_ids)")),  # fmt: skip
        ("Who founded Harrow?", False, ("generated", "no reply logged")),
        ("Who lives in Arvel?", False, ("logged", "the greedy output of 'acme/demo-target', token ids logged")),
        ("Name a fruit.", False, ("generated", "the request sets presence_penalty 0.5: not the target's plain greedy output")),
        ("What color is Harrow?", True, None),
    ]
    assert (result.lines, result.files) == (15, [str(log)])
    assert result.reply_counts() == {"logged": 2, "generated: sampled": 1, "generated: other model": 1,
                                     "generated: text only": 1, "generated: no reply": 1, "generated: constrained": 1}  # fmt: skip
    # A training row says whose reply it gets; its id and split are its prompt's own hash.
    assert result.train[0] == Prompt("traffic-517a2652a5febfd3", [{"role": "user", "content": "Who founded Arvel?"}],
                                     {"traffic_reply": "logged"})  # fmt: skip
    assert result.rows[0].reply.completion_token_ids == ids_of(tokenizer, "It is purple.<|end|>")
    assert [p.id for p in result.heldout] == ["traffic-1677e24c770f451d"]


def test_appending_to_the_log_keeps_every_old_prompts_split_and_place(tmp_path, tokenizer):
    """Lines appended to a file, and a new file that sorts before it, add prompts after the old ones; no old prompt
    moves between the splits, and a new line repeating an old prompt is dropped as its duplicate."""
    logs = tmp_path / "logs"
    logs.mkdir()
    gateway = write_log(logs / "b-gateway.jsonl", first_log(tokenizer))
    store = ArtifactStore(tmp_path / "store")
    before = build(tokenizer, logs)
    old_set, _ = write_traffic(store, before, BASE)
    assert [p.id for p in old_set] == ["p-0", *(p.id for p in before.train)]
    with gateway.open("a") as f:
        f.write(call(tokenizer, "What does Arvel eat?") + "\n" + call(tokenizer, "Where is Ulla?") + "\n")
    write_log(logs / "a-other.jsonl", [call(tokenizer, "Who founded Pemberly?"), call(tokenizer, "Who founded Arvel?")])
    after = judge(tokenizer).build(*read_log(str(logs)), BASE, BASE_HELDOUT, kept_lines(store))
    new_set, _ = write_traffic(store, after, BASE)
    assert [p.id for p in new_set[: len(old_set)]] == [p.id for p in old_set]
    assert [p.messages[-1]["content"] for p in new_set[len(old_set) :]] == ["Who founded Pemberly?", "Where is Ulla?"]
    assert [p.messages[-1]["content"] for p in after.heldout] == ["What color is Harrow?", "What does Arvel eat?"]
    # The call kept the last time stays the one kept: its line decides the prompt's reply, as it did.
    assert str(after.dropped[0]) == (
        f"{logs / 'a-other.jsonl'}:2: duplicate of {gateway}:1 (the same prompt as the target's template renders it)"
    )
    assert read_prompt_set(store) == new_set
    assert [p.id for p in parse_prompts(store.read_text(TRAFFIC_HELDOUT_FILE), "h")] == [p.id for p in after.heldout]
    report = store.read_json(TRAFFIC_REPORT_FILE)
    assert (report["lines"], len(report["dropped"]), len(report["rows"])) == (19, 8, 11)


def logged(tokenizer, request: dict | None = None, choice: dict | None = None, response: dict | None = None,
           prompt: str = "Who founded Arvel?") -> LoggedCall:  # fmt: skip
    """A call whose reply is the target's greedy output with its ids, but for what the case changes."""
    messages = [{"role": "user", "content": prompt}]
    reply = {"finish_reason": "stop", "token_ids": ids_of(tokenizer, "Ada.<|end|>"), **(choice or {})}
    body = {"model": MODEL, "prompt_token_ids": ids_of(tokenizer, render_prompt(prompt)), "choices": [reply], **(response or {})}
    return LoggedCall("log:1", messages, {}, {"model": MODEL, "messages": messages, "temperature": 0, **(request or {})}, body)


@pytest.mark.parametrize(
    ("case", "target", "temperature", "decided"),
    [
        ({}, MODEL, 0.0, ("logged", "the greedy output of 'acme/demo-target', token ids logged")),
        ({"request": {"temperature": 1.0, "top_k": 1}}, MODEL, 0.0, ("logged", "the greedy output of 'acme/demo-target', "
                                                                     "token ids logged")),  # fmt: skip
        ({}, MODEL, 0.6, ("generated", "generation.temperature is 0.6: this run samples its rows, and a logged greedy "
                                       "reply is not what it would make")),  # fmt: skip
        ({}, None, 0.0, ("generated", "traffic.model is not set: no logged reply is known to be the target's")),
        ({"request": {"temperature": None}}, MODEL, 0.0, (
            "generated", "sampled, not greedy: temperature not logged (the server's default samples: 1.0 in the OpenAI API)")),
        ({"request": {"stop": ["\n"]}}, MODEL, 0.0, ("generated", "the request sets stop [\"\\n\"]: not the target's "
                                                                  "plain greedy output")),  # fmt: skip
        ({"request": {"response_format": {"type": "json_object"}}}, MODEL, 0.0, (
            "generated", "the request sets response_format {\"type\": \"json_object\"}: not the target's plain greedy output")),
        ({"choice": {"finish_reason": "length"}}, MODEL, 0.0, (
            "generated", "finish_reason 'length': the reply did not end on its own")),
        ({"response": {"prompt_token_ids": [1, 2, 3]}}, MODEL, 0.0, (
            "generated", "the server's prompt (3 token ids) is not the target's template's rendering here (18 token ids): "
            "another template or chat_template_kwargs")),
        ({"choice": {"token_ids": [5, 100000]}}, MODEL, 0.0, (
            "generated", "the completion's token ids are not 320-vocabulary ids of a non-empty reply")),
        ({"response": {"model": "acme/demo-target-fp8"}}, MODEL, 0.0, (
            "generated", "answered by 'acme/demo-target-fp8', not the target ('acme/demo-target', traffic.model)")),
    ],
)
def test_a_logged_reply_stands_for_generation_only_when_it_is_the_targets_greedy_output(tokenizer, case, target,
                                                                                       temperature, decided):  # fmt: skip
    c = logged(tokenizer, **case)
    prompt_ids = ids_of(tokenizer, render_prompt("Who founded Arvel?"))
    d = reply_decision(c, target=target, run_temperature=temperature, prompt_ids=prompt_ids, vocab_size=len(tokenizer))
    assert (d.source, d.why) == decided
    assert d.completion_token_ids == (ids_of(tokenizer, "Ada.<|end|>") if d.source == "logged" else [])


def test_every_accepted_shape_of_a_line_reads_the_same_call(tmp_path, tokenizer):
    """The shapes the log's docstring lists: {request, response}, bodies wrapped as OpenAI's batch files wrap them,
    the response under `response` beside the request's fields, and both side by side; an error response is no reply."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    request = {"model": MODEL, "messages": messages, "temperature": 0}
    response = {"model": MODEL, "choices": [{"message": {"content": "Hello"}, "finish_reason": "stop"}]}
    lines = [
        {"request": request, "response": response},
        {"custom_id": "r1", "body": request, "response": {"status_code": 200, "body": response}},
        {**request, "response": response},
        {**request, **response},
        {"request": request, "response": {"status_code": 500, "body": {"error": {"message": "overloaded"}}}},
    ]
    calls, dropped, lines_read, _ = read_log(str(write_log(tmp_path / "log.jsonl", [json.dumps(x) for x in lines])))
    assert (dropped, lines_read) == ([], 5)
    assert {json.dumps(c.messages) for c in calls} == {json.dumps([{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}])}  # fmt: skip
    assert [c.response == {**response, **({"status_code": 200} if i == 1 else {})} for i, c in enumerate(calls)] == [
        True, True, True, False, False
    ]  # the flat line's response is the whole line
    assert [(c.model, c.response_error) for c in calls[3:]] == [(MODEL, None), (MODEL, "the response logged is an error")]


def test_the_traffic_settings_name_the_setting_at_fault():
    assert parse_settings({}).traffic is None
    s = parse_settings({"traffic": {"log": "s3://logs/gateway/"}})
    assert s.traffic == TrafficSettings(log="s3://logs/gateway/", heldout_share=0.1, model=None)
    with pytest.raises(SettingsError) as e:
        parse_settings({"traffic": {"log": " ", "heldout_share": 0.7, "model": "", "sample": 3}})
    assert str(e.value).splitlines()[1:] == [
        "  traffic.log: Value error, empty; name the request log (a JSONL file, a directory of them or a glob)",
        "  traffic.heldout_share: Input should be less than or equal to 0.5",
        "  traffic.model: Value error, empty; name the model as the log records it, or leave it unset (every row generated)",
        "  traffic.sample: Extra inputs are not permitted",
    ]
    with pytest.raises(SettingsError, match=r"traffic.log: Field required"):
        parse_settings({"traffic": {}})


def _materialize(job, instance, *names: str) -> dict[str, dict]:
    """Materialize `names` in this process; each one's metadata, by name."""
    from eagle3_assets.defs.provenance import latest_materialization

    assert job.execute_in_process(instance=instance, asset_selection=[AssetKey(n) for n in names]).success
    metadata = {}
    for name in names:
        meta = latest_materialization(instance, AssetKey(name)).event_log_entry.asset_materialization.metadata
        metadata[name] = {k: v.value for k, v in meta.items()}
    return metadata


def test_the_traffic_asset_feeds_responses_which_takes_logged_replies_and_generates_the_rest(tmp_path, tiny_target_dir):
    """In the graph: the log's training prompts come after the prompts in the set `responses` generates from, the
    logged greedy replies are the rows' completions as logged (cut at max_new_tokens), every other row is generated,
    each row says which; appending to the log makes traffic_prompts due, and responses then generates the new rows
    only. Every setting either asset reads is in its provenance, and its parents are its Dagster deps."""
    from .test_artifacts import Recording, parents_apart_from_deps, unrecorded
    from eagle3_assets.artifacts import ARTIFACTS
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.defs.plan import next_start
    from eagle3_assets.defs.provenance import StartDoor

    tok = load_tokenizer(target_of(tiny_target_dir))
    long_reply = "It is purple and it is round and it is big.<|end|>"
    log = write_log(tmp_path / "gateway.jsonl", [
        call(tok, "Who founded Arvel?", reply="Ada.<|end|>"), call(tok, "Who lives in Arvel?", reply=long_reply),
        call(tok, "Where is Harrow?", temperature=0.7), call(tok, "What color is Harrow?"), "not json",
    ])  # fmt: skip
    settings = tiny_settings(traffic=TrafficSettings(log=str(log), heldout_share=0.3, model=MODEL))
    store = ArtifactStore(tmp_path / "store")
    store.put_dir(tiny_target_dir, DEMO_MODEL_DIR)  # the demo target `target_model` would build, cached
    store.write_json(DEMO_MODEL_SETTINGS, TINY_DEMO.model_dump())
    seen: set[str] = set()
    recording = Project(Recording(settings, seen), store)  # type: ignore[arg-type]
    job = build_definitions(recording).resolve_implicit_global_asset_job_def()  # what it reads is not the runs'
    with gpu_instance() as instance:
        _materialize(job, instance, "prompts", "target_model")
        seen.clear()
        meta = _materialize(job, instance, "traffic_prompts")["traffic_prompts"]
        assert unrecorded(ARTIFACTS["traffic_prompts"], settings, seen) == []
        seen.clear()
        made = _materialize(job, instance, "responses")["responses"]
        assert unrecorded(ARTIFACTS["responses"], settings, seen) == []
        assert parents_apart_from_deps(build_definitions(Project(settings, store)), ARTIFACTS, settings) == []
        assert {k: meta[k] for k in ("lines", "rows_train", "rows_heldout", "rows_dropped", "prompt_set_rows",
                                     "replies_logged", "replies_generated", "reply_sources")} == {  # fmt: skip
            "lines": 5, "rows_train": 3, "rows_heldout": 1, "rows_dropped": 1, "prompt_set_rows": 48,
            "replies_logged": 2, "replies_generated": 1, "reply_sources": {"logged": 2, "generated: sampled": 1},
        }
        assert meta["dropped"] == f"- {log}:5: malformed JSON (Expecting value at column 1)"
        assert (made["rows"], made["rows_generated"], made["rows_from_logged_replies"]) == (48, 48, 2)
        rows = read_responses(store)
        assert [r["id"] for r in rows[:45]] == [f"demo-{i:02d}" for i in range(45)]
        traffic = [(r["messages"][0]["content"], r["traffic_reply"], r["finish_reason"]) for r in rows[45:]]
        assert traffic == [("Who founded Arvel?", "logged", "stop"), ("Who lives in Arvel?", "logged", "length"),
                           ("Where is Harrow?", "generated", rows[47]["finish_reason"])]  # fmt: skip
        assert rows[45]["completion_token_ids"] == ids_of(tok, "Ada.<|end|>")  # 5 ids, the stop token last
        assert rows[46]["completion_token_ids"] == ids_of(tok, long_reply)[:8]  # generation.max_new_tokens

        with log.open("a") as f:  # appended: one new training prompt and one repeated
            f.write(call(tok, "Where is Ulla?", reply=None) + "\n" + call(tok, "Who founded Arvel?") + "\n")
        want = expected("traffic_prompts", Inputs(settings, store))
        assert read_record(store, "traffic_prompts").provenance.changes(want)[0].startswith("input traffic log: ")
        # `--plan` counts the rows the log adds, from the set traffic_prompts will write.
        plan = next_start(instance, Project(settings, store), build_definitions(Project(settings, store)), StartDoor(),
                          AssetSelection.assets("traffic_prompts", "responses"))  # fmt: skip
        assert [(s.label, s.cost.rows) for s in plan.steps] == [("traffic_prompts", None), ("responses", 1)]
        assert plan.steps[1].cost.basis.startswith("of 49 prompts; ")
        again = _materialize(job, instance, "traffic_prompts", "responses")
        assert (again["traffic_prompts"]["rows_train"], again["traffic_prompts"]["rows_dropped"]) == (4, 2)
        assert {k: again["responses"][k] for k in ("rows", "rows_reused", "rows_generated", "rows_from_logged_replies")} == {
            "rows": 49, "rows_reused": 48, "rows_generated": 1, "rows_from_logged_replies": 0,
        }
        assert [r["id"] for r in read_responses(store)[:48]] == [r["id"] for r in rows]


def test_without_traffic_the_graph_is_as_it_was(tmp_path):
    from eagle3_assets.definitions import build_definitions

    graph = build_definitions(Project(tiny_settings(), ArtifactStore(tmp_path))).resolve_asset_graph()
    assert AssetKey("traffic_prompts") not in graph.get_all_asset_keys()
    assert graph.get(AssetKey("responses")).parent_keys == {AssetKey("prompts"), AssetKey("target_model")}
    assert expected("responses", Inputs(tiny_settings(), ArtifactStore(tmp_path))).inputs.keys() == {"prompts", "target_model"}


def test_a_log_is_read_through_fsspec_as_a_glob_of_gzipped_files_and_a_missing_one_names_the_setting(tokenizer):
    import gzip

    import fsspec

    from eagle3_assets.traffic_log import TrafficLogError, log_files

    fs = fsspec.filesystem("memory")
    for name, prompt in [("2026-12-02", "Where is Ulla?"), ("2026-12-01", "Who founded Arvel?")]:
        fs.pipe(f"/traffic-test/{name}.jsonl.gz", gzip.compress((call(tokenizer, prompt) + "\n").encode()))
    fs.pipe("/traffic-test/notes.txt", b"not a log")
    url = "memory://traffic-test/*.jsonl.gz"
    assert log_files(url) == ["memory:///traffic-test/2026-12-01.jsonl.gz", "memory:///traffic-test/2026-12-02.jsonl.gz"]
    calls, dropped, lines, _ = read_log(url)
    assert ([c.where for c in calls], [c.messages[0]["content"] for c in calls], dropped, lines) == (
        ["memory:///traffic-test/2026-12-01.jsonl.gz:1", "memory:///traffic-test/2026-12-02.jsonl.gz:1"],
        ["Who founded Arvel?", "Where is Ulla?"], [], 2,
    )  # fmt: skip
    with pytest.raises(TrafficLogError, match=r"^traffic.log: no file at memory://traffic-test/\*.jsonl \(name a JSONL "
                       r"file, a directory of them or a glob\)$"):  # fmt: skip
        log_files("memory://traffic-test/*.jsonl")
    fs.rm("/traffic-test", recursive=True)
