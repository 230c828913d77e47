"""Starting and stopping the sandbox, and refusing to start when it should not."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from quanthunt.errors import ConfigError
from quanthunt.sandbox.server import SandboxProcess
from quanthunt.urls import is_loopback


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quanthunt", *args], capture_output=True, text=True, timeout=60, check=False)


def test_help_lists_the_command_groups() -> None:
    result = cli("--help")
    assert result.returncode == 0
    assert "sandbox" in result.stdout


def test_non_loopback_host_needs_an_explicit_flag() -> None:
    result = cli("sandbox", "serve", "--host", "0.0.0.0", "--mode", "latency")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "error: refusing to listen on non-loopback host 0.0.0.0: pass --allow-remote to expose the sandbox"
    )


def test_bad_roster_is_one_line_naming_file_and_field(tmp_path: Path) -> None:
    roster = tmp_path / "roster.yaml"
    entry = "{name: A, slug: a, tag: a/x, quantization: int4, precision: fp1, pricing: {prompt: '0', completion: '0'}}"
    roster.write_text(f"providers:\n- {entry}\n")
    result = cli("sandbox", "serve", "--roster", str(roster), "--mode", "latency", "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: {roster}: providers.0.precision")
    assert "Traceback" not in result.stderr
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(roster))}: providers\.0\.precision"):
        SandboxProcess(mode="latency", roster=roster).start()  # checked before the child starts


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("sandbox", "serve", "--mode", "latency", "--port", str(port))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_process_serves_then_stops(tmp_path: Path) -> None:
    with SandboxProcess(mode="latency", log_path=tmp_path / "log") as sandbox:
        assert sandbox.url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{sandbox.url}/health").json()["mode"] == "latency"
        url = sandbox.url
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
