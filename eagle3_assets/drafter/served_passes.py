"""drafter_eval's vLLM passes, each kept in the store by what determines it, so no pass is served twice.

A pass (plain greedy decoding, or one drafter at one k, its features kept or zeroed) is determined by the engine and
the device that serve it, the target's bytes (its `target_model` version), the prompts as the engine is given them
(token ids and their groups), the arguments every pass shares (tokens decoded, dtype, stop tokens, ...) and, for a
drafter, the files vLLM loads of it. Its result is kept under a digest of all of these (`served_passes/<key>.json`)
and read instead of served when the same pass is asked for again:
- a release makes every family's eval due again, to serve the release beside it; the release is an export some eval
  has served at each k, and the eval's own passes have not changed: served once, not again;
- every family's eval serves the same plain pass;
- a pass is kept as it finishes, so an eval that dies at pass 7 of 9 serves two when it runs again.
On a GPU each pass loads the target (minutes, for a 1T model); on a CPU it is most of drafter_eval's time.

A speedup is a ratio of two passes in one interpreter: each result is kept with the plain pass's rate of the
interpreter that served it, and when any pass is served the plain pass is served with it.

Nothing here that a process can lose: an entry is written whole (`ArtifactStore.write_json`), one that cannot be read
is served again, and one that cannot be written costs only its reuse. Entries no family's report names are removed
after each eval (`prune`); an entry another family's eval wrote meanwhile may go with them, which costs that pass
once more, never a wrong figure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.eval_report import BASELINE_REPORT_FILE, EVAL_REPORT_FILE
from eagle3_assets.drafter.export import TRAINED_ON_FILE
from eagle3_assets.drafter.release import target_version
from eagle3_assets.drafter.vllm_eval import GenerationResult, engine_version
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.families import FAMILIES
from eagle3_assets.release_record import RELEASE_RECORD_FILE
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, stop_token_ids
from eagle3_assets.vllm_server.command import compilation_config

PASSES_DIR = "served_passes"
REPORT_KEYS = "served_passes"  # report.json: pass label -> the key of the entry its figures are (what `prune` keeps)
# Files of a drafter directory that vLLM never reads: records written beside the weights (a release's own record, what
# an export was trained on). Any other file counts, so a file a new family adds makes a new key, never a stale one.
RECORDS = frozenset({RELEASE_RECORD_FILE, TRAINED_ON_FILE})
WEIGHTS_FILE = "model.safetensors"  # where vLLM loads a drafter's weights from


@dataclass(frozen=True)
class DrafterDigests:
    weights: str  # sha256 of its `model.safetensors`: the drafter a report names (`release.export_digest` of a copy)
    files: str  # sha256 over the files vLLM may load (names and bytes; `RECORDS` left out): what its passes are keyed by


def drafter_digests(directory: Path) -> DrafterDigests:
    """Both digests of the drafter in `directory`, in one read of its files (a drafter of a large target's vocabulary
    is GBs): the same export, copied to a release, has the same digests."""
    files, weights = hashlib.sha256(), hashlib.sha256()
    if not (directory / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in the drafter directory {directory}")
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name not in RECORDS):
        files.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                files.update(chunk)
                if path.name == WEIGHTS_FILE:
                    weights.update(chunk)
        files.update(b"\0")
    return DrafterDigests(weights.hexdigest(), files.hexdigest())


def files_digest(directory: Path) -> str:
    return drafter_digests(directory).files


def pass_key(context: Mapping[str, Any], run: Mapping[str, Any], drafters: dict[str, str] | None = None) -> str:
    """The key of one pass: `context` (what every pass of an eval shares) and `run` (this pass's arguments), its
    `draft_dir` replaced by that directory's `files_digest` (kept in `drafters`, by directory, for the next run)."""
    run = dict(run)
    if "draft_dir" in run:
        drafters = {} if drafters is None else drafters
        directory = str(run["draft_dir"])
        if directory not in drafters:
            drafters[directory] = files_digest(Path(directory))
        run["draft_dir"] = drafters[directory]
    text = json.dumps({"context": context, "run": run}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def prompts_digest(prompt_ids: Sequence[Sequence[int]], groups: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids] + [list(groups)]).encode()).hexdigest()


@dataclass(frozen=True)
class ServedPass:
    result: GenerationResult
    plain_tokens_per_s: float  # the plain pass's decode rate in the interpreter that served this one
    key: str  # its entry in `PASSES_DIR` ("" when the eval had nothing to key passes by)
    reused: bool  # read from the store, not served by this eval


Serve = Callable[[list[int], Callable[[int, GenerationResult], None]], object]


