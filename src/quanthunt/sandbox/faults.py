"""Fault injection: which fault (if any) hits a request, and replies that misbehave
at the HTTP level (held, cut short, dropped) the way real gateways sometimes do."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping

from starlette.types import Receive, Scope, Send

from quanthunt.sandbox.roster import FAULT_KINDS, Faults

BEFORE_GENERATION = frozenset({"rate_limit", "rate_limit_no_retry_after", "server_error", "bad_gateway", "unavailable"})
"""Faults that stop an attempt before the provider generates anything (never billed)."""
CHAT_ONLY = frozenset({"finish_error", "error_200", "empty_answer"})
"""Faults of a chat completion's body, which the gateway's other routes do not have."""
ERROR_STATUS = {
    "rate_limit": 429,
    "rate_limit_no_retry_after": 429,
    "server_error": 500,
    "bad_gateway": 502,
    "unavailable": 503,
}
ERROR_MESSAGE = {
    429: "Rate limit exceeded",
    500: "Internal Server Error",
    502: "Provider returned error",
    503: "Service temporarily unavailable",
}


def draw(faults: Faults, rng: random.Random) -> str | None:
    """One draw per attempt: the fault kind, or None for a clean reply."""
    if faults.total() <= 0:
        return None
    u = rng.random()
    for kind in FAULT_KINDS:
        u -= getattr(faults, kind)
        if u < 0:
            return kind
    return None


class InjectedFault(Exception):
    """Raised inside the ASGI app to make the server drop the connection on purpose."""


class _QuietInjectedFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], InjectedFault))


def silence_injected_faults() -> None:
    """Keep deliberate connection drops out of uvicorn's error log."""
    logging.getLogger("uvicorn.error").addFilter(_QuietInjectedFaults())


class MisbehavingResponse:
    """An ASGI reply that sends its headers, then holds, truncates or drops the body.

    - ``hold``: wait ``hold_s`` before the body (a client read timeout fires first);
    - ``truncate``: send half the body under a Content-Length for all of it, then drop;
    - ``drop``: drop the connection right after the headers.
    """

    def __init__(self, body: bytes, *, how: str, headers: Mapping[str, str], hold_s: float = 0.0) -> None:
        self.body = body
        self.how = how
        self.headers = headers
        self.hold_s = hold_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        if self.how == "hold":
            await asyncio.sleep(self.hold_s)
            await send({"type": "http.response.body", "body": self.body})
            return
        if self.how == "truncate":
            await send({"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True})
        raise InjectedFault(self.how)
