"""Where a training rank reports: Dagster (through Pipes) when the `drafter` asset launched it, else stdout.

One process speaks to Dagster: the first rank on the node that launched the job (only that
node's torchrun has the Pipes environment), which on one node is rank 0. It sends its logs, a
progress observation every OBSERVE_EVERY steps and one per held-out evaluation (all only where it is
rank 0: training logs there) and the figures of the finished run (equal on every rank). `dagster_pipes` is the small protocol package made for processes
Dagster starts; it imports no Dagster, so the command line keeps working where Dagster is absent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from dagster_pipes import PipesContext, PipesEnvVarParamsLoader, open_dagster_pipes

from eagle3_assets.drafter.distributed import DistEnv

OBSERVE_EVERY = 10  # steps between progress observations in the UI
METRICS_MESSAGE = "metrics"


class Report:
    def __init__(self, pipes: PipesContext | None):
        self.pipes = pipes

    def log(self, message: str) -> None:
        print(message, flush=True)  # into the rank's own log, which torchrun keeps
        if self.pipes is not None:
            self.pipes.log.info(message)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        if self.pipes is not None and step % OBSERVE_EVERY == 0:
            self.pipes.report_custom_message({"kind": METRICS_MESSAGE, "step": step, **values})

    def evaluation(self, step: int, values: Mapping[str, float]) -> None:
        """Every held-out evaluation is observed (they are few): the UI plots the acceptance estimate."""
        if self.pipes is not None:
            self.pipes.report_custom_message({"kind": METRICS_MESSAGE, "step": step, **values})

    def finished(self, figures: Mapping[str, Any]) -> None:
        """The run's figures become the asset's materialization (lists and mappings as JSON)."""
        if self.pipes is None:
            return
        self.pipes.report_asset_materialization(
            metadata={
                k: {"raw_value": v, "type": "json"} if isinstance(v, list | dict) else v for k, v in figures.items()
            }
        )


@contextlib.contextmanager
def open_report(env: DistEnv) -> Iterator[Report]:
    if env.local_rank == 0 and PipesEnvVarParamsLoader().is_dagster_pipes_process():
        with open_dagster_pipes() as pipes:
            yield Report(pipes)
    else:
        yield Report(None)
