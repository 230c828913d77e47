"""The probe replies verify paid for, kept in the ledger so that no rerun buys them twice.

A reply is keyed by the sha256 of the gateway it came from and the exact request body that
bought it (model, messages, seed, sampling settings, the pin on one endpoint, reasoning):
a rerun on the same probes at the same settings (after a changed margin or alpha, a
stopped reference, a failed stage under ``dvc repro``, one more dataset) asks the ledger
first and pays only for what it has not bought yet. A reply is used again only while it
is younger than ``verify.reuse_paid_replies_h``: a provider may change what it serves, and
a rerun a week later should measure it again (``0`` buys every reply anew).

Only replies that arrived are kept (a timed-out request may have been billed, but nothing
came back to keep). What was used again is counted per provider (``Audit.reused``) and
shown beside what was bought.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import TypeAdapter

from quanthunt.ledger import Ledger, LedgerWriter, SaveProbeReply
from quanthunt.replies import ChatReply

_REPLY = TypeAdapter(ChatReply)


def request_sha256(gateway: str, body: Mapping[str, Any]) -> str:
    """The key of a request: its gateway's identity and its body (keys sorted)."""
    return hashlib.sha256(gateway.encode() + b"\n" + orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


class PaidReplies:
    """The ledger's paid probe replies younger than ``max_age_s`` (read once, when opened),
    and a writer that keeps each new one the moment it arrives: a verify run that stops
    halfway (a reference outage, Ctrl-C, kill -9) loses none of what it bought.

    ``gateway`` identifies where replies come from (the configured API URL; for the sandbox,
    its roster's contents), so a reply is never used for another gateway's request."""

    def __init__(self, ledger: Ledger, *, gateway: str, run_id: str, max_age_s: float) -> None:
        self.gateway = gateway
        self.run_id = run_id
        self._writer = LedgerWriter(ledger)
        self._earlier: dict[str, tuple[ChatReply, float]] = {}
        if max_age_s > 0:
            rows = ledger.paid_probe_replies(since=time.time() - max_age_s)
            self._earlier = {key: (_REPLY.validate_json(reply), cost) for key, (reply, cost, _run, _at) in rows.items()}

    async def __aenter__(self) -> PaidReplies:
        self._writer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._writer.close()

    def earlier(self, body: Mapping[str, Any]) -> tuple[ChatReply, float] | None:
        """The reply an earlier run bought with exactly this request, if young enough, and its cost."""
        return self._earlier.get(request_sha256(self.gateway, body))

    async def keep(self, body: Mapping[str, Any], *, tag: str, probe_id: str, reply: ChatReply) -> None:
        """Store a reply just bought (returns once committed)."""
        cost = (reply.usage.cost or 0.0) if reply.usage is not None else 0.0
        await self._writer.write(
            SaveProbeReply(request_sha256(self.gateway, body), tag, probe_id, _REPLY.dump_json(reply).decode(), cost, self.run_id)
        )
