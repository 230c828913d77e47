"""``quanthunt``: the command line. Each group lives in its own module and owns a Typer
app; this module joins them. Commands parse options and call the library."""

from __future__ import annotations

import sys

import typer

from quanthunt.cli import compare, reference, sandbox, stages
from quanthunt.errors import QuanthuntError
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


def main() -> None:
    """Entry point: user-facing errors become one line on stderr and an exit code."""
    try:
        app()
    except QuanthuntError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
