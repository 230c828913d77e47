"""Where a stage sends its requests: the configured gateway and reference deployment,
or, when either is ``sandbox``, a sandbox: a gateway of the stage's roster opened on the
run's shared sandbox (``quanthunt sandbox share``, as ``make run`` runs ``dvc repro``),
else one started for the stage's duration."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from quanthunt.errors import ConfigError
from quanthunt.params import SANDBOX, Params
from quanthunt.sandbox.roster import default_roster_path, load_roster
from quanthunt.sandbox.server import API_PATH, GATEWAYS_PATH, REFERENCE_PATH, SandboxProcess

SHARED_SANDBOX_ENV = "QUANTHUNT_SANDBOX_URL"
"""The base URL of a model sandbox whose model serves every stage of one run, each stage
through a gateway of its own. Starting one takes a stage ~4 s (the model's weights and
tokenizer) and stopping it ~1 s, and each precision is built again on first use (1-4 s):
``make run`` has 14 stages that start one (2026-12-07, EPYC: 5.4 s a start and stop
measured alone)."""


@dataclass(frozen=True)
class Targets:
    """Base URLs of the OpenRouter-compatible API and of the reference deployment."""

    api_url: str
    reference_url: str
    sandbox_url: str | None = None
    """The base URL of the sandbox serving the stage (its own or the run's shared one)."""
    roster: Path | None = None
    """The roster file the sandbox serves (its built-in one unless ``sandbox.roster``)."""
    gateway: str = ""
    """What the gateway is, the same from one run to the next (what paid probe replies are
    keyed by, ``quanthunt.paid_replies``): the configured API URL, or for the sandbox's
    gateway what its roster has it serve (its port changes every run; another roster is
    other providers, while the roster's reference settings are not the gateway's)."""


def roster_path(params: Params, root: Path) -> Path | None:
    """The roster file ``params`` names for the sandbox (None: the one shipped with quanthunt)."""
    return root / params.sandbox.roster if params.sandbox.roster else None


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
    roster = roster_path(params, root)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(shared_gateway(roster, needs_model=needs_model))
        if url is None:
            mode = "model" if needs_model else "latency"
            log = root / params.paths.logs / f"sandbox-{stage}.log"
            url = stack.enter_context(SandboxProcess(mode=mode, roster=roster, log_path=log)).url
        yield Targets(
            api_url=url + API_PATH if params.api.base_url == SANDBOX else params.api.base_url,
            reference_url=url + REFERENCE_PATH if params.reference.base_url == SANDBOX else params.reference.base_url,
            sandbox_url=url,
            roster=roster or default_roster_path(),
            gateway=sandbox_gateway(roster) if params.api.base_url == SANDBOX else params.api.base_url,
        )


@contextlib.contextmanager
def shared_gateway(roster: Path | None, *, needs_model: bool) -> Iterator[str | None]:
    """A gateway of ``roster`` opened on the run's shared sandbox (``$QUANTHUNT_SANDBOX_URL``)
    for the stage, and closed after it: its base URL, or None when no sandbox is shared or it
    serves no model where the stage needs one (the stage then starts its own; a shared one
    that does not answer is named on stderr). The gateway starts as a new sandbox would
    (accounts, fault draws, drift clock, generations); only the model is the run's."""
    url = os.environ.get(SHARED_SANDBOX_ENV, "").strip().rstrip("/")
    if not url:
        yield None
        return
    served = load_roster(roster).model_dump(mode="json")
    try:
        opened = httpx.post(url + GATEWAYS_PATH, json={"roster": served}, timeout=10.0)
        opened.raise_for_status()
        answer = opened.json()
        base = url + answer["path"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        print(f"note: the shared sandbox at {url} ({SHARED_SANDBOX_ENV}) opened no gateway ({type(exc).__name__});"
              " this stage starts its own", file=sys.stderr)  # fmt: skip
        yield None
        return
    try:
        yield base if answer.get("mode") == "model" or not needs_model else None
    finally:
        with contextlib.suppress(httpx.HTTPError):
            httpx.delete(base, timeout=10.0)


def run_with_shared_sandbox(params: Params, *, root: Path, command: Sequence[str]) -> int:
    """Run ``command`` (``dvc repro``) with one model sandbox serving all its stages, and
    return its exit code (each stage opens a gateway of its own roster on it). Without a
    sandbox in ``params`` the command runs alone.

    A Ctrl-C at the terminal reaches the command, whose stages stop sending and wait for
    their requests: the sandbox (in a session of its own) serves them until the command
    has ended. A SIGTERM sent to this process is passed on to the command."""
    roster = roster_path(params, root)
    if not params.uses_sandbox:
        return _started(command, dict(os.environ)).wait()
    log = root / params.paths.logs / "sandbox-shared.log"
    with SandboxProcess(mode="model", roster=roster, log_path=log) as sandbox:
        child = _started(command, {**os.environ, SHARED_SANDBOX_ENV: sandbox.url})
        previous = {
            signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
            signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM)),
        }
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _started(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(list(command), env=env)  # noqa: S603 - the user's own command
    except OSError as exc:
        raise ConfigError(f"cannot run {command[0]!r}: {exc.strerror}") from None


def sandbox_gateway(roster: Path | None) -> str:
    """The sandbox gateway's identity: a digest of what its roster has it serve."""
    served = load_roster(roster).model_dump(mode="json", exclude={"reference_flavour", "reference_outage"})
    return f"{SANDBOX}:{hashlib.sha256(json.dumps(served, sort_keys=True).encode()).hexdigest()}"
