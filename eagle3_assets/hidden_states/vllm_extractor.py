"""vLLM backend: hidden states from a server running the `extract_hidden_states` method.

One `/v1/completions` request per row, the row's token ids as the prompt and
`max_tokens` 1. The server's KV connector writes a safetensors file per request
(`hidden_states` [T, L, H] for the sorted layer ids, `token_ids` [T]) and answers with
its path in `kv_transfer_params.hidden_states_path`; we read it, check it ran exactly
the row's tokens, split the aux layers from layer N, and delete it (the server never
does). Layer id N is the last layer's output before the final norm: files from this
backend record `last_hidden_state_norm = "pre_norm"`, and the drafter's target head
applies the norm once.

The server must be on this machine (or share its storage directory): the path is read
directly. Requests run concurrently up to `vllm.max_concurrency`; samples come back in
the order they finish. A server that stops answering ends `extract` with a
`VllmServerError` naming its URL; the rows written before stay valid, and the shard's
sample-level resume skips them on the rerun.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load

from eagle3_assets.hidden_states.extractor import (
    ExtractedSample,
    ExtractionRequest,
    ExtractorConfigError,
    check_aux_layer_ids,
)
from eagle3_assets.settings import VllmSettings, read_model_shape
from eagle3_assets.vllm_server import (
    SERVER_INFO_FILE,
    RequestRejectedError,
    ServerUnreachableError,
    VllmServer,
    VllmServerError,
    extraction_layer_ids,
    hidden_states_file,
    http_json,
)

REQUEST_TIMEOUT_S = 1800.0  # one long row behind a full batch on a busy server


class VllmExtractionError(RuntimeError):
    """The server answered a row with something unusable; the message names the row and the server."""


def read_hidden_states_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one file the server wrote (waiting until it is complete); the file is removed."""
    with hidden_states_file(path) as p:
        data = p.read_bytes()
    return st_load(data)


