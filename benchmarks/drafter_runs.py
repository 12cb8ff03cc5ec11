"""What the drafter benchmarks share: the demo store, our drafter trained for a number of steps, and serving.

`open_project(...)` opens a configured run's store, or the demo's. `demo_store(dir)` runs the
project's own demo graph through the hidden-state shards (no drafter) into `dir`, or reuses
what is there. `train(...)` trains our drafter on it for
exactly `settings.steps` optimizer steps into a scratch store beside it (checkpoints go
under a store) and exports it, timing every step in process CPU seconds. `serve(...)`
decodes the held-out prompts (the store's, or those given) greedily with the target alone,
with each drafter at k=3 and k=7, and optionally with vLLM's n-gram prompt lookup at the
same k, in one vLLM interpreter, and reports where speculative output parts from greedy.
Prompts render as `responses` and `drafter_eval` render them (chat-template kwargs included).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dagster import AssetKey

from eagle3_assets.definitions import build_definitions
from eagle3_assets.demo.prompts import demo_extra_eval_prompts
from eagle3_assets.drafter.evaluate import NEAR_TIE_LOGPROB, PLAIN_RUN, eval_prompt_ids, load_eval_prompts, parting
from eagle3_assets.drafter.served_passes import pass_args
from eagle3_assets.drafter.export import EXPORT_DIR, export_drafter
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess
from eagle3_assets.project import Project
from eagle3_assets.start import GraphStart
from eagle3_assets.prompts import Prompt, parse_prompts
from eagle3_assets.sample_file import MANIFEST_NAME, shard_dir
from eagle3_assets.settings import (
    CONFIG_ENV,
    ROOT_ENV,
    DemoSettings,
    Settings,
    TrainingSettings,
    artifact_root,
    demo_settings,
    load_settings,
)
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, load_tokenizer
from eagle3_assets.vocab_map import VocabMap

KS = (3, 7)


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def demo_store(path: Path, settings: Settings | None = None) -> Project:
    """A store with the run's data (the demo's without `settings`) and complete shards, built here the first time
    (the demo: ~5 min on 2 cores)."""
    from dagster._core.test_utils import instance_for_test

    project = Project(settings or demo_settings(), ArtifactStore(str(path.resolve())))
    if not shard_keys(project.store):
        log(f"building the store in {path} (data assets and shards, as make demo does)")
        with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
            if not GraphStart(instance, project, build=build_definitions).run(through=AssetKey("hidden_states")):
                raise RuntimeError(f"the demo graph failed building {path}; rerun to resume")
    return project


def open_project(config: Path | None, root: str | None, demo: Path, *, demo_shards: bool) -> Project:
    """The configured run (`config`/$EAGLE3_CONFIG, `root`/$EAGLE3_ROOT), or the demo store at `demo`
    (its shards built there first when `demo_shards`: a drafter is to be trained on them)."""
    config = config or os.environ.get(CONFIG_ENV)
    if not config:
        return demo_store(demo) if demo_shards else Project(demo_settings(), ArtifactStore(str(demo.resolve())))
    root = root or os.environ.get(ROOT_ENV)
    if not root:
        raise SystemExit(f"--config {config}: name the run's store with --root or ${ROOT_ENV}")
    project = Project(load_settings({CONFIG_ENV: str(config)}), ArtifactStore(artifact_root({ROOT_ENV: root})))
    if project.store.local_path("") is None:
        raise SystemExit(f"--root {root}: the benchmarks train beside the store and need a local directory")
    log(f"run: settings {config}, store {project.store.url_of('')}")
    return project


def shard_keys(store: ArtifactStore) -> list[str]:
    """The store's complete shards, in row order."""
    keys = [k for k in store.listdir("hidden_states") if k.startswith("rows_")]
    return sorted((k for k in keys if store.exists(f"{shard_dir(k)}/{MANIFEST_NAME}")), key=Shard.parse)


