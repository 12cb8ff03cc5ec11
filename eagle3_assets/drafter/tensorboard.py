"""Training curves as TensorBoard event files under `drafter/tensorboard/` of the store."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from eagle3_assets.storage import ArtifactStore

TENSORBOARD_DIR = "drafter/tensorboard"


class TensorBoard:
    """Event files under `drafter/tensorboard/`: written in place on a local store; on a remote
    one written locally and copied (as `run_from_step_<n>/`) at each checkpoint and at the end."""

    def __init__(self, store: ArtifactStore, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.store = store
        local = store.local_path(TENSORBOARD_DIR)
        self._tmp: Path | None = None
        if local is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="drafter-tb-"))
            self.remote_rel = f"{TENSORBOARD_DIR}/run_from_step_{start_step}"
            log_dir = self._tmp
        else:
            local.mkdir(parents=True, exist_ok=True)
            log_dir = local
        # purge_step drops events a killed run logged after its last checkpoint, so the
        # curve TensorBoard draws is the one the resumed run continues.
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"drafter/{k}", v, step)

    def sync(self) -> None:
        self.writer.flush()
        if self._tmp is not None:
            self.store.put_dir(self._tmp, self.remote_rel)

    def close(self) -> None:
        self.sync()
        self.writer.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
