"""``quanthunt``: the command line. Each group lives in its own module and owns a Typer
app; this module joins them. Commands parse options and call the library."""

from __future__ import annotations

import signal
import sys

import typer

from quanthunt import interrupts
from quanthunt.cli import compare, reference, sandbox, stages, worker
from quanthunt.errors import EXIT_INTERRUPTED, QuanthuntError
from quanthunt.redaction import redact

app = typer.Typer(
    name="quanthunt",
    help="Audited training data from LLM API providers: survey, verify, generate, validate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(reference.app, name="reference")
stages.register(app)
app.command(rich_help_panel="Provenance")(compare.compare)
app.command(rich_help_panel="Scale-out")(worker.worker)


def main() -> None:
    """Entry point: user-facing errors become one line on stderr and an exit code.

    SIGINT and SIGTERM interrupt whatever runs (exit 130), even when SIGINT was inherited
    ignored (a stage started in the background of a script); the generate stage replaces
    both with its own graceful stop while it sends requests (``quanthunt.interrupts``).
    Python drops an exception raised while it forks (``Exception ignored in
    _releaseLock``): a signal that lands then still ends the command with 130."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupts.interrupt)
    try:
        app()
    except QuanthuntError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as exc:
        if not interrupts.received() or exc.code not in (0, None):
            raise
    if signals := interrupts.received():
        print(f"error: interrupted by {signals[0]}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