def scratch_store(project: Project, dest: Path) -> ArtifactStore:
    """A store whose inputs are the project's (linked, not copied) and whose drafter outputs are its own."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    src = project.store.local_path("")
    assert src is not None, "the benchmarks need a local store"
    for name in os.listdir(src):
        if name not in ("drafter", "drafter_eval"):
            (dest / name).symlink_to(src / name)
    return ArtifactStore(str(dest))


def steady(xs: list[float]) -> float:
    """Mean seconds per step without the first step (it carries one-off setup)."""
    return statistics.fmean(xs[1:] if len(xs) > 1 else xs)


@dataclass
class Trained:
    label: str
    steps: int
    cpu_s_per_step: float
    tokens_per_step: float
    heldout: dict[str, float]
    export_dir: Path
    cpu_s: list[float] = field(repr=False, default_factory=list)
    acc_0: list[float] = field(repr=False, default_factory=list)  # per step: the learning curve

    def as_json(self) -> dict:
        fields = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items() if k not in ("cpu_s", "acc_0")}
        return fields | {"cpu_s_train_steps": sum(self.cpu_s), "acc_0_curve": curve(list(enumerate(self.acc_0, 1)))}


def curve(logged: list[tuple[int, float]], points: int = 10) -> list[tuple[int, float]]:
    """A learning curve from (step, value) pairs in step order, at `points` even fractions of the run:
    (last step of the slice, mean value over it)."""
    cuts = sorted({round(len(logged) * i / points) for i in range(points + 1)})
    return [
        (logged[hi - 1][0], statistics.fmean(v for _, v in logged[lo:hi]))
        for lo, hi in zip(cuts, cuts[1:], strict=False)
        if hi > lo
    ]


def train(project: Project, settings: TrainingSettings, label: str, workdir: Path, *, threads: int = 1) -> Trained:
    """Our drafter trained for `settings.steps` steps from scratch, exported to `workdir/<label>/export`."""
    torch.set_num_threads(threads)
    store = scratch_store(project, workdir / label)
    cpu: list[float] = []
    tokens: list[float] = []
    acc_0: list[float] = []
    last = [time.process_time()]

    def on_metrics(step: int, m: dict[str, float]) -> None:
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now
        tokens.append(m.get("tokens", 0.0))
        acc_0.append(m.get("acc_0", 0.0))

    log(f"{label}: {settings.steps} steps ({threads} thread(s))")
    r = train_drafter(
        store, shard_keys(store), vmap=VocabMap.load(store), target=project.target(), settings=settings,
        on_metrics=on_metrics, resume=False, log=lambda _m: None,
    )  # fmt: skip
    export_drafter(store, r.model.trainable_state_dict(), r.config, aux_layer_ids=r.aux_layer_ids)
    shutil.rmtree(store.local_path("drafter/checkpoints"), ignore_errors=True)
    return Trained(
        label, r.step, steady(cpu), statistics.fmean(tokens), r.heldout, store.local_path(EXPORT_DIR), cpu, acc_0
    )


def extra_eval_prompts(demo: DemoSettings, n: int, kind: str | None = None) -> list[Prompt]:
    """`demo_extra_eval_prompts` as the eval reads prompts (of one kind, "fact" or "template", when given)."""
    rows = [p for p in demo_extra_eval_prompts(demo, n) if kind in (None, p["kind"])]
    return parse_prompts("".join(json.dumps(p) + "\n" for p in rows), f"{n} extra held-out demo prompts")


def serve(
    target: TargetModel,
    project: Project,
    drafters: dict[str, Path],
    max_tokens: int,
    *,
    prompts: list[Prompt] | None = None,
    ngram: tuple[int, int] | None = None,
    methods: dict[str, str] | None = None,
) -> dict[str, dict]:
    """label -> {"k3": {...}, "k7": {...}}: mean acceptance length, per position, drafts, decode speedup over the
    plain pass of the same interpreter, and how its output parted from greedy: `outputs_match_greedy` (every output
    equal), `parted_at_near_ties` (outputs that parted only where greedy's top two were a near tie: the engine's float
    noise, as drafter_eval judges it) and `parted` ([prompt, position] of any other parting: a defect of the
    drafter's serving). `methods` gives a drafter's vLLM method (default EAGLE-3's). `ngram=(min, max)` adds vLLM's
    n-gram prompt lookup with that window as the contestant "ngram"."""
    prompt_ids, _ = eval_prompt_ids(
        load_tokenizer(target), prompts or load_eval_prompts(project.store), project.settings.generation.chat_template_kwargs
    )
    methods = methods or {}
    specs = {n: {"draft_dir": d} | ({"method": methods[n]} if n in methods else {}) for n, d in drafters.items()}
    if ngram is not None:
        specs["ngram"] = {"method": "ngram", "prompt_lookup_min": ngram[0], "prompt_lookup_max": ngram[1]}
    names = list(specs)
    runs = [PLAIN_RUN] + [{**specs[n], "num_speculative_tokens": k} for n in names for k in KS]
    log(f"serving {len(prompt_ids)} held-out prompts: plain + {', '.join(names)} at k={KS} ({len(runs)} engines)")
    plain, *spec = generate_runs_in_subprocess(
        target.path, prompt_ids, runs, common=pass_args(target, project.settings, prompt_ids, max_tokens), timeout_s=7200
    )
    out: dict[str, dict] = {}
    results = iter(spec)
    for n in names:
        out[n] = {}
        for k in KS:
            g = next(results)
            partings = {i: parting(plain, g, i) for i, o in enumerate(g.outputs) if o != plain.outputs[i]}
            out[n][f"k{k}"] = {
                "mean_acceptance_length": g.mean_acceptance_length,
                "tokens_per_forward": g.tokens_per_forward,
                "acceptance_per_position": g.acceptance_per_position,
                "num_drafts": g.num_drafts,
                "speedup": g.decode_tokens_per_s / plain.decode_tokens_per_s,
                "outputs_match_greedy": not partings,
                "parted_at_near_ties": sum(gap < NEAR_TIE_LOGPROB for _, gap in partings.values()),
                "parted": [[i, at] for i, (at, gap) in partings.items() if gap >= NEAR_TIE_LOGPROB],
            }
    return out
