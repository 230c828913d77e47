"""What a request whose reply was lost cost: the gateway's generation records (its
``/generation`` endpoint), looked up by the generation ids the ledger saved from the
response headers, settle the ledger's unknown-outcome attempts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from quanthunt.defaults import GATEWAY_LIMITS
from quanthunt.gateway import GatewayError
from quanthunt.ledger import Ledger
from quanthunt.replies import Generation

Lookup = Callable[[str], Awaitable[Generation]]
"""``Gateway.generation``: a generation record by id (waits out the lookup's lag)."""


async def look_up(generation_ids: Sequence[str], lookup: Lookup) -> list[Generation | None]:
    """Every generation record, None where the gateway has none. Asked concurrently (up to
    ``GATEWAY_LIMITS.max_connections`` at once): each may wait out ``/generation``'s lag."""
    gate = asyncio.Semaphore(GATEWAY_LIMITS.max_connections or 1)

    async def one(generation_id: str) -> Generation | None:
        async with gate:
            try:
                return await lookup(generation_id)
            except GatewayError:
                return None

    return list(await asyncio.gather(*(one(g) for g in generation_ids)))


async def reconcile_earlier(ledger: Ledger, dataset: str, lookup: Lookup) -> int:
    """Settle the unknown-outcome attempts earlier runs left with a generation id (best
    effort: the charge stays counted as possible where the gateway has no record)."""
    pending = ledger.unknown_with_generation_id(dataset)
    records = await look_up([generation_id for _, generation_id in pending], lookup)
    for (attempt_id, _), record in zip(pending, records, strict=True):
        if record is not None:
            ledger.reconcile(attempt_id, record.total_cost)
    return sum(record is not None for record in records)
