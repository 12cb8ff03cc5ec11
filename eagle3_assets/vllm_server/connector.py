"""The KV connector inside our vLLM extraction servers: it writes each request's hidden states to disk.

vLLM's `extract_hidden_states` speculative method caches the requested layers' states
in a KV-cache group, and a KV connector writes them out when a request finishes. This
subclass of the stock `ExampleHiddenStatesConnector` adds what the pipeline needs
(`protocol.py` describes both kinds of file):

- a request carrying our sample parameters gets its final sample file, in our format,
  written atomically at the path it names (a shard directory of the artifact store):
  the aux layers split from layer N, cast or float8-quantized, with the row's tokens and
  loss mask. One write per sample, streamed from the tensors without a joined copy; its
  values are checked finite and non-zero here, where they are computed (on the GPU there),
  and a sample that fails is not written (the error is logged, and the client fails the
  row). The client reads back only the header, ids and mask to verify it. Paths
  outside the configured `write_roots` are refused (the file goes to the server's own
  directory instead, which the client reports).
- other requests get vLLM's raw file in the server's storage directory, as before.
- on a CPU build, where the stock path's CUDA stream and pinned memory do not exist,
  the write happens synchronously, before the request is reported finished.

Loaded by vLLM from this module path (`command.kv_transfer_config`); it needs vLLM and torch.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as st_save
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from eagle3_assets.sample_file import HIDDEN_NAMES, encode_hidden, sample_buffers, tensor_problem, write_sample_file
from eagle3_assets.vllm_server.protocol import (
    SampleParams,
    is_under,
    lock_path,
    mask_from_spans,
    split_layers,
    temporary_path,
)

logger = init_logger(__name__)


@dataclass
class SamplePendingSave(PendingSave):
    sample: SampleParams | None = None  # None: a raw file in the storage directory


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


def write_atomically(buffers: list, filename: str) -> int:
    """Write `buffers` under a store-temporary name in the same directory, then rename: a reader never
    sees half a file. Returns the file's size."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
    return write_sample_file(buffers, filename, temporary_path(filename, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))


