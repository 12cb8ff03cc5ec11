"""Drafter families from one data build: EAGLE-3 and DFlash variants trained on the demo's shards, served in vLLM.

Needs a store the demo built (`make demo`: responses, shards, vocab map). Each variant trains from scratch through
the one training loop (`train_drafter` with its family) into `bench/<variant>/` of that store, is exported, and is
served with the target on the demo's held-out prompts, plainly and at k=3 and k=7, in one interpreter (vLLM CPU).
Reported per variant: optimizer steps, training CPU-seconds (this process, all threads), the held-out acceptance
estimate at the best evaluation, the served mean acceptance length, and decode tokens/s over plain decoding measured
in the same run (BENCHMARKS.md, `families`).

    .venv/bin/python benchmarks/bench_families.py --store .eagle3 eagle3 dflash dflash-6-epochs

`--config FILE` names the store's settings when they are not the demo's (a run on the demo target with prompts of
its own). `--shards N` trains on the first N shards only (each variant under `bench/<name>-<N>shards/`): the families against
the data size (BENCHMARKS.md, `families by data size`). `--extra N` serves N more held-out prompts beside the 64
(`demo_extra_eval_prompts`): on 64 prompts a training seed alone moves the served figure by 4% (`demo eval set`).
`speculators-dflash` is speculators' (PyPI 0.9.0) DFlash trainer on what our `dflash` trained on (`PEERS`), named after
it: ours against the peer's at equal data and steps (BENCHMARKS.md, `dflash peer`).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.checkpoint import latest_checkpoint, read_checkpoint_state
from eagle3_assets.drafter.evaluate import load_eval_prompts
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.drafter.family import DFlash, Family, family_of
from eagle3_assets.drafter.selection import best_index
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.project import Project
from eagle3_assets.families import family_spec
from eagle3_assets.settings import CONFIG_ENV, Settings, demo_settings, load_settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vocab_map import VocabMap

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))

from convert_shards import convert  # noqa: E402
from drafter_runs import extra_eval_prompts, serve  # noqa: E402
from speculators_runs import ensure_peer_venv, planned_tokens_per_step, train_speculators  # noqa: E402

# name -> (family, overrides by settings section), each over the demo's settings; a family trains by its own recipe
# (`Settings.training_of`): DFlash's lr, epochs and weight decay are its `dflash` section's.
VARIANTS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "eagle3": ("eagle3", {}),
    "dflash": ("dflash", {}),  # the demo's: the references' recipe with 2 layers and 16 epochs
    # The recipe DFlash had before its own (BENCHMARKS.md `families`): EAGLE-3's schedule, 1 layer, 16 anchors, decay 7
    # over each slot's mean.
    "dflash-eagle3-recipe": ("dflash", {"dflash": {
        "num_layers": 1, "anchors_per_row": 16, "loss_decay": 7.0, "loss_normalization": "slot", "lr": 3e-3,
        "epochs": 16.0, "weight_decay": 0.3,
    }}),  # fmt: skip
    "dflash-3layers": ("dflash", {"dflash": {"num_layers": 3}}),
    # One lever each, at the references' 6 epochs (BENCHMARKS.md `dflash recipe`).
    "dflash-6-epochs": ("dflash", {"dflash": {"epochs": 6.0}}),
    "dflash-6-epochs-3layers": ("dflash", {"dflash": {"epochs": 6.0, "num_layers": 3}}),
    "dflash-6-epochs-lr3e-3": ("dflash", {"dflash": {"epochs": 6.0, "lr": 3e-3}}),
    "dflash-6-epochs-weight-decay": ("dflash", {"dflash": {"epochs": 6.0, "weight_decay": 0.3}}),
    "dflash-6-epochs-16-anchors": ("dflash", {"dflash": {"epochs": 6.0, "anchors_per_row": 16}}),
    "dflash-6-epochs-slot-mean": ("dflash", {"dflash": {"epochs": 6.0, "loss_normalization": "slot"}}),
}

# Trained by speculators 0.9.0 (PyPI, in its own venv: benchmarks/peer/) on the same shards, training rows and vocab map
# as our variant named here, at its steps and its tokens per step, with its shape (layers, block, anchors, mask token,
# aux layers) and schedule (lr, warmup, weight decay, seed); the rest is speculators' own DFlash recipe (D-PACE slot
# weights, cross-entropy, grad clip 1.0). Listed after that variant, which trains (or is reused) first.
PEERS: dict[str, str] = {"speculators-dflash": "dflash"}


def at_root(family: Family, root: str) -> Family:
    """`family`, writing its outputs under `root` of the store instead of its spec's directory."""
    cls = type(family)
    moved = type(cls.__name__, (cls,), {"spec": replace(cls.spec, root=root)})
    return moved(**{f.name: getattr(family, f.name) for f in fields(family)})


