"""Where a training run starts: the newest checkpoint of the same run, restored on every rank, or step 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_assets.drafter.checkpoint import (
    CHECKPOINTS_DIR,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
)
from eagle3_assets.drafter.data import DataPosition
from eagle3_assets.drafter.distributed import barrier
from eagle3_assets.drafter.fingerprint import differences, with_settings_added_later

if TYPE_CHECKING:
    from eagle3_assets.drafter.train import LogFn, OtherRun, _Run


def resume_from_checkpoint(run: _Run, log: LogFn, other_run: OtherRun) -> tuple[int, DataPosition, str, dict[str, float]]:
    """(step, next data position, checkpoint, its last metrics) restored from the newest checkpoint, with the
    held-out evaluations made before it (`run.evals`).

    A checkpoint of another run (other data, another recipe) is never resumed: `other_run="refuse"` fails
    naming what differs; "fresh" removes the checkpoints, says why, and starts at step 0. A rolling pass that starts
    at step 0 clears the window records of the shards it trains (another run's: `ShardWindow.start_over`), so the
    window admits them again and the released ones are extracted again."""
    if run.env.is_main:  # a checkpoint write a kill left: finished (after its intent) or removed, before any rank looks
        run.out.remove_temporaries(CHECKPOINTS_DIR)
    barrier()
    rel = latest_checkpoint(run.out)
    if rel is None:
        if run.window is not None:
            run.window.start_over()
        return 0, DataPosition(), "", {}
    saved = read_checkpoint_state(run.out, rel)
    if diffs := differences(with_settings_added_later(saved.run), run.fingerprint):
        where = run.out.url_of(CHECKPOINTS_DIR)
        if other_run == "fresh":
            barrier()  # every rank has read the checkpoint's state before rank 0 removes it
            if run.env.is_main:
                log(f"drafter: not resuming {run.out.url_of(rel)}, made by another run ({'; '.join(diffs)}); "
                    f"removing {where} and starting fresh")  # fmt: skip
                run.out.remove(CHECKPOINTS_DIR, recursive=True)
            barrier()
            if run.window is not None:
                run.window.start_over()
            return 0, DataPosition(), "", {}
        raise CheckpointError(
            f"{run.out.url_of(rel)} belongs to a different run ({'; '.join(diffs)}); "
            f"remove {where} (or pass resume=False) to start over"
        )  # fmt: skip
    ck = load_checkpoint(
        run.out, rel, model=run.model, optimizer=run.optimizer, param_names=run.param_names, scheduler=run.scheduler
    )
    pos = DataPosition(*ck.next_position)
    if run.env.is_main:
        log(f"drafter: resuming from {rel} (step {ck.step} of {run.total_steps}, epoch {pos.epoch} batch {pos.batch})")
    if run.ledger is not None:
        # `sample_ledger` is not in the run's fingerprint (it changes nothing learnt): a run resumed with it on,
        # from a checkpoint that kept none, has no ledger of the steps before, and says so.
        if "ledger" in ck.state:
            run.ledger, run.ledger_from = list(ck.state["ledger"]), int(ck.state.get("ledger_from", 1))
        else:
            run.ledger_from = ck.step + 1
            if run.env.is_main:
                log(f"drafter: training.sample_ledger is on, but {rel} kept no ledger: the ledger starts at step "
                    f"{run.ledger_from} (steps 1-{ck.step} are not in it)")  # fmt: skip
    if run.window is not None:
        # A kill after a shard's last checkpoint may have left its record or its release undone.
        run.window.reconcile(pos.epoch, run.loader.steps_before)
    run.evals = list(ck.state.get("evals") or [])
    return ck.step, pos, rel, dict(ck.state.get("metrics") or {})