def _value_flags(aux: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[4] bool on the states' device: each tensor all finite, each not all zero (no host sync)."""
    return torch.stack([torch.isfinite(aux).all(), torch.isfinite(last).all(), aux.any(), last.any()])


def _flags_problem(flags: torch.Tensor) -> str | None:
    finite_aux, finite_last, any_aux, any_last = (bool(f) for f in flags)
    for name, finite, nonzero in zip(HIDDEN_NAMES, (finite_aux, finite_last), (any_aux, any_last), strict=True):
        if not finite:
            return f"{name} has non-finite values"
        if not nonzero:
            return f"{name} all zero"
    return None


class SampleFileConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` that writes our sample files, and writes synchronously on CPU."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._write_roots = [str(r) for r in self._kv_transfer_config.get_from_extra_config("write_roots", [])]
        spec_config = self._vllm_config.speculative_config.draft_model_config.hf_config
        # Stored in the cache in this order (vLLM sorts and de-duplicates the ids); the largest is layer N.
        self._layer_ids = sorted(set(int(i) for i in spec_config.eagle_aux_hidden_state_layer_ids))
        self._sample_params: dict[str, SampleParams] = {}

    # -- scheduler side ---------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            params = (extra or {}).get("kv_transfer_params") or {}
            sample = SampleParams.from_kv_transfer_params(params) if params else None
            if sample is None:
                continue
            if not any(is_under(sample.path, root) for root in self._write_roots):
                default = os.path.join(self._storage_path, f"{new_req.req_id}.safetensors")
                logger.error(
                    "request %s asked to write %s, outside this server's write roots %s; writing %s instead",
                    new_req.req_id, sample.path, self._write_roots, default,
                )  # fmt: skip
                self._request_filenames[new_req.req_id] = meta.new_req_filenames[new_req.req_id] = default
                continue
            self._sample_params[new_req.req_id] = sample
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        sample = self._sample_params.pop(request.request_id, None)
        if pending is not None:
            self._pending_saves[request.request_id] = SamplePendingSave(**vars(pending), sample=sample)
        return delay, params

    # -- worker side -------------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Take each new request's write lock before the client can learn its path (our lock names)."""
        if not self._is_tp_rank_zero or not self.use_lock or not self.has_connector_metadata():
            return
        for req_id, filename in getattr(self._get_connector_metadata(), "new_req_filenames", {}).items():
            if req_id not in self._lock_fds:
                self._lock_fds[req_id] = _locked(filename)

    def _split(self, states: torch.Tensor, sample: SampleParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H], last [T, H]) of the cached [T, L, H] states."""
        return split_layers(states, self._layer_ids, sample.spec.aux_layer_ids, self._layer_ids[-1])

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        sample = getattr(pending, "sample", None)
        on_gpu = self._kv_cache.device.type != "cpu"
        if sample is None and on_gpu:
            super()._submit_async_write(pending)
            return
        num_tokens = pending.token_ids.shape[0]
        slots = _slot_mapping(pending.block_ids, self._block_size)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = _locked(pending.filename)
        if not on_gpu:
            # clone: the cache blocks are freed and reused once the request is reported finished
            states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [T, L, H]
            hidden, problem = None, None
            if sample is not None:
                aux, last = self._split(states, sample)
                problem = tensor_problem(HIDDEN_NAMES[0], aux) or tensor_problem(HIDDEN_NAMES[1], last)
                hidden = encode_hidden(aux, last, sample.spec.dtype)
            self._write(pending, states, hidden, lock_fd, problem)
            self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
            return
        # GPU: as the stock connector, on its copy stream, without a sync: split and cast
        # (or quantize) on the device, copy into pinned memory, write from the thread pool.
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device, non_blocking=True), num_tokens)
            aux, last = self._split(states, sample)
            hidden = encode_hidden(aux, last, sample.spec.dtype)
            pinned = {}
            for name, t in {**hidden, "flags": _value_flags(aux, last)}.items():
                pinned[name] = torch.empty_like(t, device="cpu", pin_memory=True)
                pinned[name].copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(copy_stream)
        future = self._executor.submit(self._write_after, copied, pending, pinned, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _write_after(self, event: torch.cuda.Event, pending: PendingSave, hidden: dict, lock_fd: int | None) -> None:
        event.synchronize()
        problem = _flags_problem(hidden.pop("flags"))
        self._write(pending, None, hidden, lock_fd, problem)

    def _write(
        self,
        pending: PendingSave,
        states: torch.Tensor | None,
        hidden: dict[str, torch.Tensor] | None,
        lock_fd: int | None,
        problem: str | None = None,
    ) -> None:
        """Write the request's file (a sample file when `hidden` is given, else the raw states), then unlock.
        A sample whose values have a `problem` is not written."""
        sample = getattr(pending, "sample", None)
        try:
            if hidden is not None and sample is not None:
                # Row -1 is the client's probe of where files land (`writes_files`): its one token's
                # states may well be zero, and it is removed unread.
                if problem and sample.row >= 0:
                    logger.error("row %d (request %s) not written to %s: %s", sample.row, pending.req_id, pending.filename, problem)
                    return
                ids = pending.token_ids.numpy().astype(np.int32)
                buffers = sample_buffers(
                    row=sample.row, input_ids=ids, loss_mask=mask_from_spans(sample.loss_spans, len(ids)),
                    hidden=hidden, spec=sample.spec, backend="vllm",
                )  # fmt: skip
            else:
                buffers = [st_save({"hidden_states": states, "token_ids": pending.token_ids.clone()})]
            write_atomically(buffers, pending.filename)
        except (OSError, ValueError, RuntimeError) as e:
            # Like the stock connector: log, keep serving. The client finds no file at the
            # path it was given and fails that row, naming the path.
            logger.error("hidden states of request %s not written to %s: %r", pending.req_id, pending.filename, e)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a client waiting on LOCK_SH may read now


def _locked(filename: str) -> int:
    """An open fd holding LOCK_EX on `filename`'s lock file."""
    path = lock_path(filename)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd
