"""Talking to a vLLM server over HTTP: JSON requests, health, the served model, free ports.

urllib only: starting, reaching and supervising a server needs neither torch nor vLLM.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from eagle3_assets.errors import Eagle3Error

HEALTH_TIMEOUT_S = 10.0


class VllmServerError(Eagle3Error, RuntimeError):
    """A server cannot be started, reached or used; the message names its URL."""


class ServerUnreachableError(VllmServerError):
    """No HTTP answer at all (refused, reset, timed out): the server is down or gone."""


class RequestRejectedError(Eagle3Error, RuntimeError):
    """The server answered one request with an HTTP error; it is still up."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


def http_json(url: str, body: dict[str, Any] | None = None, *, timeout: float) -> dict[str, Any]:
    """GET (body None) or POST JSON; the decoded JSON answer.

    ServerUnreachableError when nothing answers, RequestRejectedError on an HTTP error status.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RequestRejectedError(url, e.code, str(detail)[:2000]) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachableError(f"{url}: no answer ({reason})") from None
    return json.loads(raw) if raw else {}


def is_healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        return False


@dataclass(frozen=True)
class ServedModel:
    """What `/v1/models` says: the id to put in requests and the context length."""

    url: str
    model_id: str
    root: str
    max_model_len: int


def served_model(url: str) -> ServedModel:
    """The (single) model the server at `url` serves."""
    answer = http_json(f"{url}/v1/models", timeout=HEALTH_TIMEOUT_S)
    models = answer.get("data") or []
    if len(models) != 1:
        raise VllmServerError(f"the vLLM server at {url} serves {len(models)} models; expected exactly 1")
    m = models[0]
    return ServedModel(url, str(m["id"]), str(m.get("root") or m["id"]), int(m["max_model_len"]))


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (tests and benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
