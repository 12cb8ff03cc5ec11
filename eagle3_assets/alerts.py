"""Stall and crash detection for running shard runs, and alerts sent to a webhook.

No Dagster here: the sensors in `defs/ops` gather what the instance knows about each
running shard (when it last reported progress, whether its process still exists) into
`RunProgress`, and this module decides what is wrong and sends it.

- stalled: no progress observation for `alerts.stall_after_s` (counting from the run's
  start before the first one). The process may still be alive (a hung collective, a
  model load slower than the threshold), so it is reported, never killed.
- process gone: the run's worker process no longer exists, so the run can never finish
  or release its `gpu` slot; reported at once, and the sensor marks the run failed.

The webhook URL is a secret (it embeds the token): it is read from the environment
variable named by `alerts.webhook_env` and never logged, returned or put in an error.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

from eagle3_assets.settings import AlertSettings

StallKind = Literal["stalled", "process_gone"]
WEBHOOK_TIMEOUT_S = 10.0
WEBHOOK_ATTEMPTS = 2
REDACTED = "<webhook URL>"


@dataclass(frozen=True)
class RunProgress:
    """What the instance knows about one running shard run."""

    run_id: str
    partition: str | None
    started_at: float  # epoch seconds
    last_progress_at: float | None  # epoch seconds of the latest progress observation; None before the first
    samples_done: int | None = None
    samples_total: int | None = None
    pid: int | None = None  # the run worker's pid, when recorded and on this machine
    process_alive: bool | None = None  # None: unknown (no pid, or the worker runs elsewhere)
    alerted_silent_since: float | None = None  # `silent_since` of the last stall already alerted for this run

    @property
    def silent_since(self) -> float:
        """When the run last showed progress (its start, before the first observation)."""
        if self.last_progress_at is None:
            return self.started_at
        return max(self.started_at, self.last_progress_at)


@dataclass(frozen=True)
class Stall:
    kind: StallKind
    run: RunProgress
    silent_for_s: float

    def message(self) -> str:
        r = self.run
        where = f"shard {r.partition}" if r.partition else "shard run"
        if r.last_progress_at is None:
            silent = f"no progress reported in the {_duration(self.silent_for_s)} since it started"
        else:
            done = "figures unknown"
            if r.samples_total is not None:
                done = f"{r.samples_done}/{r.samples_total} samples done"
            silent = f"no progress for {_duration(self.silent_for_s)} ({done})"
        if self.kind == "process_gone":
            return f"{where} (run {r.run_id}): its process (pid {r.pid}) is gone, {silent}; marking the run failed"
        return f"{where} (run {r.run_id}): stalled, {silent}"


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def find_stalls(runs: Iterable[RunProgress], now: float, stall_after_s: float) -> list[Stall]:
    """The runs to alert on now: every gone process, and every run silent for `stall_after_s` or longer.

    A stall already alerted for the same `silent_since` is not repeated; a run that
    reports progress again and then goes silent again is alerted again.
    """
    out: list[Stall] = []
    for run in runs:
        silent_for = now - run.silent_since
        if run.process_alive is False:
            out.append(Stall("process_gone", run, silent_for))
        elif silent_for >= stall_after_s and run.alerted_silent_since != run.silent_since:
            out.append(Stall("stalled", run, silent_for))
    return out


@dataclass(frozen=True)
class Alert:
    """One alert: `text` for people (chat webhooks show it), `fields` for machines."""

    kind: str  # "shard_stalled", "shard_process_gone", "run_failed"
    text: str
    fields: Mapping[str, str | int | float | None] = field(default_factory=dict)

    def payload(self) -> dict:
        # `text` is what Slack, Mattermost and Google Chat webhooks display.
        return {"text": f"[eagle3] {self.text}", "alert": {"kind": self.kind, **self.fields}}


def stall_alert(stall: Stall, ui_url: str | None = None) -> Alert:
    r = stall.run
    fields = {
        "run_id": r.run_id,
        "partition": r.partition,
        "silent_for_s": round(stall.silent_for_s, 1),
        "samples_done": r.samples_done,
        "samples_total": r.samples_total,
        "pid": r.pid,
    }
    return Alert(f"shard_{stall.kind}", stall.message() + _run_link(ui_url, r.run_id), fields)


def run_failure_alert(
    run_id: str, job: str, partition: str | None, error: str, ui_url: str | None = None, max_error_chars: int = 1500
) -> Alert:
    where = f"{job} [{partition}]" if partition else job
    error = error.strip() or "no error message"
    if len(error) > max_error_chars:
        error = error[:max_error_chars] + " …"
    return Alert(
        "run_failed",
        f"run {run_id} of {where} failed: {error}{_run_link(ui_url, run_id)}",
        {"run_id": run_id, "job": job, "partition": partition},
    )


def _run_link(ui_url: str | None, run_id: str) -> str:
    return f"\n{ui_url.rstrip('/')}/runs/{run_id}" if ui_url else ""


@dataclass(frozen=True)
class WebhookResult:
    sent: bool
    detail: str  # for the log; never holds the URL


def webhook_url(settings: AlertSettings, environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get(settings.webhook_env) or None


def post_alert(
    alert: Alert,
    settings: AlertSettings,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = WEBHOOK_TIMEOUT_S,
    attempts: int = WEBHOOK_ATTEMPTS,
) -> WebhookResult:
    """POST the alert as JSON to the URL in ${settings.webhook_env}; not set = nothing sent (not an error)."""
    url = webhook_url(settings, environ)
    if url is None:
        return WebhookResult(False, f"no webhook configured (${settings.webhook_env} is not set)")
    if urlsplit(url).scheme not in ("http", "https"):
        return WebhookResult(False, f"${settings.webhook_env} does not hold an http(s) URL; alert not sent")
    body = json.dumps(alert.payload()).encode()
    try:
        target, headers = _without_userinfo(url)
    except ValueError:  # e.g. a port that is not a number; the text would show the URL
        return WebhookResult(False, f"${settings.webhook_env} does not hold a valid URL; alert not sent")
    last = ""
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(
            target, data=body, method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "eagle3-alerts", **headers},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return WebhookResult(True, f"webhook ${settings.webhook_env} answered HTTP {resp.status}")
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                break  # the request itself is wrong: retrying will not help
        except (OSError, ValueError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        if attempt < attempts:
            time.sleep(1.0)
    return WebhookResult(False, f"webhook ${settings.webhook_env} failed: {redact(last, url)}")


def _without_userinfo(url: str) -> tuple[str, dict[str, str]]:
    """(URL, headers): `http://user:pass@host/…` becomes basic auth, which urllib does not read from a URL."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, {}
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    credentials = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
    return parts._replace(netloc=netloc).geturl(), {"Authorization": f"Basic {credentials}"}


def redact(text: str, url: str) -> str:
    """`text` with the URL and the places tokens live in it (user info, path, query) replaced."""
    parts = urlsplit(url)
    secrets = {url, url.rstrip("/"), parts.path, parts.query, parts.netloc.rpartition("@")[0]}
    secrets |= {parts.username or "", parts.password or ""}
    for secret in sorted(secrets, key=len, reverse=True):
        # Path and query are skipped when a bare "/": replacing every slash would only garble.
        if secret and secret != "/":
            text = text.replace(secret, REDACTED)
    return text