def serve_or_reuse(
    store: ArtifactStore,
    runs: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any] | None,
    serve: Serve,
    log: Callable[[str], None],
    *,
    reuse: bool = True,
    drafters: Mapping[str, str] | None = None,
) -> list[ServedPass]:
    """Each of `runs` (the first the plain pass) read from the store when kept there under its key, else served:
    `serve(indexes, on_result)` serves the runs at `indexes` (the plain pass first) in one interpreter, calling
    `on_result(j, result)` as the j-th of them finishes, and each is kept. `reuse` False serves every run again (and
    keeps them, for later evals); `context` None (nothing to key a pass by) serves every run and keeps none.
    `drafters`: the `files_digest` of drafter directories already read, by directory."""
    known = dict(drafters or {})
    keys = ["" if context is None else pass_key(context, run, known) for run in runs]
    kept: list[ServedPass | None] = [_read(store, key, log) if key and reuse else None for key in keys]
    todo = [i for i, p in enumerate(kept) if p is None]
    if todo and todo[0] != 0:  # the fresh passes' speedups are measured against a plain pass of their interpreter
        todo.insert(0, 0)
    if not todo:
        return [p for p in kept if p is not None]
    plain_rate: list[float] = []

    def on_result(j: int, result: GenerationResult) -> None:
        if j == 0:
            plain_rate.append(result.decode_tokens_per_s)
        i = todo[j]
        kept[i] = ServedPass(result, plain_rate[0], keys[i], reused=False)
        if keys[i]:
            _write(store, kept[i], log)

    serve(todo, on_result)
    if missing := [i for i, p in enumerate(kept) if p is None]:
        raise EvaluationError(f"drafter_eval: passes {missing} of {len(runs)} were asked for and never served")
    return kept  # type: ignore[return-value]


def _read(store: ArtifactStore, key: str, log: Callable[[str], None]) -> ServedPass | None:
    rel = f"{PASSES_DIR}/{key}.json"
    try:
        body = store.read_json(rel)
        return ServedPass(
            GenerationResult.from_json(body["result"]), float(body["plain_tokens_per_s"]), key, reused=True
        )
    except Eagle3Error:
        return None  # not kept
    except (ValueError, KeyError, TypeError) as e:
        log(f"drafter_eval: {store.url_of(rel)} is not a served pass ({type(e).__name__}: {e}); serving it again")
        return None


def _write(store: ArtifactStore, served: ServedPass, log: Callable[[str], None]) -> None:
    rel = f"{PASSES_DIR}/{served.key}.json"
    try:
        store.write_json(rel, {"result": served.result.to_json(), "plain_tokens_per_s": served.plain_tokens_per_s})
    except (Eagle3Error, OSError) as e:  # the figures are in hand: only their reuse is lost
        log(f"drafter_eval: this pass is not kept at {store.url_of(rel)} ({e}); a later eval serves it again")


def prune(store: ArtifactStore, log: Callable[[str], None]) -> int:
    """Remove the kept passes no family's report names (`REPORT_KEYS`), nor an imported release's baseline (the first
    eval's to read); returns how many. Nothing is removed while a report cannot be read: what it names is not known."""
    named: set[str] = set()
    reports = [f"{family.root}/{EVAL_REPORT_FILE}".lstrip("/") for family in FAMILIES.values()]
    for rel in [*reports, BASELINE_REPORT_FILE]:
        try:
            if store.exists(rel):
                named.update((store.read_json(rel).get(REPORT_KEYS) or {}).values())
        except (Eagle3Error, ValueError, AttributeError) as e:
            log(f"drafter_eval: {store.url_of(rel)} cannot be read ({e}); no kept pass is removed")
            return 0
    removed = 0
    for name in store.listdir(PASSES_DIR):
        if name.removesuffix(".json") in named:
            continue
        try:
            store.remove(f"{PASSES_DIR}/{name}")
        except OSError as e:
            log(f"drafter_eval: cannot remove {store.url_of(f'{PASSES_DIR}/{name}')} ({e})")
            break
        removed += 1
    return removed


def pass_context(store: ArtifactStore, prompt_ids: Sequence[Sequence[int]], common: Mapping[str, Any]) -> dict | None:
    """What every pass of an eval shares (`pass_key`): the engine and device, the target's version,
    the prompts and the engine arguments. None (every pass served) when the target has no version yet."""
    version = target_version(store)
    if version == "none":
        return None
    return {
        "engine": engine_version(), "device": "cuda" if torch.cuda.is_available() else "cpu", "target": version,
        "prompts": prompts_digest(prompt_ids, common["groups"]),
        "common": {k: v for k, v in common.items() if k != "groups"},
    }  # fmt: skip


def pass_args(target: TargetModel, settings: Settings, prompt_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The engine and sampling arguments every pass on `prompt_ids` shares, whoever serves it (evals, benchmarks):
    answers end where the target's turn ends, as `responses` ended them; the engine's dtype is the pipeline's
    (`vllm.dtype`): vLLM's CPU MoE kernel takes no float32, and a drafter is judged as the target is served."""
    return {
        "max_tokens": max_tokens, "max_model_len": max(map(len, prompt_ids)) + max_tokens + 8, "ignore_eos": False,
        "dtype": settings.vllm.dtype, "language_model_only": target.wrapped,
        "compilation_config": compilation_config(target), "stop_token_ids": sorted(stop_token_ids(target)),
    }  # fmt: skip