def split_hidden_states(
    tensors: dict[str, torch.Tensor],
    *,
    row: int,
    input_ids: np.ndarray,
    layer_ids: Sequence[int],
    aux_layer_ids: Sequence[int],
    num_layers: int,
    hidden_size: int,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H] pre-norm) from one file's tensors; VllmExtractionError if it is not the row's."""
    if set(tensors) != {"hidden_states", "token_ids"}:
        raise VllmExtractionError(
            f"row {row}: the file from {where} holds {sorted(tensors)}, expected hidden_states and token_ids"
        )
    ids = tensors["token_ids"].to(torch.int64).numpy()
    want = np.asarray(input_ids, dtype=np.int64)
    if ids.shape != want.shape or not np.array_equal(ids, want):
        differ = np.flatnonzero(ids != want) if ids.shape == want.shape else []
        detail = (
            f"{len(differ)} of {len(want)} token ids differ, first at position {int(differ[0])}"
            if len(differ)
            else f"{len(ids)} token ids for a row of {len(want)}"
        )
        raise VllmExtractionError(f"row {row}: {where} ran other tokens than the row ({detail})")
    hs = tensors["hidden_states"]  # [T, L, H], L = len(layer_ids), layers in `layer_ids` order
    T = len(want)
    if list(hs.shape) != [T, len(layer_ids), hidden_size]:
        raise VllmExtractionError(
            f"row {row}: hidden_states from {where} has shape {list(hs.shape)}, expected "
            f"{[T, len(layer_ids), hidden_size]} (layers {list(layer_ids)}, hidden {hidden_size})"
        )
    index = {layer: i for i, layer in enumerate(layer_ids)}
    aux = hs[:, [index[i] for i in aux_layer_ids], :].reshape(T, len(aux_layer_ids) * hidden_size)  # [T, 3H]
    last = hs[:, index[num_layers], :]  # [T, H], pre-norm
    return aux, last


class VLLMExtractor:
    """A `HiddenStateExtractor` over a vLLM extraction server (started here, or reused via `vllm.server_url`)."""

    backend = "vllm"
    last_hidden_state_norm = "pre_norm"

    def __init__(
        self,
        model_dir: str | Path,
        vllm: VllmSettings,
        *,
        aux_layer_ids: Sequence[int],
        server: VllmServer | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        shape = read_model_shape(str(model_dir))
        if shape is None or not shape.hidden_size:
            raise ExtractorConfigError(f"target model: cannot read its shape from {model_dir}/config.json")
        self.num_layers = shape.num_layers
        self.hidden_size = shape.hidden_size
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.layer_ids = extraction_layer_ids(self.aux_layer_ids, self.num_layers)
        self.max_concurrency = vllm.max_concurrency
        self.request_timeout_s = request_timeout_s
        self.server = server or VllmServer.for_run(model_dir, vllm, "extract", aux_layer_ids=self.aux_layer_ids)
        try:
            served = self.server.served_model()
            self.model_id = served.model_id
            # The request generates one token, which needs one more position of context.
            self.max_context = served.max_model_len - 1
            self._check_server()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    def _check_server(self) -> None:
        """One tiny request: the server extracts, the files are readable here, and the layers are ours."""
        probe = ExtractionRequest(row=-1, input_ids=np.zeros(1, dtype=np.int32))
        answer = self._complete(probe)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ExtractorConfigError(
                f"the vLLM server at {self.url} does not return hidden states (no "
                "kv_transfer_params.hidden_states_path): it was not started for extraction; start one with "
                "`python -m eagle3_assets.vllm_server --serve --role extract` (a phase = one server)"
            )
        info_path = Path(path).parent / SERVER_INFO_FILE
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError) as e:
            self._discard(path)
            raise ExtractorConfigError(
                f"the vLLM server at {self.url} writes hidden states to {Path(path).parent}, but its layer ids "
                f"cannot be checked ({info_path}: {e}); the pipeline must run on the server's machine, and the "
                "server must be started with `python -m eagle3_assets.vllm_server --serve --role extract`, which "
                "records them"
            ) from None
        if info.get("layer_ids") != self.layer_ids or info.get("hidden_size") != self.hidden_size:
            self._discard(path)
            raise ExtractorConfigError(
                f"aux_layer_ids: the vLLM server at {self.url} extracts layers {info.get('layer_ids')} of a model "
                f"with hidden size {info.get('hidden_size')} ({info.get('model')}); this run needs layers "
                f"{self.layer_ids} (aux {list(self.aux_layer_ids)} + final {self.num_layers}), hidden size "
                f"{self.hidden_size}: restart the server with the pipeline's settings"
            )
        self._read(probe, answer)

    def _complete(self, req: ExtractionRequest) -> dict:
        body = {
            "model": self.model_id,
            "prompt": [int(t) for t in req.input_ids],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        what = f"row {req.row}" if req.row >= 0 else "a probe request"
        try:
            return http_json(f"{self.url}/v1/completions", body, timeout=self.request_timeout_s)
        except ServerUnreachableError as e:
            raise VllmServerError(
                f"{self.server.describe_down()} while extracting {what} ({e}); rows finished before are kept, "
                "and a rerun of the shard resumes from them once the server is back"
            ) from None
        except RequestRejectedError as e:
            if e.status >= 500 and not self.server.is_healthy():
                raise VllmServerError(f"{self.server.describe_down()} while extracting {what} ({e})") from None
            raise VllmExtractionError(
                f"{what} ({len(req.input_ids)} tokens): the vLLM server at {self.url} rejected it: "
                f"HTTP {e.status}: {e.message}"
            ) from None

    def _read(self, req: ExtractionRequest, answer: dict) -> tuple[torch.Tensor, torch.Tensor]:
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VllmExtractionError(f"row {req.row}: the vLLM server at {self.url} returned no hidden_states_path")
        try:
            tensors = read_hidden_states_file(path)
        except OSError as e:
            raise VllmExtractionError(
                f"row {req.row}: the vLLM server at {self.url} wrote hidden states to {path}, which cannot be read "
                f"here ({e}); the pipeline must run on the server's machine or share its storage directory"
            ) from None
        return split_hidden_states(
            tensors,
            row=req.row,
            input_ids=req.input_ids,
            layer_ids=self.layer_ids,
            aux_layer_ids=self.aux_layer_ids,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            where=f"the vLLM server at {self.url}",
        )

    @staticmethod
    def _discard(path: str) -> None:
        try:
            with hidden_states_file(path):
                pass
        except OSError:
            pass

    def _extract_one(self, req: ExtractionRequest) -> ExtractedSample:
        aux, last = self._read(req, self._complete(req))
        return ExtractedSample(
            row=req.row,
            input_ids=np.asarray(req.input_ids, dtype=np.int32),
            aux_hidden_states=aux,  # [T, 3H]
            last_hidden_state=last,  # [T, H], pre-norm
        )

    def extract(self, requests: Sequence[ExtractionRequest]) -> Iterator[ExtractedSample]:
        """Samples as the server finishes them, at most `max_concurrency` requests in flight.

        Longest rows are sent first, so a row the server cannot take shows up early.
        """
        if not requests:
            return
        order = iter(sorted(requests, key=lambda r: -len(r.input_ids)))
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests)), thread_name_prefix="vllm-hs")
        in_flight: set[Future[ExtractedSample]] = set()

        def submit_next() -> None:
            req = next(order, None)
            if req is not None:
                in_flight.add(pool.submit(self._extract_one, req))

        try:
            for _ in range(self.max_concurrency):
                submit_next()
            while in_flight:
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for fut in done:
                    in_flight.discard(fut)
                    sample = fut.result()  # raises the row's error
                    submit_next()
                    yield sample
        finally:
            # On an error (or when the caller stops early): send nothing more; requests already
            # in flight finish and delete their files.
            for fut in in_flight:
                fut.cancel()
            pool.shutdown(wait=True)

    def close(self) -> None:
        """Stop the server if this extractor started it; a reused one keeps running."""
        self.server.stop()
