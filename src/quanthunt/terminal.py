"""Where stages print: stderr, through rich; 140 columns when it is not a terminal."""

from __future__ import annotations

import sys

from rich.console import Console


def stage_console() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else 140)
