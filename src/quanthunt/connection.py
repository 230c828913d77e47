"""Where a stage sends its requests: the configured gateway and reference deployment,
or, when either is ``sandbox``, a sandbox started for the stage's duration."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from quanthunt.params import SANDBOX, Params
from quanthunt.sandbox.roster import default_roster_path, load_roster
from quanthunt.sandbox.server import SandboxProcess


@dataclass(frozen=True)
class Targets:
    """Base URLs of the OpenRouter-compatible API and of the reference deployment."""

    api_url: str
    reference_url: str
    sandbox: SandboxProcess | None = None
    roster: Path | None = None
    """The roster file the sandbox serves (its built-in one unless ``sandbox.roster``)."""
    gateway: str = ""
    """What the gateway is, the same from one run to the next (what paid probe replies are
    keyed by, ``quanthunt.paid_replies``): the configured API URL, or for the sandbox's
    gateway what its roster has it serve (its port changes every run; another roster is
    other providers, while the roster's reference settings are not the gateway's)."""


@contextlib.contextmanager
def open_targets(params: Params, *, root: Path, stage: str, needs_model: bool) -> Iterator[Targets]:
    """Yield the stage's targets, starting (and afterwards stopping) a sandbox on a free
    loopback port when ``api.base_url`` or ``reference.base_url`` is ``sandbox``.

    ``needs_model=False`` starts it in latency mode (no model load), enough for stages that
    only read the endpoint list.
    """
    if not params.uses_sandbox:
        yield Targets(params.api.base_url, params.reference.base_url, gateway=params.api.base_url)
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
            gateway=sandbox_gateway(roster) if params.api.base_url == SANDBOX else params.api.base_url,
        )


def sandbox_gateway(roster: Path | None) -> str:
    """The sandbox gateway's identity: a digest of what its roster has it serve."""
    served = load_roster(roster).model_dump(mode="json", exclude={"reference_flavour", "reference_outage"})
    return f"{SANDBOX}:{hashlib.sha256(json.dumps(served, sort_keys=True).encode()).hexdigest()}"
