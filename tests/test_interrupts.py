"""Stopping on SIGINT/SIGTERM (real signals sent to this process with ``os.kill``, caught
by the running event loop): the first asks the work to stop and gives it grace, a second
cancels it at once, and the handlers go when the block ends."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from fixtures.signals import deliver

from quanthunt.interrupts import StopSignals

HOUR = 3600.0
"""A grace no test waits for: the work is cut short only by a second signal."""


class Work:
    """Work that runs until asked to stop, then needs ``finish`` to end (its in-flight requests)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.stop_requested = asyncio.Event()
        self.finish = asyncio.Event()

    def stop(self, reason: str) -> None:
        self.asked.append(reason)
        self.stop_requested.set()

    async def run(self) -> str:
        await self.stop_requested.wait()
        await self.finish.wait()
        return "stopped cleanly"


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_the_first_signal_asks_the_work_to_stop_and_waits_for_it() -> None:
    async def scenario() -> None:
        work = Work()
        task = asyncio.ensure_future(work.run())
        with StopSignals(task, grace_s=HOUR, on_first=work.stop) as signals:
            await deliver(signal.SIGTERM, signals)
            assert work.asked == ["interrupted by SIGTERM"]
            await asyncio.sleep(0)
            assert not task.done()  # in-flight requests get their grace
            work.finish.set()
            assert await task == "stopped cleanly"
        assert signals.received == ["SIGTERM"] and signals.reason == "interrupted by SIGTERM"
        assert not signals.cut_short

    run(scenario)


def test_a_second_signal_cancels_at_once() -> None:
    async def scenario() -> None:
        work = Work()
        task = asyncio.ensure_future(work.run())
        with StopSignals(task, grace_s=HOUR, on_first=work.stop) as signals:
            await deliver(signal.SIGINT, signals)
            await deliver(signal.SIGTERM, signals)
            with pytest.raises(asyncio.CancelledError):
                await task
        assert task.cancelled() and signals.cut_short
        assert work.asked == ["interrupted by SIGINT"]  # asked once; the second signal does not ask again
        assert signals.received == ["SIGINT", "SIGTERM"] and signals.reason == "interrupted by SIGINT"

    run(scenario)


def test_the_work_is_cancelled_when_the_grace_runs_out() -> None:
    async def scenario() -> None:
        work = Work()  # never finishes on its own
        task = asyncio.ensure_future(work.run())
        with StopSignals(task, grace_s=0, on_first=work.stop) as signals:
            await deliver(signal.SIGINT, signals)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert task.cancelled() and signals.cut_short and signals.received == ["SIGINT"]

    run(scenario)


def test_work_that_ends_before_its_grace_is_not_cut_short_by_a_later_signal() -> None:
    async def scenario() -> None:
        task = asyncio.ensure_future(asyncio.sleep(0, result="done"))
        asked: list[str] = []
        with StopSignals(task, grace_s=HOUR, on_first=asked.append) as signals:
            assert await task == "done"
            await deliver(signal.SIGINT, signals)
            await deliver(signal.SIGINT, signals)
        assert not signals.cut_short and not task.cancelled() and asked == ["interrupted by SIGINT"]

    run(scenario)


def test_signals_are_caught_even_when_sigint_was_inherited_ignored() -> None:
    """A stage started in the background of a non-interactive shell inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        async def scenario() -> None:
            work = Work()
            task = asyncio.ensure_future(work.run())
            with StopSignals(task, grace_s=HOUR, on_first=work.stop) as signals:
                await deliver(signal.SIGINT, signals)
                work.finish.set()
                await task
            assert work.asked == ["interrupted by SIGINT"]

        run(scenario)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_handlers_from_before_the_block_are_put_back() -> None:
    """The CLI's own handlers (exit 130 on SIGINT or SIGTERM) must hold again after the
    graceful stop: asyncio alone would leave SIGTERM killing the process outright, its
    ledger, outputs and MLflow run unfinished (fixed here)."""

    def cli_handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, cli_handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        async def scenario() -> None:
            task = asyncio.ensure_future(asyncio.sleep(0))
            with StopSignals(task, grace_s=HOUR, on_first=lambda reason: None) as signals:
                assert signal.getsignal(signal.SIGTERM) is not cli_handler
                assert signals.reason == ""
            await task

        run(scenario)
        assert signal.getsignal(signal.SIGTERM) is cli_handler
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
