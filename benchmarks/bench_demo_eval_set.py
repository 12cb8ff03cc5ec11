"""How much the demo's 64 eval prompts decide its served figure (issue 54, item 5).

Demo stores built on targets that differ in the last float bits (`bench_demo_isa.py`) served their drafters 10% / 17%
apart (k=3 / k=7) on the 64 eval prompts. This serves each store's exported EAGLE-3 drafter again, in one vLLM
interpreter per store, on those 64 and on `--extra` more held-out prompts of the same kinds (facts about held-out
entities, template prompts; `demo_extra_eval_prompts`, none of them a pipeline or eval prompt), and prints per store
the mean acceptance length on each set (the extra one also by kind) and on both, then the spread across the stores (max / min - 1). With
`--seeds`, a drafter is also trained on each store's data under each training seed (the demo's recipe, beside the store
in `--work`) and served the same way: how far training alone moves the figure on one target.

    .venv/bin/python benchmarks/bench_demo_eval_set.py --config demo.yaml --stores ROOT [ROOT ...] [--extra 448]
        [--seeds 1 2 --work DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafter_runs import KS, extra_eval_prompts, log, serve, train
from eagle3_assets.drafter.evaluate import eval_max_tokens, load_eval_prompts
from eagle3_assets.drafter.export import EXPORT_DIR
from eagle3_assets.project import Project
from eagle3_assets.settings import CONFIG_ENV, load_settings
from eagle3_assets.storage import ArtifactStore


def _merged(parts: list[dict], ks=KS) -> dict:
    """Several sets' figures as one: acceptance lengths are tokens per round, so each set weighs by its rounds."""
    rounds = {f"k{k}": sum(p["rounds"][f"k{k}"] for p in parts) for k in ks}
    merged = {f"k{k}": sum(p[f"k{k}"] * p["rounds"][f"k{k}"] for p in parts) / rounds[f"k{k}"] for k in ks}
    return merged | {"rounds": rounds}


def served(project: Project, extra: int, export: Path) -> dict[str, dict]:
    """{"eval64": {"k3": ..., "k7": ..., "rounds": ...}, "extra_fact", "extra_template", "extra", "both"}: mean
    acceptance lengths of the drafter exported at `export`; each set served alone, "extra" and "both" merged."""
    prompts = {"eval64": load_eval_prompts(project.store)} | {
        f"extra_{kind}": extra_eval_prompts(project.settings.demo, extra, kind) for kind in ("fact", "template")
    }
    target, tokens = project.target(), eval_max_tokens(project.settings)
    out: dict[str, dict] = {}
    for name, ps in prompts.items():
        figures = serve(target, project, {"eagle3": export}, tokens, prompts=ps)["eagle3"]
        if not all(figures[f"k{k}"]["outputs_match_greedy"] for k in KS):
            raise SystemExit(f"{project.store.url_of('')}: speculative output differs from greedy on {name}")
        out[name] = {f"k{k}": figures[f"k{k}"]["mean_acceptance_length"] for k in KS}
        out[name]["rounds"] = {f"k{k}": figures[f"k{k}"]["num_drafts"] for k in KS}
    out["extra"] = _merged([out["extra_fact"], out["extra_template"]])
    out["both"] = _merged([out["eval64"], out["extra"]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the demo stores' settings (all the same)")
    parser.add_argument("--stores", nargs="+", required=True, help="demo store roots with an exported drafter")
    parser.add_argument("--extra", type=int, default=448, help="held-out prompts beside the 64 (448: 512 in all)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[], help="train a drafter per store under these seeds")
    parser.add_argument("--work", type=Path, help="where the --seeds drafters are trained")
    args = parser.parse_args()
    if args.seeds and args.work is None:
        parser.error("--seeds needs --work: the drafters are trained there")
    settings = load_settings({CONFIG_ENV: str(args.config)})
    results = {}
    for n, root in enumerate(args.stores):
        project = Project(settings, ArtifactStore(str(Path(root).resolve())))
        log(f"{root}: serving its drafter on the 64 eval prompts and {args.extra} more")
        results[root] = served(project, args.extra, Path(project.store.local_path(EXPORT_DIR)))
        print(json.dumps({"store": root, "seed": settings.training.seed, **results[root]}), flush=True)
        for seed in args.seeds:
            recipe = settings.training.model_copy(update={"seed": seed})
            trained = train(project, recipe, f"store{n}-seed{seed}", args.work, threads=2)
            figures = served(project, args.extra, trained.export_dir)
            print(json.dumps({"store": root, "seed": seed, "steps": trained.steps, **figures}), flush=True)
    for name in ("eval64", "extra_fact", "extra_template", "extra", "both"):
        spread = {
            f"k{k}": round(max(r[name][f"k{k}"] for r in results.values()) / min(r[name][f"k{k}"] for r in results.values()) - 1, 4)
            for k in KS
        }
        print(json.dumps({"set": name, "spread": spread}), flush=True)


if __name__ == "__main__":
    main()
