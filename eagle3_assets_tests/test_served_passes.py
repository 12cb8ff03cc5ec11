"""drafter_eval's passes kept by what determines them (`served_passes.py`): a pass served once is read, not served,
when the same engine, target, prompts, arguments and drafter files are asked for again. The serving itself is vLLM's
(test_drafter_eval_beside.py, and the demo, where the other family's eval after a release serves nothing); here each
pass "served" is a result made from its arguments, so what was served and what was read can be told apart."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE
from eagle3_assets.drafter.served_passes import (
    PASSES_DIR,
    REPORT_KEYS,
    drafter_digests,
    files_digest,
    prune,
    serve_or_reuse,
)
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.families import DFLASH
from eagle3_assets.storage import ArtifactStore

CONTEXT = {"engine": "vllm 0.32.0", "device": "cpu", "target": "t1", "prompts": "p1", "common": {"max_tokens": 8}}


def drafter_dir(root: Path, weights: bytes = b"weights") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (root / "model.safetensors").write_bytes(weights)
    return root


class Engine:
    """Serves a pass as a result its arguments determine (acceptance 1 + k/2, 2 tokens/s plain, 4 speculative); counts
    what it served; `die_after` passes it dies, as an engine killed mid-eval."""

    def __init__(self, runs: list[dict], die_after: int | None = None) -> None:
        self.runs, self.die_after, self.served = runs, die_after, []

    def __call__(self, indexes, on_result):
        for j, i in enumerate(indexes):
            if self.die_after is not None and j == self.die_after:
                raise EvaluationError("drafter_eval: vLLM generation timed out")
            k = self.runs[i].get("num_speculative_tokens", 0)
            result = GenerationResult([[1, 2, 3, 4]], num_drafts=2, num_accepted_tokens=k, seconds=1.0 if k else 2.0)
            self.served.append(i)
            on_result(j, result)


def runs_for(export: Path, release: Path | None = None) -> list[dict]:
    runs = [{"margins": True}] + [
        {"draft_dir": str(export), "method": "eagle3", "num_speculative_tokens": k, "zero_fc": z}
        for k in (3, 7) for z in (False, True)
    ]  # fmt: skip
    if release is not None:
        runs += [
            {"draft_dir": str(release), "method": "eagle3", "num_speculative_tokens": k, "zero_fc": False} for k in (3, 7)
        ]
    return runs


def test_a_pass_served_before_is_read_and_a_copy_of_the_export_released_is_the_same_drafter(tmp_path):
    store, lines = ArtifactStore(tmp_path / "store"), []
    export = drafter_dir(tmp_path / "export")
    runs = runs_for(export)
    engine = Engine(runs)
    first = serve_or_reuse(store, runs, CONTEXT, engine, lines.append)
    assert engine.served == [0, 1, 2, 3, 4] and [p.reused for p in first] == [False] * 5
    assert len(store.listdir(PASSES_DIR)) == 5
    # Speedups come from the plain pass of the interpreter that served each: 4 tokens in 1 s over 4 in 2 s.
    assert [p.plain_tokens_per_s for p in first] == [2.0] * 5 and first[1].result.decode_tokens_per_s == 4.0

    # The release is a copy of the export with its own record beside it: the same drafter, so the same passes.
    release = tmp_path / "release"
    shutil.copytree(export, release)
    (release / "release.json").write_text('{"family": "eagle3"}')
    (release / "trained_on.json").write_text("{}")
    assert drafter_digests(release) == drafter_digests(export)
    # ... as a report names it (the weights alone), read in the same pass over the files as the key's digest
    assert drafter_digests(release).weights == hashlib.sha256((export / "model.safetensors").read_bytes()).hexdigest()
    assert drafter_digests(release).files == files_digest(export) != drafter_digests(release).weights
    runs = runs_for(export, release)
    engine = Engine(runs)
    again = serve_or_reuse(store, runs, CONTEXT, engine, lines.append)
    assert engine.served == [] and all(p.reused for p in again)
    assert [p.key for p in again[5:]] == [first[1].key, first[3].key]  # released k=3, k=7: ours k=3, k=7
    assert [p.result for p in again[:5]] == [p.result for p in first]
    assert [p.plain_tokens_per_s for p in again] == [2.0] * 7


def test_what_determines_a_pass_changes_its_key_and_only_the_passes_it_changes_are_served(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    export = drafter_dir(tmp_path / "export")
    runs = runs_for(export)
    serve_or_reuse(store, runs, CONTEXT, Engine(runs), print)
    # New weights: every drafter pass again, and the plain pass with them (the speedups' baseline), read as kept.
    (export / "model.safetensors").write_bytes(b"other weights")
    engine = Engine(runs)
    served = serve_or_reuse(store, runs, CONTEXT, engine, print)
    assert engine.served == [0, 1, 2, 3, 4] and [p.reused for p in served] == [False] * 5
    # A new config (other aux layers, say) is another drafter too; so is another target, engine or prompt set.
    (export / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "aux_layer_ids": [1]}')
    engine = Engine(runs)
    serve_or_reuse(store, runs, CONTEXT, engine, print)
    assert engine.served == [0, 1, 2, 3, 4]
    for changed in ({"target": "t2"}, {"engine": "vllm 0.33.0"}, {"device": "cuda"}, {"prompts": "p2"}):
        engine = Engine(runs)
        serve_or_reuse(store, runs, CONTEXT | changed, engine, print)
        assert engine.served == [0, 1, 2, 3, 4], changed
    # Reuse off: every pass served again, and kept under its key for a later eval.
    (export / "model.safetensors").write_bytes(b"third weights")
    engine = Engine(runs)
    fresh = serve_or_reuse(store, runs, CONTEXT, engine, print, reuse=False)
    assert engine.served == [0, 1, 2, 3, 4] and not any(p.reused for p in fresh)
    engine = Engine(runs)
    assert all(p.reused for p in serve_or_reuse(store, runs, CONTEXT, engine, print)) and engine.served == []
    # Nothing to key a pass by (no target version): every pass served, none kept.
    kept = set(store.listdir(PASSES_DIR))
    engine = Engine(runs)
    unkeyed = serve_or_reuse(store, runs, None, engine, print)
    assert engine.served == [0, 1, 2, 3, 4] and [p.key for p in unkeyed] == [""] * 5
    assert set(store.listdir(PASSES_DIR)) == kept


def test_an_eval_that_dies_mid_way_keeps_its_finished_passes_and_serves_the_rest_with_a_plain_pass(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    runs = runs_for(drafter_dir(tmp_path / "export"))
    with pytest.raises(EvaluationError, match="timed out"):
        serve_or_reuse(store, runs, CONTEXT, Engine(runs, die_after=3), print)
    assert len(store.listdir(PASSES_DIR)) == 3
    engine = Engine(runs)
    passes = serve_or_reuse(store, runs, CONTEXT, engine, print)
    assert engine.served == [0, 3, 4]
    assert [p.reused for p in passes] == [False, True, True, False, False]


def test_an_entry_that_cannot_be_read_is_served_again_naming_the_file(tmp_path):
    store, lines = ArtifactStore(tmp_path / "store"), []
    runs = runs_for(drafter_dir(tmp_path / "export"))[:2]
    first = serve_or_reuse(store, runs, CONTEXT, Engine(runs), lines.append)
    bad = f"{PASSES_DIR}/{first[1].key}.json"
    store.write_text(bad, '{"result": {"outputs": [[1]]}}')  # no counters, no plain rate
    engine = Engine(runs)
    serve_or_reuse(store, runs, CONTEXT, engine, lines.append)
    assert engine.served == [0, 1]
    assert lines == [
        f"drafter_eval: {store.url_of(bad)} is not a served pass (KeyError: 'num_drafts'); serving it again"
    ]
    assert json.loads(store.read_text(bad))["plain_tokens_per_s"] == 2.0  # written whole again


def test_prune_keeps_the_passes_a_family_report_names_and_removes_the_rest(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    runs = runs_for(drafter_dir(tmp_path / "export"))
    passes = serve_or_reuse(store, runs, CONTEXT, Engine(runs), print)
    store.write_json(EVAL_REPORT_FILE, {REPORT_KEYS: {"plain": passes[0].key, "k=3": passes[1].key}})
    store.child(DFLASH.root).write_json(EVAL_REPORT_FILE, {REPORT_KEYS: {"k=7": passes[3].key}})
    assert prune(store, print) == 2
    assert store.listdir(PASSES_DIR) == sorted(f"{passes[i].key}.json" for i in (0, 1, 3))
    assert prune(store, print) == 0
    # A report that cannot be read names what it names all the same: nothing goes.
    store.write_text(EVAL_REPORT_FILE, '{"served_passes": ')
    store.child(DFLASH.root).write_json(EVAL_REPORT_FILE, {REPORT_KEYS: {}})
    lines: list[str] = []
    assert prune(store, lines.append) == 0 and len(store.listdir(PASSES_DIR)) == 3
    assert lines == [
        f"drafter_eval: {store.url_of(EVAL_REPORT_FILE)} cannot be read (Expecting value: line 1 column 19 (char 18)); "
        "no kept pass is removed"
    ]
