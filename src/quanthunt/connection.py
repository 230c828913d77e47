"""Where a stage sends its requests: the configured gateway and reference deployment,
or, when either is ``sandbox``, a sandbox started for the stage's duration."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from quanthunt.params import SANDBOX, Params
from quanthunt.sandbox.roster import default_roster_path
from quanthunt.sandbox.server import SandboxProcess


@dataclass(frozen=True)
class Targets:
    """Base URLs of the OpenRouter-compatible API and of the reference deployment."""

    api_url: str
    reference_url: str
    sandbox: SandboxProcess | None = None
    roster: Path | None = None
    """The roster file the sandbox serves (its built-in one unless ``sandbox.roster``)."""


@contextlib.contextmanager
def open_targets(params: Params, *, root: Path, stage: str, needs_model: bool) -> Iterator[Targets]:
    """Yield the stage's targets, starting (and afterwards stopping) a sandbox on a free
    loopback port when ``api.base_url`` or ``reference.base_url`` is ``sandbox``.

    ``needs_model=False`` starts it in latency mode (no model load), enough for stages that
    only read the endpoint list.
    """
    if not params.uses_sandbox:
        yield Targets(params.api.base_url, params.reference.base_url)
        return
    roster = root / params.sandbox.roster if params.sandbox.roster else None
    sandbox = SandboxProcess(
        mode="model" if needs_model else "latency",
        roster=roster,
        log_path=root / params.paths.logs / f"sandbox-{stage}.log",
    )
    with sandbox:
        yield Targets(
            api_url=sandbox.api_url if params.api.base_url == SANDBOX else params.api.base_url,
            reference_url=sandbox.reference_url if params.reference.base_url == SANDBOX else params.reference.base_url,
            sandbox=sandbox,
            roster=roster or default_roster_path(),
        )
