"""Train and export the drafter: the one path the `drafter` asset and `python -m eagle3_assets.drafter` share.

Training resumes from the newest checkpoint; once it reaches its last step (or stops early),
rank 0 exports the drafter (checked against what engines load, `export.py`): the evaluated
weights with the best acceptance estimate, or the last step's (`training.export_checkpoint`).
It writes `drafter/metrics.json`, the figures `drafter_eval` reports beside its own, and puts `trained_on.json` in
the export. When the inputs differ from the release's only by added shards, it continues the released drafter
instead of starting from zero (`continuation.py`); the summary says which it did (`trained`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_assets.artifacts import ARTIFACTS
from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.calibration import (
    EstimatePoint,
    correction,
    exported_estimate,
    load_history,
    measured_against,
)
from eagle3_assets.drafter.checkpoint import CHECKPOINTS_DIR
from eagle3_assets.drafter.continuation import ContinuationPlan, model_loss_settings, plan_continuation, trained_on
from eagle3_assets.drafter.distributed import DistEnv
from eagle3_assets.drafter.export import EXPORT_DIR, EXPORT_STAGING
from eagle3_assets.drafter.family import Family, family_of
from eagle3_assets.drafter.imported_release import import_differences
from eagle3_assets.drafter.selection import BEST_DIR, load_best
from eagle3_assets.drafter.served_replay import SERVED_AS
from eagle3_assets.drafter.tensorboard import TENSORBOARD_DIR
from eagle3_assets.drafter.sources import continued_line
from eagle3_assets.drafter.train import LogFn, MetricsCallback, TrainResult, train_drafter
from eagle3_assets.drafter.vllm_eval import engine_version
from eagle3_assets.families import EAGLE3, FamilySpec
from eagle3_assets.processes import remove_dead_tempdirs
from eagle3_assets.provenance import Inputs, Provenance, expected, mark_replacing
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.vocab_map import VocabMap

DRAFTER_METRICS_FILE = "drafter/metrics.json"


@dataclass(frozen=True)
class DrafterRun:
    result: TrainResult
    export_url: str | None  # None until training finished (or on ranks > 0)
    summary: dict[str, Any]


def train_and_export(
    store: ArtifactStore,
    target: TargetModel,
    settings: Settings,
    shard_keys: Sequence[str],
    *,
    on_metrics: MetricsCallback | None = None,
    on_eval: MetricsCallback | None = None,
    log: LogFn = print,
    max_steps: int | None = None,
    family: FamilySpec = EAGLE3,
) -> DrafterRun:
    """Train `family`'s drafter on `shard_keys` (offline: all of them complete, the caller guards that; rolling: each
    as it passes its check), then export once finished, into the family's directory (`FamilySpec.root`)."""
    main = DistEnv.from_environ().is_main
    if main:  # its owner: an export replacement a kill interrupted is finished before an eval waits on it
        if swept := sweep_killed_writes(store.child(family.root)):
            log(f"drafter: removed what killed writers left ({', '.join(swept)} temporaries)")
    remove_dead_tempdirs(EXPORT_STAGING)  # a killed rank's staging copy of an export, on this machine
    trained, now, plan, vmap, inputs = run_plan(store, target, settings, shard_keys, family, owner=main)
    if not plan.continues and main:
        log(f"drafter: training from scratch: {plan.reason}")
    result = train_drafter(
        store, shard_keys, vmap=vmap, target=target, settings=trained.training,
        on_metrics=on_metrics, on_eval=on_eval, log=log, max_steps=max_steps, inputs=inputs, other_run="fresh",
        family=trained, continuation=plan if plan.continues else None, window_families=settings.drafters,
    )  # fmt: skip
    out = store.child(trained.root)
    best = result.best
    summary = {
        "trained": continued_line(result.continued) if result.continued else f"from scratch: {plan.reason}",
        "continued_from": result.continued.release_sha256 if result.continued else "",
        "step": result.step,
        "total_steps": result.total_steps,
        "resumed_from": result.resumed_from if result.resumed_from is not None else -1,
        **{f"train_{k}": round(v, 5) for k, v in result.metrics.items()},
        **{f"heldout_{k}": round(v, 5) for k, v in result.heldout.items()},
        "stopped_early": result.stopped_early,
        **({f"best_{k}": round(v, 5) if isinstance(v, float) else v for k, v in best.items()} if best else {}),
    }
    url = None
    if result.finished and DistEnv.from_environ().is_main:
        tensors, summary["exported_step"] = export_choice(out, result, settings.training.export_checkpoint, log)
        record = {**now, "continued_from": summary["continued_from"] or None}
        if result.continued and plan.imported:  # where the weights it started from were published
            record["imported"] = plan.imported
        # How an engine must serve it to serve what trained: drafter_eval holds the export's config to it.
        record[SERVED_AS] = trained.served_as(result.config, result.aux_layer_ids)
        mark_replacing(store, family.drafter_asset, out.url_of(EXPORT_DIR))
        url = trained.export(out, tensors, result.config, result.aux_layer_ids, EXPORT_DIR, trained_on=record)
        out.write_json(DRAFTER_METRICS_FILE, summary)
    return DrafterRun(result, url, summary)


