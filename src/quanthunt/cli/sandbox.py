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


@app.command()
def share(
    command: Annotated[list[str], typer.Argument(help="The command to run, after --: e.g. -- dvc repro")],
    params: Annotated[Path, typer.Option("--params", help="The params file whose sandbox to serve.")] = Path("params.yaml"),
) -> None:
    """Run a command (`dvc repro`) with one model sandbox serving all its stages."""
    from quanthunt.connection import run_with_shared_sandbox
    from quanthunt.params import load_params

    code = run_with_shared_sandbox(load_params(params), root=params.resolve().parent, command=command)
    raise typer.Exit(code)
