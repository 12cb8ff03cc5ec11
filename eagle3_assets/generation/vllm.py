"""Generation through a vLLM server's chat API, requests in flight concurrently.

The server renders each conversation with the model's own chat template, exactly as
`HFGenerator` does. With `--reasoning-parser` the server hands back the reasoning
apart from the answer (`message.reasoning`); without one, the text is split here with
`split_reasoning`. Token counts come from the engine (`usage`, and the generated
token ids, from which reasoning tokens are counted: vLLM reports 0 for them).

A request the server rejects (template error, prompt over the context) becomes that
row's `Completion.failed`; a server that stops answering fails the whole call with a
`VllmServerError` naming its URL, so a run never records every remaining row as failed
because the server went away.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.generation.base import Completion, Message, split_reasoning
from eagle3_assets.settings import GenerationSettings, VllmSettings
from eagle3_assets.target_model import load_tokenizer
from eagle3_assets.vllm_server import (
    RequestRejectedError,
    ServerUnreachableError,
    VllmServer,
    VllmServerError,
    hidden_states_file,
    http_json,
)

log = logging.getLogger(__name__)

REASONING_TAGS = ("<think>", "</think>")
REQUEST_TIMEOUT_S = 3600.0  # one long reasoning trace on a busy server


@dataclass(frozen=True)
class ChatResult:
    """One answered conversation: the row's `Completion` and the token ids the engine generated."""

    completion: Completion
    token_ids: list[int]


class VLLMGenerator:
    """A `Generator` over a vLLM server (started for this generator, or reused via `vllm.server_url`)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        settings: GenerationSettings,
        vllm: VllmSettings,
        *,
        server: VllmServer | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        self.settings = settings
        self.vllm = vllm
        self.request_timeout_s = request_timeout_s
        # Counting reasoning tokens needs the tokenizer (the close tag's id); the model stays on the server.
        self.tokenizer = load_tokenizer(model_dir)
        self.close_tag_id = self.tokenizer.convert_tokens_to_ids(REASONING_TAGS[1])
        self.server = server or VllmServer.for_run(model_dir, vllm, "generate")
        try:
            self.model_id = self.server.served_model().model_id
        except BaseException:
            self.close()
            raise
        self._warned_hidden_states = False

    @property
    def url(self) -> str:
        return self.server.url

    def _request_body(self, messages: list[Message]) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self.model_id,
            "messages": messages,
            "max_tokens": s.max_new_tokens,  # the server lowers it to what the context leaves
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": 0,  # off, as in HFGenerator; generation_config.json defaults apply to the rest
            "seed": s.seed,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }

    def chat(self, messages: list[Message]) -> ChatResult:
        """One conversation. RequestRejectedError for a rejected request, VllmServerError when the server is down."""
        try:
            answer = self._post("/v1/chat/completions", self._request_body(messages))
        except ServerUnreachableError as e:
            raise VllmServerError(f"{self.server.describe_down()} ({e})") from None
        self._drop_hidden_states(answer)
        choice = answer["choices"][0]
        message = choice.get("message") or {}
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        usage = answer.get("usage") or {}
        content = message.get("content") or ""
        if message.get("reasoning") is not None:  # the server's reasoning parser split it
            reasoning = message["reasoning"]
        elif message.get("reasoning_content") is not None:  # older vLLM field name
            reasoning = message["reasoning_content"]
        else:
            reasoning, content = split_reasoning(content, *REASONING_TAGS)
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            return ChatResult(Completion.failed(f"vLLM finished the request with {finish!r}"), token_ids)
        return ChatResult(
            Completion(
                reasoning=reasoning,
                content=content,
                finish_reason=finish,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", len(token_ids))),
                reasoning_tokens=self._reasoning_tokens(token_ids, reasoning),
            ),
            token_ids,
        )

    def _reasoning_tokens(self, token_ids: list[int], reasoning: str) -> int:
        # Same count as HFGenerator: through the close tag when it was generated, else the reasoning text's tokens.
        if self.close_tag_id is not None and self.close_tag_id in token_ids:
            return token_ids.index(self.close_tag_id) + 1
        return len(self.tokenizer(reasoning, add_special_tokens=False)["input_ids"]) if reasoning else 0

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return http_json(f"{self.url}{path}", body, timeout=self.request_timeout_s)

    def _drop_hidden_states(self, answer: dict[str, Any]) -> None:
        """A server that also extracts writes each chat prompt's hidden states: nobody needs them."""
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            return
        if not self._warned_hidden_states:
            self._warned_hidden_states = True
            log.warning(
                "the vLLM server at %s extracts hidden states, so every chat request also writes one file "
                "(deleted here); a server started with --role generate does not",
                self.url,
            )
        try:
            with hidden_states_file(path):
                pass
        except OSError as e:  # not on this machine: nothing to clean up from here
            log.warning("cannot remove %s written by the vLLM server at %s: %s", path, self.url, e)

    def _one(self, messages: list[Message]) -> Completion:
        try:
            return self.chat(messages).completion
        except RequestRejectedError as e:
            if e.status >= 500 and not self.server.is_healthy():
                raise VllmServerError(f"{self.server.describe_down()} (HTTP {e.status}: {e.message})") from None
            return Completion.failed(f"vLLM server at {self.url} rejected the request (HTTP {e.status}): {e.message}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return Completion.failed(f"unexpected answer from the vLLM server at {self.url}: {type(e).__name__}: {e}")

    def generate(self, conversations: list[list[Message]]) -> list[Completion]:
        """One `Completion` per conversation, in order; up to `vllm.max_concurrency` requests in flight."""
        if not conversations:
            return []
        workers = min(self.vllm.max_concurrency, len(conversations))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-chat") as pool:
            futures = [pool.submit(self._one, m) for m in conversations]
            try:
                return [f.result() for f in futures]
            except VllmServerError:
                for f in futures:
                    f.cancel()
                raise

    def close(self) -> None:
        """Stop the server if this generator started it; a reused one keeps running."""
        self.server.stop()