def run_plan(
    store: ArtifactStore, target: TargetModel, settings: Settings, shard_keys: Sequence[str], family: FamilySpec,
    *, owner: bool = True,
) -> tuple[Family, dict[str, Any], ContinuationPlan, VocabMap, dict[str, str]]:  # fmt: skip
    """(the family's trainer, what this run trains on, whether it continues the release, the store's vocab map, its
    checkpoints' inputs), as the drafter asset decides them before training."""
    # A checkpoint trained on other data or with another recipe is not resumed: training starts fresh and says why.
    versions = Inputs(settings, store)
    want = expected(family.drafter_asset, versions)
    trained = family_of(family, settings, target)
    # What this run trains on, against what the release was trained on: continue it, or from scratch and why.
    now = trained_on(
        family=family.name, target=want.inputs["target_model"], vocab_map=want.inputs["vocab_map"],
        settings=model_loss_settings(settings, family, trained.fingerprint()),
        shards={k: versions.shard_rows(k) for k in shard_keys},
    )  # fmt: skip
    vmap = VocabMap.load(store)
    plan = plan_continuation(
        store, now, trained.root, rolling=settings.training.rolling, owner=owner,
        import_differences=import_fit(trained, target, vmap),
    )  # fmt: skip
    return trained, now, plan, vmap, run_inputs(settings, want)


def import_fit(family: Family, target: TargetModel, vmap: VocabMap) -> Callable[[ArtifactStore], list[str]]:
    """How an imported release differs from the drafter `family` builds on `vmap` (`Family.import_differences`), for
    the continuation plan."""
    return lambda store: family.import_differences(store, target, vmap)


def run_inputs(settings: Settings, want: Provenance) -> dict[str, str]:
    """What a checkpoint's data is, for its run fingerprint: the inputs' versions and every setting the shards were
    extracted with (their reads, their size), none of which is in the training settings. A checkpoint trained on
    features extracted otherwise (another `vllm.dtype`, a quantization flag) is never resumed (issue 52, item 7)."""
    extraction = (*ARTIFACTS["hidden_states"].reads(settings), "shard_size")
    return {**want.inputs, **{k: json.dumps(v) for k, v in want.settings.items() if k in extraction}}


def sweep_killed_writes(out: ArtifactStore) -> list[str]:
    """By the owner of a family's directory `out` (its trainer): what a killed writer of the export or the training
    curves left, finished (a replacement after its intent) or removed; never the release's, beside them in `drafter/`
    (the promotion's own). Returns what was swept, by kind."""
    parent = EXPORT_DIR.rsplit("/", 1)[0]
    counts = {
        "export": out.remove_temporaries(parent, "export"),
        "tensorboard": out.remove_temporaries(parent, "tensorboard") + out.remove_temporaries(TENSORBOARD_DIR),
    }
    return [f"{n} {kind}" for kind, n in counts.items() if n]


def export_choice(
    store: ArtifactStore, result: TrainResult, choice: str, log: LogFn
) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, their step) to export: the best evaluation's weights, or the last step's."""
    best = result.best
    if choice == "best" and best is not None and best["step"] != result.step:
        tensors = load_best(store, best["step"], result.fingerprint)
        if tensors is not None:
            log(
                f"drafter: exporting step {best['step']} (held-out accept_len_k3 {best['accept_len_k3']:.3f}), the best "
                f"evaluation; the last step {result.step} stays in {store.url_of(CHECKPOINTS_DIR)}"
            )
            return tensors, best["step"]
        log(f"drafter: the weights of the best step {best['step']} are not in {store.url_of(BEST_DIR)}: exporting the last")
    return result.model.trainable_state_dict(), result.step


def run_figures(store: ArtifactStore, run: DrafterRun) -> dict[str, Any]:
    """What the drafter asset's materialization shows: the summary, the export and where to look.

    The same on every rank (the metrics are summed over ranks; rank 0 writes the export). The exported weights'
    held-out estimate is also given calibrated by this store's past drafter_eval figures of the family
    (`calibration.py`): what vLLM will likely serve, and how many evaluations that rests on."""
    against = measured_against(store, engine_version())
    calibrated = calibrated_figures(load_history(store), run.result.family.name, run.summary, against)
    store = store.child(run.result.family.root)
    return {
        **run.summary,
        **calibrated,
        "family": run.result.family.name,
        "aux_layer_ids": run.result.family.aux_layer_ids(run.result.aux_layer_ids),
        "evaluations": run.result.evaluations,
        "export": store.url_of(EXPORT_DIR) if run.result.finished else "",
        "checkpoint": store.url_of(run.result.checkpoint),
        "tensorboard": store.url_of(TENSORBOARD_DIR),
    }


def calibrated_figures(
    history: list[EstimatePoint], family: str, summary: dict[str, Any], against: str = ""
) -> dict[str, Any]:
    """`estimate_k3`, `calibrated_estimate_k3` (absent without a past evaluation served `against` the same) and
    `calibration_evals_k3`, per k."""
    out: dict[str, Any] = {}
    for k in SPECULATIVE_TOKENS:
        est = exported_estimate(summary, k)
        if est is None:
            continue
        c = correction(history, family, k, against=against)
        out[f"estimate_k{k}"] = round(est, 4)
        out[f"calibration_evals_k{k}"] = 0 if c is None else c.points
        if c is not None:
            out[f"calibrated_estimate_k{k}"] = round(c.apply(est), 4)
    return out


def heldout_metrics(store: ArtifactStore) -> dict[str, float]:
    """The held-out acc_k of the last finished training run (`drafter/metrics.json`), {} when there is none."""
    if not store.exists(DRAFTER_METRICS_FILE):
        return {}
    return {k.removeprefix("heldout_"): v for k, v in store.read_json(DRAFTER_METRICS_FILE).items() if k.startswith("heldout_acc")}
