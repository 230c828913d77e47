"""``quanthunt reference``: a real engine as the team's local reference deployment."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from quanthunt.defaults import VLLM_PORT

app = typer.Typer(help="A real reference deployment on the sandbox's weights.", no_args_is_help=True)


@app.command()
def vllm(
    python: Annotated[Path, typer.Option(help="The interpreter of vLLM's environment.")] = Path(".venv-vllm/bin/python"),
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1.", min=1, max=65535)] = VLLM_PORT,
    log: Annotated[Path, typer.Option(help="Where vLLM's own output goes.")] = Path("logs/vllm-reference.log"),
) -> None:
    """Serve the sandbox model's fp32 weights with vLLM until interrupted; prints the base
    URL to set as ``reference.base_url``."""
    from quanthunt.engines import VllmServer

    with VllmServer(python=python, port=port, log_path=log) as server:
        print(f"vLLM reference serving {server.base_url} (model {server.model_id}); Ctrl-C stops it", flush=True)
        stops = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        signal.sigwait(stops)
