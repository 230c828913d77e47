"""``quanthunt sandbox``: the local OpenRouter-compatible gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quanthunt.defaults import SANDBOX_HOST, SANDBOX_PORT

app = typer.Typer(help="The built-in sandbox gateway: a real model at real precisions.", no_args_is_help=True)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on (loopback unless --allow-remote).")] = SANDBOX_HOST,
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one.", min=0, max=65535)] = SANDBOX_PORT,
    roster: Annotated[Path | None, typer.Option(help="Roster YAML (default: the one shipped with quanthunt).")] = None,
    mode: Annotated[str, typer.Option(help="model: the real model; latency: canned replies for load tests.")] = "model",
    allow_remote: Annotated[bool, typer.Option(help="Allow a non-loopback --host.")] = False,
) -> None:
    """Serve the sandbox in the foreground until interrupted; prints its base URL."""
    from quanthunt.sandbox.server import serve as run

    run(host=host, port=port, roster_path=roster, mode=mode, allow_remote=allow_remote)
