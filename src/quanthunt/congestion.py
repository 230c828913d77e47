"""An adaptive limit on requests in flight: a slow gateway slows the audit down.

A gateway under load queues what it cannot serve, and a non-streamed reply's clock (httpx's
read timeout: from the request's last byte to the reply's first) runs while it waits in
that queue. Sending more than the gateway serves only lengthens the queue until everything
times out, and each timed-out request is still generated (and possibly billed) behind the
retries. So the limit backs off as TCP's congestion window does (AIMD, RFC 5681):

- a timeout cuts the limit to half the requests then in flight, at most once per window
  (requests sent before the last cut do not cut it again: they saw the old limit);
- each success grows it by ``1 / limit`` (about one more per round trip), up to ``ceiling``.

The auditor keeps one limit per endpoint (``verification.Auditor.limit``): on OpenRouter
each provider is its own backend with its own queue, so one provider's timeouts say
nothing about another's.

Usage::

    limit = AdaptiveLimit(256)
    async with limit.slot() as ticket:
        reply = await send()
        ticket.succeeded()   # or: retry_lower = limit.timed_out(ticket)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass
class Ticket:
    """One admitted request: the limit and window it was sent under."""

    limit: float
    window: int
    done: bool = False


class AdaptiveLimit:
    """At most ``limit`` requests in flight, ``1 ≤ limit ≤ ceiling``; starts at ``ceiling``.

    ``on_cut(before, after)`` hears of every cut (for the console)."""

    def __init__(self, ceiling: int, *, on_cut: Callable[[int, int], None] = lambda *_: None) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be at least 1, got {ceiling}")
        self.ceiling = ceiling
        self.limit = float(ceiling)
        self.in_flight = 0
        self.window = 0
        """How many cuts so far: a ticket from an earlier window cannot cut again."""
        self.cuts = 0
        self.on_cut = on_cut
        self._room = asyncio.Condition()

    @property
    def allowed(self) -> int:
        return max(1, math.floor(self.limit))

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[Ticket]:
        """Wait for room under the limit, hold it while the request runs."""
        async with self._room:
            await self._room.wait_for(lambda: self.in_flight < self.allowed)
            self.in_flight += 1
        ticket = Ticket(self.limit, self.window)
        try:
            yield ticket
        finally:
            async with self._room:
                self.in_flight -= 1
                self._room.notify_all()

    def succeeded(self, ticket: Ticket) -> None:
        """Additive increase: about one more request per round trip."""
        if not ticket.done:
            ticket.done = True
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)

    def timed_out(self, ticket: Ticket) -> bool:
        """Multiplicative decrease (once per window). True when a retry now runs under a
        lower limit than the request was sent under: the gateway gets less to do."""
        if not ticket.done:
            ticket.done = True
            if ticket.window == self.window and self.limit > 1.0:
                before = self.allowed
                self.limit = max(1.0, min(self.limit, float(self.in_flight)) / 2)
                self.window += 1
                self.cuts += 1
                self.on_cut(before, self.allowed)
        return self.limit < ticket.limit
