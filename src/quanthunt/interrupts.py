"""Stopping a running stage from the keyboard or a supervisor without losing money.

The first SIGINT (Ctrl-C) or SIGTERM asks the work to stop: nothing new is sent, the
requests in flight get ``grace_s`` to come back (their replies are paid for either way,
so they are kept), then the work is cancelled. A second signal cancels it at once; the
ledger's "in flight before it is sent" rule keeps that crash-safe (the cut-off requests
count as possibly billed at the next start).

Usage::

    task = asyncio.ensure_future(engine.run(records))
    with StopSignals(task, grace_s=30, on_first=engine.stop) as signals:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if signals.received: ...
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from types import TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[str] = []


def interrupt(signum: int, frame: object) -> None:
    """The process-wide handler of SIGINT and SIGTERM (the CLI installs it): records the
    signal, then raises ``KeyboardInterrupt`` to unwind whatever runs."""
    _received.append(signal.Signals(signum).name)
    raise KeyboardInterrupt


def received() -> tuple[str, ...]:
    """Stop signals ``interrupt`` has handled in this process, in order.

    The record outlives the exception: Python drops one raised while it finalises an object
    (a signal landing in ``BaseEventLoop.__del__``, or while it forks), and the work then
    goes on to a normal end. Whoever reports how the process ended reads this, not only the
    exception (the CLI's exit code, an MLflow run's end status)."""
    return tuple(_received)


class StopSignals:
    """SIGINT and SIGTERM handlers for the running event loop, while in the ``with`` block.

    Installed whatever the inherited disposition: a stage started in the background of a
    non-interactive shell inherits SIGINT ignored, and must still stop when sent one. The
    handlers there before (the CLI's, which end the command with exit 130) are put back when
    the block ends."""

    def __init__(self, task: asyncio.Future[Any], *, grace_s: float, on_first: Callable[[str], None]) -> None:
        self.task, self.grace_s, self.on_first = task, grace_s, on_first
        self.received: list[str] = []
        """Names of the signals received, in order."""
        self.cut_short = False
        """Whether the work was cancelled (a second signal, or the grace ran out)."""
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            self._loop.add_signal_handler(sig, self._signalled, sig)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        for sig in SIGNALS:
            self._loop.remove_signal_handler(sig)  # leaves SIGINT raising KeyboardInterrupt, SIGTERM killing
            if self._previous.get(sig) is not None:  # None: a handler installed outside Python
                signal.signal(sig, self._previous[sig])

    @property
    def reason(self) -> str:
        return f"interrupted by {self.received[0]}" if self.received else ""

    def _signalled(self, sig: signal.Signals) -> None:
        assert self._loop is not None
        self.received.append(sig.name)
        if len(self.received) == 1:
            self.on_first(self.reason)
            self._timer = self._loop.call_later(self.grace_s, self._cancel)
        else:
            self._cancel()

    def _cancel(self) -> None:
        if not self.task.done():
            self.cut_short = True
            self.task.cancel()
