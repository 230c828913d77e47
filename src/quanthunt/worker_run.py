"""One host's share of a job on a shared ledger (``quanthunt.shared``): ``quanthunt
worker`` on any host, and the coordinator's own share inside its generate stage.

The engine is the one-host engine; what differs is around it: records come from the
queue's claims (with what earlier owners finished), lines go to the ledger under the
claim, money comes from budget leases, and a heartbeat task keeps this worker alive and
reaps the dead. However the run ends, the worker retires: unfinished claims go back to
the queue and its lease is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from quanthunt.aiohttp_chat import AiohttpChat
from quanthunt.gateway import ApiKey, Gateway
from quanthunt.generation import Engine
from quanthunt.interrupts import StopSignals
from quanthunt.ledger import LedgerWriter
from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.monitoring import Monitoring
from quanthunt.prompts import PromptRecord
from quanthunt.shared import ClaimSink, Published, Worker


@dataclass
class Share:
    """What one worker did."""

    worker: Worker
    engine: Engine
    signals: StopSignals


async def claimed(worker: Worker, engine: Engine) -> AsyncIterator[PromptRecord]:
    """The queue's records for ``engine``, each batch with what earlier owners left."""
    while worker.alive:
        batch = await worker.claim()
        if not batch:
            return
        engine.resume(await asyncio.to_thread(worker.resume, batch))
        for record in batch:
            yield record


async def work(
    ledger: PostgresLedger, published: Published, *, api_key: ApiKey, concurrency: int | None = None,
    monitoring: Callable[[LedgerWriter], Monitoring | None] = lambda _: None,
) -> Share:  # fmt: skip
    """Work ``published`` until its queue is empty, this worker is stopped (a signal, a
    cap, presumed dead), or the run must stop; then retire."""
    job = published.job if concurrency is None else dataclasses.replace(published.job, concurrency=concurrency)
    worker = Worker.register(ledger, published)
    writer = LedgerWriter(ledger)
    writer.start()
    sink = ClaimSink(worker, writer)
    why = "finished"
    try:
        async with (
            AiohttpChat(published.api_url, api_key=api_key, timeout_s=published.request_timeout_s) as chat,
            Gateway(published.api_url, api_key=api_key) as gateway,
        ):
            engine = Engine(job, chat, ledger, writer, sink, done_turns={}, lease=worker.lease,
                            monitoring=monitoring(writer))  # fmt: skip
            beat = asyncio.ensure_future(worker.keep_alive(on_dead=engine.stop))
            run = asyncio.ensure_future(engine.run(claimed(worker, engine)))
            try:
                with (
                    StopSignals(run, grace_s=published.stop_grace_s, on_first=engine.stop) as signals,
                    contextlib.suppress(asyncio.CancelledError),
                ):
                    await run
                if engine.monitoring is not None and not signals.cut_short:
                    await engine.monitoring.close()
            finally:
                beat.cancel()
            if not signals.cut_short:
                await engine.reconcile(gateway.generation)
            why = engine.progress.stop_reason or why
    finally:
        await sink.close()
        await writer.close()
        await worker.retire(why)
    return Share(worker, engine, signals)