def family_for(name: str, settings: Settings, target: TargetModel, root: str) -> Family:
    """The variant's family, as it trains under the demo's settings with the variant's overrides, under `root`."""
    kind, overrides = VARIANTS[name]
    data = settings.model_dump()
    for section, values in overrides.items():
        data[section] = data[section] | values
    return at_root(family_of(family_spec(kind), Settings.model_validate(data), target), root)


def trained_before(family: Family, out: ArtifactStore) -> dict[str, Any]:
    """A variant's row from the export and last checkpoint an earlier run left (no training CPU-seconds)."""
    saved = read_checkpoint_state(out, latest_checkpoint(out))
    evals = list(saved.state.get("evals") or [])
    best = evals[best_index(evals)] if evals else {}
    return {
        "family": family.name, "steps": saved.step, "train_cpu_s": None, "train_wall_s": None,
        "estimate_k3": round(best.get("accept_len_k3", 0.0), 3), "estimate_k7": round(best.get("accept_len_k7", 0.0), 3),
        "export": out.local_path(EXPORT_DIR),
    }  # fmt: skip


def train_peer(
    family: DFlash, ours: dict[str, Any], store: ArtifactStore, keys: list[str], target_dir: Path, reuse: bool
) -> dict:
    """speculators' DFlash trained under `family.root` on what `family`, our variant whose row is `ours`, trained on:
    its row (no held-out estimate: speculators' validation is not ours)."""
    work = Path(store.local_path(family.root))
    run = work / "run"
    if not (reuse and (run / "result.json").exists()):
        s, d = family.training, family.dflash
        data = convert(store.local_path(""), work / "data", heldout_rows=s.heldout_rows, seed=s.seed, keys=keys)
        if (read := family.aux_layer_ids(data["aux_layer_ids"])) != data["aux_layer_ids"]:
            raise SystemExit(f"{family.root}: ours reads aux layers {read} of {data['aux_layer_ids']}; the peer reads all")
        steps = ours["steps"]
        flags = [
            "--speculator-type", "dflash", "--steps", str(steps), "--lr", repr(s.lr),
            "--warmup-steps", str(s.warmup_steps), "--weight-decay", repr(s.weight_decay), "--seed", str(s.seed),
            "--total-seq-len", str(round(planned_tokens_per_step(store, keys, s.model_copy(update={"steps": steps})))),
            # speculators' block holds the anchor too: ours drafts block_size tokens after it
            "--spec-arg", f"block-size={d.block_size + 1}", "--spec-arg", f"num-layers={d.num_layers}",
            "--spec-arg", f"max-anchors={d.anchors_per_row}", "--spec-arg", f"mask-token-id={family.mask_token_id}",
            "--spec-arg", f"dflash-decay-gamma={d.loss_decay}",
        ]  # fmt: skip
        train_speculators(ensure_peer_venv(), work / "data", target_dir, run, flags, threads=torch.get_num_threads())
    result = json.loads((run / "result.json").read_text())
    return {
        "family": family.name, "steps": result["steps"], "train_cpu_s": round(result["cpu_s_train_steps"]),
        "train_wall_s": round(result["wall_s_total_run"]), "estimate_k3": None, "estimate_k7": None,
        "export": result["export_dir"],
    }  # fmt: skip


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=["eagle3", "dflash"], choices=sorted(VARIANTS | PEERS))
    ap.add_argument("--store", default=".eagle3", help="the demo's store ($EAGLE3_ROOT)")
    ap.add_argument(
        "--reuse", action="store_true", help="serve a variant's export a previous run left (bench/<name>/drafter/export) "
        "instead of training it again; its steps and estimate are read from its last checkpoint",
    )  # fmt: skip
    ap.add_argument("--config", help="the store's settings file (default: the demo's settings)")
    ap.add_argument("--shards", type=int, help="train on the store's first N shards only (default: all)")
    ap.add_argument("--extra", type=int, default=0, help="serve N more held-out prompts beside the 64")
    args = ap.parse_args(argv)
    settings = load_settings({CONFIG_ENV: args.config}) if args.config else demo_settings()
    store = ArtifactStore(args.store)
    project = Project(settings, store)
    target = project.target()
    keys = [s.key for s in TokenizedSet.load(store).shards(settings.shard_size)][: args.shards]
    vmap = VocabMap.load(store)
    rows: dict[str, dict[str, Any]] = {}
    for name in args.variants:
        root = f"bench/{name}" + (f"-{args.shards}shards" if args.shards else "")
        if name in PEERS:
            if PEERS[name] not in rows:
                raise SystemExit(f"{name} trains as {PEERS[name]} did: name {PEERS[name]} before it")
            ours = family_for(PEERS[name], settings, target, root)
            rows[name] = train_peer(ours, rows[PEERS[name]], store, keys, project.target_dir(), args.reuse)
            continue
        family = family_for(name, settings, target, root)
        out = store.child(family.root)
        if args.reuse and out.exists(EXPORT_DIR):
            rows[name] = trained_before(family, out)
            continue
        if out.exists("drafter"):  # a fresh run each time: nothing resumed
            out.remove("drafter", recursive=True)
        before, wall = cpu_seconds(), time.perf_counter()
        result = train_drafter(store, keys, vmap=vmap, target=target, settings=family.training, family=family,
                               log=lambda line: None)  # fmt: skip
        cpu, wall = cpu_seconds() - before, time.perf_counter() - wall
        best = result.best or {}
        family.export(out, result.model.trainable_state_dict(), result.config, result.aux_layer_ids, EXPORT_DIR)
        rows[name] = {
            "family": family.name, "steps": result.step, "train_cpu_s": round(cpu), "train_wall_s": round(wall),
            "estimate_k3": round(best.get("accept_len_k3", 0.0), 3), "estimate_k7": round(best.get("accept_len_k7", 0.0), 3),
            "export": out.local_path(EXPORT_DIR),
        }  # fmt: skip
        print(f"{name}: trained {result.step} steps in {cpu:.0f} CPU-s ({wall:.0f} s)", file=sys.stderr, flush=True)
    prompts = load_eval_prompts(store)
    if args.extra:
        prompts += extra_eval_prompts(settings.demo, args.extra)
    max_tokens = settings.generation.max_new_tokens
    exports = {name: Path(row["export"]) for name, row in rows.items()}
    served = serve(target, project, exports, max_tokens, prompts=prompts,
                   methods={name: row["family"] for name, row in rows.items()})  # fmt: skip
    for name, figures in served.items():
        for k in SPECULATIVE_TOKENS:
            result = figures[f"k{k}"]
            # A parting from greedy where greedy's choice was a near tie is the engine's float noise, as drafter_eval
            # judges it; any other is a defect of the drafter's serving.
            if result["parted"]:
                raise SystemExit(f"{name} k={k}: speculative output parts from greedy away from a near tie: "
                                 f"{result['parted'][:5]}")  # fmt: skip
            rows[name][f"parted_at_near_ties_k{k}"] = result["parted_at_near_ties"]
            rows[name][f"served_k{k}"] = round(result["mean_acceptance_length"], 3)
            rows[name][f"speedup_k{k}"] = round(result["speedup"], 3)
    for row in rows.values():
        row.pop("export")
    print(json.dumps({"prompts": len(prompts), "max_tokens": max_tokens, "shards": len(keys), "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
