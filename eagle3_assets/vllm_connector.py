"""A hidden-states KV connector that also works on CPU, loaded by vLLM from this module path.

vLLM's `extract_hidden_states` speculative method caches the requested layers' states
in a KV-cache group, and a KV connector writes them out when a request finishes: one
safetensors file per request, `hidden_states` [T, n_layers, H] and `token_ids` [T].
The stock `ExampleHiddenStatesConnector` copies on a CUDA stream into pinned memory,
which fails on a CPU build. This subclass keeps the stock path on a GPU and, on CPU,
writes synchronously, before the request is reported finished, so the file is
complete by the time the client gets its path.

Used as (see `eagle3_assets.vllm_server.kv_transfer_config`):

    --kv-transfer-config '{"kv_connector": "CpuSafeHiddenStatesConnector",
                           "kv_connector_module_path": "eagle3_assets.vllm_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": "/some/dir"}}'

This module is imported inside vLLM's processes only: it needs vLLM and torch.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.logger import init_logger
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

CONNECTOR_NAME = "CpuSafeHiddenStatesConnector"

logger = init_logger(__name__)


class _Done:
    """Stands in for the CUDA event the stock `get_finished` polls: the write already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order: [num_blocks * block_size]."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks.reshape(-1, 1) * block_size + offsets.reshape(1, -1)).flatten()


def write_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Write under a temporary name in the same directory, then rename: a reader never sees half a file."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
    tmp = f"{filename}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CpuSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous write when the cache lives in CPU memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        num_tokens = pending.token_ids.shape[0]
        slots = _slot_mapping(pending.block_ids, self._block_size)
        # clone: the cache blocks are freed and reused once the request is reported finished
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [T, n_layers, H]
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            write_atomically({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        except OSError as e:
            # Like the stock connector: log, keep serving. The client finds no file at the
            # path it was given and fails that row, naming the path.
            logger.error("hidden states of request %s not written to %s: %r", pending.req_id, pending.filename, e)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a client waiting on LOCK_SH may read now
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
