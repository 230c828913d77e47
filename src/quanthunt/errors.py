"""Errors users see, each with the exit code the CLI returns for it."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""Bad params, files or replies: one clear line naming the problem (like argparse)."""
EXIT_OUT_OF_BUDGET = 75
"""EX_TEMPFAIL: the money ran out; top up and rerun to resume."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report a Ctrl-C; a SIGTERM stop ends the same way (the CLI
turns both into a stop): rerun to resume."""


class QuanthuntError(Exception):
    """An error with a one-line message for the user and an exit code."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(QuanthuntError):
    """A params, roster or prompt file is invalid; the message names file and field."""


class SandboxError(QuanthuntError):
    """The sandbox cannot start or serve (missing model, bad roster, port in use)."""
