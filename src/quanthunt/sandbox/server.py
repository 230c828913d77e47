"""Serving the sandbox: in the foreground (``quanthunt sandbox serve``) or as a child
process that a stage or a test starts on a free loopback port and stops afterwards."""

from __future__ import annotations

import abc
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from quanthunt.defaults import SANDBOX_HOST, SANDBOX_STARTUP_TIMEOUT_S
from quanthunt.errors import SandboxError
from quanthunt.urls import is_loopback

READY_PREFIX = "quanthunt sandbox serving "
API_PATH = "/api/v1"
"""Where below its base URL the sandbox serves the OpenRouter API."""
REFERENCE_PATH = "/reference/v1"
"""... and its reference deployment (an OpenAI-compatible server, as vLLM's)."""
GATEWAYS_PATH = "/gateways"
"""Where clients open gateways of their own rosters (``app.SandboxServer``)."""


def deployment_url(base_url: str, name: str) -> str:
    """The API of the roster's deployment ``name`` (served as the reference is) on the
    sandbox at ``base_url``."""
    return f"{base_url}/deployments/{name}/v1"


MODES = ("model", "latency")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one); clear error if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SandboxError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(8192)
    return sock


class ChildServer(abc.ABC):
    """A server run in a child process, with its log: ``stop`` (or leaving ``with``) sends
    SIGTERM (to its whole process group with ``group``), SIGKILL after ``grace_s``, reaps
    it and closes the log. Subclasses set ``_proc``, ``_log`` and ``url`` in ``start``."""

    grace_s = 10.0
    group = False
    url = ""
    """Where it serves, ``http://host:port`` (its routes are below it); empty until started."""
    _proc: subprocess.Popen[Any] | None = None
    _log: IO[Any] | None = None

    @abc.abstractmethod
    def start(self) -> Self:
        """Start the child and return once it serves."""

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:

            def send(sig: int) -> None:
                with contextlib.suppress(ProcessLookupError):
                    if self.group:
                        os.killpg(proc.pid, sig)
                    else:
                        proc.send_signal(sig)

            send(signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                send(signal.SIGKILL)
                proc.wait()
        if proc is not None and proc.stdout:
            proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def serve(*, host: str, port: int, roster_path: Path | None, mode: str, allow_remote: bool = False) -> None:
    """Load the roster and engine, bind, print the base URL, serve until interrupted."""
    import uvicorn

    from quanthunt.sandbox.app import SandboxServer
    from quanthunt.sandbox.engine import CompletionEngine, LatencyEngine
    from quanthunt.sandbox.faults import silence_injected_faults
    from quanthunt.sandbox.roster import load_roster

    if mode not in MODES:
        raise SandboxError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not is_loopback(host) and not allow_remote:
        raise SandboxError(f"refusing to listen on non-loopback host {host}: pass --allow-remote to expose the sandbox")
    if not is_loopback(host):
        print(f"warning: the sandbox listens on {host}, reachable from other machines", file=sys.stderr)
    roster = load_roster(roster_path)
    _raise_fd_limit()
    engine: CompletionEngine
    if mode == "model":
        from quanthunt.sandbox.model_engine import ModelEngine

        engine = ModelEngine.load()  # other precisions are built on first use (1-4 s each)
    else:
        engine = LatencyEngine()
    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"{READY_PREFIX}http://{shown}:{bound_port} (mode {mode}; OpenRouter API at /api/v1, reference at /reference/v1)",
        flush=True,
    )
    silence_injected_faults()
    config = uvicorn.Config(
        SandboxServer(roster, engine),
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=8192,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=2,
    )
    uvicorn.Server(config).run(sockets=[sock])


def _raise_fd_limit() -> None:
    """2,000 open requests need more descriptors than some defaults allow."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM when its parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SandboxProcess(ChildServer):
    """A sandbox in a child process on a free loopback port.

    Usage::

        with SandboxProcess(mode="model") as sandbox:
            httpx.get(sandbox.api_url + "/models")
    """

    def __init__(
        self,
        *,
        roster: Path | None = None,
        mode: str = "model",
        host: str = SANDBOX_HOST,
        port: int = 0,
        log_path: Path | None = None,
    ) -> None:
        self.roster, self.mode, self.host, self.port = roster, mode, host, port
        self.log_path = log_path
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._log_start = 0

    @property
    def api_url(self) -> str:
        return self.url + API_PATH

    @property
    def reference_url(self) -> str:
        return self.url + REFERENCE_PATH

    def deployment_url(self, name: str) -> str:
        """The API of the roster's deployment ``name`` (served as the reference is)."""
        return deployment_url(self.url, name)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = SANDBOX_STARTUP_TIMEOUT_S) -> SandboxProcess:
        cmd = [
            sys.executable,
            "-m",
            "quanthunt",
            "sandbox",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--mode",
            self.mode,
        ]
        if self.roster is not None:
            from quanthunt.sandbox.roster import load_roster

            load_roster(self.roster)  # a typo is named here, not in the child's log
            cmd += ["--roster", str(self.roster)]
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("a+", encoding="utf-8")
            self._log_start = self._log.tell()
        else:
            self._log = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - a single prctl call
            # Its own session: a Ctrl-C at the terminal reaches the stage, which stops
            # sending and finishes its in-flight requests before stopping the sandbox.
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self._proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                if self._proc.poll() is not None:
                    break
                continue
            line = self._proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                self.url = line[len(READY_PREFIX) :].split()[0]
                selector.close()
                return self
        selector.close()
        reason = self._stderr_tail()
        self.stop()
        raise SandboxError(f"the sandbox did not start: {reason or 'no output before the timeout'}")

    def _stderr_tail(self) -> str:
        if self._log is None or self._proc is None:
            return ""
        with contextlib.suppress(Exception):
            self._proc.wait(timeout=2)
        try:
            self._log.flush()
            self._log.seek(self._log_start)  # this start's lines only (the log file is appended to)
            lines = [line.strip() for line in self._log.read().splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        return (errors or lines or [""])[-1]

    def kill(self) -> None:
        """SIGKILL the sandbox (fault tests: a gateway that dies mid-run)."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
