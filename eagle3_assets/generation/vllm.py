"""Generation through a vLLM server's completions API, requests in flight concurrently.

Each prompt goes as the token ids `responses` rendered (`prompt: [ids]`), so the engine
sees exactly those tokens, and the answer's `token_ids` (`return_token_ids`) are exactly
what it produced, the stop token included. The server's reasoning parser is not used:
the reasoning is found on the token ids, by the rule both backends share.

A request the server rejects (a prompt over the context), or one a healthy server gives no answer
within the request timeout, becomes that row's `Generated.failed`; a server that stops answering fails the whole call with a
`VllmServerError` naming its URL, so a run never records every remaining row as failed
because the server went away.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3_assets.generation.base import Generated
from eagle3_assets.settings import GenerationSettings, VllmSettings
from eagle3_assets.target import TargetModel, stop_token_ids
from eagle3_assets.vllm_server.client import RequestRejectedError, ServerUnreachableError, VllmServerError, http_json
from eagle3_assets.vllm_server.protocol import raw_hidden_states_file
from eagle3_assets.vllm_server.server import VllmServer

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 3600.0  # one long reasoning trace on a busy server


class VLLMGenerator:
    """A `Generator` over a vLLM server (started for this generator, or reused via `vllm.server_url`)."""

    name = "vllm"

    def __init__(
        self,
        target: TargetModel,
        settings: GenerationSettings,
        vllm: VllmSettings,
        *,
        server: VllmServer | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        self.settings = settings
        self.vllm = vllm
        self.request_timeout_s = request_timeout_s
        self.stop_token_ids = stop_token_ids(target)
        self.server = server or VllmServer.for_run(target, vllm, "generate")
        try:
            served = self.server.served_model()
            self.model_id, self.max_model_len = served.model_id, served.max_model_len
        except BaseException:
            self.close()
            raise
        self._warned_hidden_states = False

    @property
    def url(self) -> str:
        return self.server.url

    def _request_body(self, prompt: list[int]) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self.model_id,
            "prompt": prompt,
            "max_tokens": max(1, min(s.max_new_tokens, self.max_model_len - len(prompt))),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": 0,  # off, as in HFGenerator; generation_config.json defaults apply to the rest
            "seed": s.seed,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }

    def complete(self, prompt: list[int]) -> Generated:
        """One prompt. RequestRejectedError for a rejected request, VllmServerError when the server is down."""
        if len(prompt) >= self.max_model_len:
            return Generated.failed(f"prompt has {len(prompt)} tokens; the server's context is {self.max_model_len}")
        try:
            answer = http_json(f"{self.url}/v1/completions", self._request_body(prompt), timeout=self.request_timeout_s)
        except ServerUnreachableError as e:
            if self.server.is_healthy():
                # The server answers, this request did not (it timed out): the row fails alone, retried up to
                # generation.max_row_attempts times; failing the whole run would stall every row behind it.
                return Generated.failed(
                    f"no answer from the vLLM server at {self.url}, which is healthy, within the request timeout of "
                    f"{self.request_timeout_s:g} s ({e})"
                )
            raise VllmServerError(f"{self.server.describe_down()} ({e})") from None
        self._drop_hidden_states(answer)
        choice = answer["choices"][0]
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            return Generated.failed(f"vLLM finished the request with {finish!r}")
        return Generated([int(t) for t in choice["token_ids"]], finish)

    def _drop_hidden_states(self, answer: dict[str, Any]) -> None:
        """A server that also extracts writes each prompt's hidden states: nobody needs them."""
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            return
        if not self._warned_hidden_states:
            self._warned_hidden_states = True
            log.warning(
                "the vLLM server at %s extracts hidden states, so every request also writes one file "
                "(deleted here); a server started with --role generate does not",
                self.url,
            )
        try:
            with raw_hidden_states_file(path):
                pass
        except OSError as e:  # not on this machine: nothing to clean up from here
            log.warning("cannot remove %s written by the vLLM server at %s: %s", path, self.url, e)

    def _one(self, prompt: list[int]) -> Generated:
        try:
            return self.complete(prompt)
        except RequestRejectedError as e:
            if e.status >= 500 and not self.server.is_healthy():
                raise VllmServerError(f"{self.server.describe_down()} (HTTP {e.status}: {e.message})") from None
            return Generated.failed(f"vLLM server at {self.url} rejected the request (HTTP {e.status}): {e.message}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return Generated.failed(f"unexpected answer from the vLLM server at {self.url}: {type(e).__name__}: {e}")

    def generate(self, prompts: list[list[int]]) -> list[Generated]:
        """One `Generated` per prompt, in order; up to `vllm.max_concurrency` requests in flight."""
        if not prompts:
            return []
        workers = min(self.vllm.max_concurrency, len(prompts))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-gen") as pool:
            futures = [pool.submit(self._one, p) for p in prompts]
            try:
                return [f.result() for f in futures]
            except VllmServerError:
                for f in futures:
                    f.cancel()
                raise

    def close(self) -> None:
        """Stop the server if this generator started it; a reused one keeps running."""
        self.server.stop()
