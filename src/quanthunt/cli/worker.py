"""``quanthunt worker``: work a job another host published on a shared ledger. A worker
host needs the ledger's URL, the API key and quanthunt: no params file, DVC or git."""

from __future__ import annotations

from typing import Annotated

import typer

from quanthunt.ledger import URL_VARIABLE


def worker(
    ledger: Annotated[
        str,
        typer.Option("--ledger", envvar=URL_VARIABLE, show_envvar=True, show_default=False,
                     help="The shared ledger, postgresql://user@host:port/db (a password: PGPASSWORD or the variable)."),
    ],
    concurrency: Annotated[int | None, typer.Option(min=1, help="Requests in flight on this host (default: the job's).")] = None,
    dataset: Annotated[str | None, typer.Option(help="Work only this dataset's job (default: the oldest open job).")] = None,
) -> None:  # fmt: skip
    """Join an open generate job on a shared ledger and work its queue until it is empty."""
    import asyncio

    from rich.console import Console

    from quanthunt.worker_main import main

    asyncio.run(main(ledger, concurrency=concurrency, dataset=dataset, console=Console(stderr=True)))
