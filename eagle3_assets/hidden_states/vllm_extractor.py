"""vLLM backend: hidden states from a server running the `extract_hidden_states` method.

One `/v1/completions` request per row, the row's token ids as the prompt and
`max_tokens` 1 (`vllm_server/protocol.py` describes the files). When the shard's
directory is one the server can write into (a local store the server was given as a
write root, on the same filesystem), each request names the row's final path and
carries what the file records: the server's connector writes the sample file itself,
and this side waits for its lock and hands back a `WrittenSample` for the shard to
verify. Otherwise the server writes its raw `[T, L, H]` file in its own directory,
which is read here, checked to be exactly the row's tokens, split into aux layers and
layer N, and deleted (the server never does).

Layer id N is the last layer's output before the final norm: files from this backend
record `last_hidden_state_norm = "pre_norm"`. Requests run concurrently up to
`vllm.max_concurrency`; results come back in the order they finish. A server that
stops answering ends `extract` with a `VllmServerError` naming its URL; the rows
written before stay valid, and the shard's sample-level resume skips them on the rerun.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load

from eagle3_assets.errors import Eagle3Error
from eagle3_assets.hidden_states.base import ExtractedSample, ExtractionRequest, ExtractorConfigError, WrittenSample
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.settings import VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.client import (
    RequestRejectedError,
    ServerUnreachableError,
    VllmServerError,
    http_json,
)
from eagle3_assets.vllm_server.protocol import (
    SERVER_INFO_FILE,
    ServerPlan,
    split_layers,
    SampleParams,
    mask_spans,
    raw_hidden_states_file,
    temporary_path,
    wait_until_written,
)
from eagle3_assets.vllm_server.server import VllmServer

REQUEST_TIMEOUT_S = 1800.0  # one long row behind a full batch on a busy server


class VllmExtractionError(Eagle3Error, RuntimeError):
    """The server answered a row with something unusable; the message names the row and the server."""


def split_hidden_states(
    tensors: dict[str, torch.Tensor], *, row: int, input_ids: np.ndarray, target: TargetModel, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H] pre-norm) from a raw file's tensors; VllmExtractionError if it is not the row's."""
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
    hs = tensors["hidden_states"]  # [T, L, H], layers in `target.extraction_layer_ids` order
    layer_ids, H, T = target.extraction_layer_ids, target.hidden_size, len(want)
    if list(hs.shape) != [T, len(layer_ids), H]:
        raise VllmExtractionError(
            f"row {row}: hidden_states from {where} has shape {list(hs.shape)}, expected "
            f"{[T, len(layer_ids), H]} (layers {layer_ids}, hidden {H})"
        )
    return split_layers(hs, layer_ids, target.aux_layer_ids, target.num_layers)  # [T, 3H], [T, H] pre-norm


