"""Train and export the drafter from the command line, also under torchrun for data-parallel GPUs:

    EAGLE3_CONFIG=run.yaml EAGLE3_ROOT=s3://bucket/eagle3 \\
        torchrun --nproc-per-node 8 -m eagle3_assets.drafter

Settings from $EAGLE3_CONFIG, the store at $EAGLE3_ROOT, the target the settings name,
every shard of the tokenized set and the stored vocab map: the same inputs and the same
`train_and_export` as the `drafter` asset, which launches exactly this under torchrun and
hears rank 0 through Dagster Pipes (`report.py`). Without Dagster there is no recorded check
status to consult, so the guard here reads each shard's `_SUCCESS.json` against the
tokenized set; the loader then checks every sample as it reads it. Rolling training
(`training.mode: rolling`) waits for each shard and checks it itself, so it skips this guard.

Exit status: 0 done, 1 failed (a retry may help), 3 refused (`launch.EXIT_REFUSED`: it will not).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from eagle3_assets.drafter.distributed import DistEnv
from eagle3_assets.drafter.export import TRAINER_LEASE_DIR
from eagle3_assets.drafter.launch import EXIT_REFUSED
from eagle3_assets.drafter.report import Report, open_report
from eagle3_assets.drafter.run import DrafterRun, run_figures, train_and_export
from eagle3_assets.errors import Eagle3Error, Refusal
from eagle3_assets.families import EAGLE3, FamilySpec, family_names, family_spec
from eagle3_assets.hidden_states.integrity import manifest_problem
from eagle3_assets.leases import RUN_ID_ENV, Lease
from eagle3_assets.processes import die_with_parent
from eagle3_assets.project import Project
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.tokenized import TokenizedSet

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torch's elastic launcher in every rank's environment
TORCHRUN_NAMES = ("torch.distributed.run", "torchrun")


class UnusableShards(Refusal):
    """Some shard's `_SUCCESS.json` does not match the tokenized set."""


def train(report: Report, max_steps: int | None, family: FamilySpec = EAGLE3) -> DrafterRun:
    project = Project.from_environment()
    store, settings = project.store, project.settings
    target = project.target()
    tokenized = TokenizedSet.load(store)
    shards = tokenized.shards(settings.shard_size)
    if not settings.training.rolling:
        spec = SampleSpec(target.hidden_size, target.aux_layer_ids, settings.extraction.storage_dtype)
        bad = {s.key: p for s in shards if (p := manifest_problem(store, tokenized, s, spec))}
        if bad:
            raise UnusableShards(
                "drafter refuses to train: " + "; ".join(f"{k}: _SUCCESS.json {p}" for k, p in bad.items())
            )
    # One trainer per drafter directory, whoever started it (another $DAGSTER_HOME, a second start command):
    # rank 0 holds the lease and checks it before each checkpoint, record and delete; the others write nothing.
    lease_dir = f"{family.root}/{TRAINER_LEASE_DIR}".lstrip("/")
    lease = Lease(store, lease_dir, os.environ.get(RUN_ID_ENV, "")) if DistEnv.from_environ().is_main else None
    with lease or nullcontext():
        owned = store.guarded(lease.check, lease.me.describe()) if lease else store
        run = train_and_export(
            owned, target, settings, [s.key for s in shards], on_metrics=report.metrics, on_eval=report.evaluation,
            log=report.log, max_steps=max_steps, family=family,
        )  # fmt: skip
    report.finished(run_figures(store, run))
    return run


def main(argv: Sequence[str] | None = None) -> int:
    # torchrun starts each rank in a session of its own: a SIGKILL of torchrun (or of everything above it)
    # would leave the rank training beside the rerun's, writing the same checkpoints and releasing shards.
    if TORCHRUN_ENV in os.environ and not die_with_parent(TORCHRUN_NAMES):
        print("error: its launcher (torchrun) died before this rank started; not training", file=sys.stderr)
        return 1
    ap = argparse.ArgumentParser(prog="python -m eagle3_assets.drafter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-steps", type=int, default=None, help="stop (with a checkpoint) at this global step")
    ap.add_argument("--family", choices=family_names(), default=EAGLE3.name, help="the drafter family to train")
    args = ap.parse_args(argv)
    env = DistEnv.from_environ()
    with open_report(env) as report:
        if env.world_size > 1:
            report.log(f"drafter: rank {env.rank} of {env.world_size} (local rank {env.local_rank}) started")
        try:
            run = train(report, args.max_steps, family_spec(args.family))
        except Eagle3Error as e:
            # The rank's last line: the launcher quotes it when the job fails.
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1 if e.retryable else EXIT_REFUSED
    if run.export_url:
        print(f"drafter: exported to {run.export_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
