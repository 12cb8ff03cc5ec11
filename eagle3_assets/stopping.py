"""The start command's stop: the first SIGINT or SIGTERM ends what runs, and nothing more is launched.

While a run executes in this process, Dagster owns both signals' handlers: it turns a signal into an
interrupt of the step in flight, which `defs/failures.py` turns into a refusal (Dagster would
otherwise retry the step under its `RetryPolicy`). Outside a run the handler here raises `Stopped`,
so whatever waits (a server starting, the rolling loop) unwinds through its `finally`s and stops
its children. Either way the signal also lands on a wakeup fd, below every Python handler, which
`StopSignals.received` reads: the command asks it after each run and launches nothing once it is set.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived. A KeyboardInterrupt, so no `except Exception` on the way out swallows it."""

    def __init__(self, sig: signal.Signals):
        super().__init__(sig.name)
        self.signal = sig

    @property
    def exit_status(self) -> int:
        return 128 + self.signal  # what a shell reports for a process a signal ended


class StopSignals:
    """The first stop signal this process received; nothing until `installed()` is entered."""

    def __init__(self) -> None:
        self._first: signal.Signals | None = None
        self._wakeup: socket.socket | None = None
        self._raised = False

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        previous = {s: signal.signal(s, self._raise_once) for s in STOP_SIGNALS}
        self._wakeup = reader
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            self._wakeup = None
            reader.close()
            writer.close()

    def received(self) -> signal.Signals | None:
        while self._first is None and self._wakeup is not None:
            try:
                data = self._wakeup.recv(64)
            except BlockingIOError:
                break
            self._first = next((signal.Signals(b) for b in data if b in STOP_SIGNALS), None)
        return self._first

    def check(self) -> None:
        """Raise `Stopped` once a stop signal has arrived."""
        if (sig := self.received()) is not None:
            self._raised = True
            raise Stopped(sig)

    def _raise_once(self, signum: int, _frame: FrameType | None) -> None:
        self._first = self.received() or signal.Signals(signum)
        if not self._raised:  # a second Ctrl-C while the first one's cleanup runs must not cut it short
            self.check()