class VLLMExtractor:
    """A `HiddenStateExtractor` over a vLLM extraction server (started here, or one at `server_url`)."""

    backend = "vllm"
    last_hidden_state_norm = "pre_norm"

    def __init__(
        self,
        target: TargetModel,
        vllm: VllmSettings,
        *,
        server_url: str | None = None,
        write_root: Path | None = None,
        server: VllmServer | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        if not target.aux_layer_ids:
            raise ExtractorConfigError("the target's aux layer ids are not resolved (TargetModel.read resolves them)")
        self.target = target
        self.num_layers, self.hidden_size, self.aux_layer_ids = target.num_layers, target.hidden_size, target.aux_layer_ids
        self.max_concurrency = vllm.max_concurrency
        self.request_timeout_s = request_timeout_s
        if server is None:
            url = server_url or vllm.server_url
            roots = [write_root] if write_root is not None else []
            server = VllmServer.attach(url) if url else VllmServer.start(target, vllm, "extract", write_roots=roots)
        self.server = server
        self._writable: dict[Path, bool] = {}
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
        """One tiny request: the server extracts, its files are readable here, and the layers are ours."""
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
            with raw_hidden_states_file(path):
                plan = ServerPlan.read(info_path.parent)
        except (OSError, ValueError) as e:
            raise ExtractorConfigError(
                f"the vLLM server at {self.url} writes hidden states to {Path(path).parent}, but its layer ids "
                f"cannot be checked ({info_path}: {e}); the pipeline must run on the server's machine (or share "
                "its storage directory), and the server must be started with "
                "`python -m eagle3_assets.vllm_server --serve --role extract`, which records them"
            ) from None
        want = self.target.extraction_layer_ids
        if plan.layer_ids != want or plan.hidden_size != self.hidden_size:
            raise ExtractorConfigError(
                f"aux_layer_ids: the vLLM server at {self.url} extracts layers {plan.layer_ids} of a model "
                f"with hidden size {plan.hidden_size} ({plan.model}); this run needs layers "
                f"{want} (aux {list(self.aux_layer_ids)} + final {self.num_layers}), hidden size "
                f"{self.hidden_size}: restart the server with the pipeline's settings"
            )

    def writes_files(self, shard_dir: Path | None) -> bool:
        """Whether the server writes sample files into `shard_dir` where this process sees them: asked once
        per directory with a one-token probe file."""
        if shard_dir is None:
            return False
        if shard_dir not in self._writable:
            shard_dir.mkdir(parents=True, exist_ok=True)
            probe = shard_dir / f".probe{uuid.uuid4().hex[:8]}.safetensors"
            request = ExtractionRequest(-1, np.zeros(1, np.int32), np.zeros(1, np.uint8), temporary_path(probe, "probe"))
            spec = SampleSpec(self.hidden_size, self.aux_layer_ids, "bfloat16", "probe", self.last_hidden_state_norm)
            answer = self._complete(request, spec)
            written = (answer.get("kv_transfer_params") or {}).get("hidden_states_path") or request.path
            # Whichever file the server wrote (ours, or a raw one where it refused our path): wait, then remove it.
            with raw_hidden_states_file(written) as p:
                ok = written == request.path and p.is_file()
            self._writable[shard_dir] = ok
        return self._writable[shard_dir]

    def _complete(self, req: ExtractionRequest, spec: SampleSpec | None = None) -> dict:
        body: dict = {"model": self.model_id, "prompt": [int(t) for t in req.input_ids], "max_tokens": 1, "temperature": 0.0}
        if req.path is not None:
            if spec is None or req.loss_mask is None:
                raise ValueError("a request that names its file needs the sample spec and the row's loss mask")
            params = SampleParams(req.path, req.row, mask_spans(req.loss_mask), spec)
            body["kv_transfer_params"] = params.to_kv_transfer_params()
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

    def _extract_one(self, req: ExtractionRequest, spec: SampleSpec | None) -> ExtractedSample | WrittenSample:
        answer = self._complete(req, spec)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VllmExtractionError(f"row {req.row}: the vLLM server at {self.url} returned no hidden_states_path")
        if req.path is not None:
            if path != req.path:
                with raw_hidden_states_file(path):  # the server refused the path; nothing to keep
                    pass
                raise VllmExtractionError(
                    f"row {req.row}: the vLLM server at {self.url} did not write {req.path} (it wrote {path}): the "
                    "store is outside the server's write roots (--write-root)"
                )
            wait_until_written(path)
            try:
                return WrittenSample(req.row, Path(path).stat().st_size)
            except FileNotFoundError:
                raise VllmExtractionError(
                    f"row {req.row}: the vLLM server at {self.url} did not write {path}; see its log"
                ) from None
        try:
            with raw_hidden_states_file(path) as p:
                tensors = st_load(p.read_bytes())
        except OSError as e:
            raise VllmExtractionError(
                f"row {req.row}: the vLLM server at {self.url} wrote hidden states to {path}, which cannot be read "
                f"here ({e}); the pipeline must run on the server's machine or share its storage directory"
            ) from None
        aux, last = split_hidden_states(
            tensors, row=req.row, input_ids=req.input_ids, target=self.target, where=f"the vLLM server at {self.url}"
        )
        return ExtractedSample(req.row, np.asarray(req.input_ids, dtype=np.int32), aux, last)

    def extract(
        self, requests: Sequence[ExtractionRequest], spec: SampleSpec | None = None
    ) -> Iterator[ExtractedSample | WrittenSample]:
        """Results as the server finishes them, at most `max_concurrency` requests in flight.

        Longest rows are sent first, so a row the server cannot take shows up early.
        """
        if not requests:
            return
        order = iter(sorted(requests, key=lambda r: -len(r.input_ids)))
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests)), thread_name_prefix="vllm-hs")
        in_flight: set[Future[ExtractedSample | WrittenSample]] = set()

        def submit_next() -> None:
            req = next(order, None)
            if req is not None:
                in_flight.add(pool.submit(self._extract_one, req, spec))

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
