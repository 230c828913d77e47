"""What ``quanthunt worker`` does: open the shared ledger, find an open job, work it
(``worker_run.work``), and say what this host did. Exit codes as the generate stage's:
0 the queue is empty, 75 stopped by a cap or the gateway's refusal for money, 2 bad
input, 130 stopped by a signal (the claims went back to the queue)."""

from __future__ import annotations

from rich.console import Console

from quanthunt.errors import EXIT_INTERRUPTED, EXIT_OUT_OF_BUDGET, ConfigError
from quanthunt.gateway import resolve_api_key
from quanthunt.generation import StopRun
from quanthunt.ledger import URL_VARIABLE
from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.shared import find_job
from quanthunt.urls import check_ledger_url
from quanthunt.worker_run import work


async def main(url: str, *, concurrency: int | None, dataset: str | None, console: Console) -> None:
    try:
        check_ledger_url(url)
    except ValueError as exc:
        raise ConfigError(f"--ledger / ${URL_VARIABLE}: {exc}") from None
    if not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"--ledger / ${URL_VARIABLE}: workers share a PostgreSQL ledger (postgresql://…), not SQLite")
    ledger = PostgresLedger(url, source=f"--ledger / ${URL_VARIABLE}")
    try:
        published = find_job(ledger, dataset)
        if published is None:
            which = f"for {dataset!r} " if dataset else ""
            console.print(f"no open job {which}with records left on {ledger.where}: nothing to do")
            return
        job = published.job
        console.print(f"working {job.dataset} (run {job.run_id}) from {ledger.where}")
        share = await work(ledger, published, api_key=resolve_api_key(published.api_url), concurrency=concurrency)
    finally:
        ledger.close()
    progress, worker = share.engine.progress, share.worker
    console.print(
        f"worker {worker.id}: {progress.records_done} records written, {worker.fenced} lost to a takeover, "
        f"{progress.records_failed} failed, ${share.engine.budget.settled_usd:.4f} spent of ${worker.leased_usd:.4f} leased"
    )
    if share.signals.received:
        raise StopRun(f"{share.signals.reason}: this worker's unfinished records went back to the queue", EXIT_INTERRUPTED)
    if share.engine.fatal is not None:
        raise share.engine.fatal
    if progress.stop_reason and "cap" in progress.stop_reason:
        raise StopRun(f"stopped: {progress.stop_reason}", EXIT_OUT_OF_BUDGET)
