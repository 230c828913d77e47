"""The generate stage on a shared ledger (``quanthunt.shared``): this host is the
coordinator. It publishes the job (the queue seeded idempotently, so a rerun resumes),
works its own share like any worker, waits while other hosts finish theirs (reaping the
dead, working again when their claims come back), reconciles what was possibly billed,
and exports the written records to the dataset's working file, which the stage publishes
as the DVC output as on one host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console

from quanthunt.connection import Targets
from quanthunt.gateway import Gateway, resolve_api_key
from quanthunt.generation import Engine
from quanthunt.interrupts import StopSignals
from quanthunt.jobs import Job
from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.outputs import write_atomic
from quanthunt.params import Params
from quanthunt.prompts import PromptRecord
from quanthunt.reconciliation import reconcile_earlier
from quanthunt.shared import Published, close_job, export, publish, reap, work_left, worker_figures
from quanthunt.worker_run import work


async def coordinate(
    params: Params, root: Path, job: Job, records: Iterable[PromptRecord], *, targets: Targets, console: Console,
    ledger: PostgresLedger, total: int,
) -> tuple[Job, Engine, StopSignals, dict[str, int]]:  # fmt: skip
    """Run ``job`` across every host that joins; returns like ``generate_run.run``."""
    g = params.generate
    published = Published(job, targets.api_url, params.ledger.coordination,
                          request_timeout_s=g.request_timeout_s, stop_grace_s=g.stop_grace_s)  # fmt: skip
    left = await asyncio.to_thread(publish, ledger, published, records, team=params.ledger.team,
                                   team_cap_usd=params.survey.budget.usd)  # fmt: skip
    console.print(f"{job.dataset}: {left} records to do, shared through {ledger.where} (team {params.ledger.team!r}); "
                  f"other hosts join with `quanthunt worker`")  # fmt: skip
    if g.monitor.share > 0:
        console.print("[yellow]monitor: not run on a shared ledger yet; verify's verdicts alone vouch for the providers[/]")
    api_key = resolve_api_key(targets.api_url)
    while True:
        share = await work(ledger, published, api_key=api_key)
        stopped = bool(share.signals.received) or share.engine.fatal is not None
        if not share.worker.alive and not stopped:
            console.print("[yellow]this host was presumed dead (its claims were taken over); joining again[/]")
            continue
        if stopped or share.engine.progress.stop_reason is not None:
            break  # a signal, a cap, the run must stop: not waiting for the others
        queue = await asyncio.to_thread(work_left, ledger, job.dataset, job.params_hash)
        if queue.get("todo"):
            continue  # a dead worker's claims came back
        if not queue.get("claimed"):
            break
        await asyncio.sleep(params.ledger.coordination.heartbeat_s)
        await asyncio.to_thread(reap, ledger, job.dataset, job.params_hash, params.ledger.coordination)
    async with Gateway(targets.api_url, api_key=api_key) as gateway:
        await reconcile_earlier(ledger, job.dataset, gateway.generation)
    queue = await asyncio.to_thread(work_left, ledger, job.dataset, job.params_hash)
    lines = await asyncio.to_thread(export, ledger, job.dataset, job.params_hash)
    write_atomic(params.paths.of(root, job.dataset).working(job.params_hash), "".join(f"{line}\n" for line in lines).encode())
    if not queue.get("todo") and not queue.get("claimed"):
        await asyncio.to_thread(close_job, ledger, job.dataset, job.params_hash)
    progress = share.engine.progress
    progress.workers = await asyncio.to_thread(worker_figures, ledger, published.budget)
    progress.records_total = total
    progress.records_done_before = queue.get("done", 0) - progress.records_done
    progress.records_failed = queue.get("failed", 0)
    return job, share.engine, share.signals, ledger.state_counts(job.dataset)
