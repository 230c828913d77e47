"""Where a stage sends its requests (quanthunt.connection): a gateway of its own roster on
the run's shared sandbox, which starts as a sandbox of its own would, else a sandbox of its
own; and the command that runs a pipeline beside one shared sandbox (``quanthunt sandbox
share``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict
from starlette.testclient import TestClient

from quanthunt.connection import SHARED_SANDBOX_ENV, open_targets, run_with_shared_sandbox, shared_gateway
from quanthunt.errors import ConfigError
from quanthunt.params import SANDBOX, Params, parse_params
from quanthunt.sandbox.app import SandboxServer
from quanthunt.sandbox.engine import LatencyEngine
from quanthunt.sandbox.roster import Roster
from quanthunt.sandbox.server import SandboxProcess

REPO = Path(__file__).resolve().parents[1]
ROSTER = roster_dict(provider("alpha"), provider("beta"))


def write(path: Path, roster: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(roster), encoding="utf-8")
    return path


def shipped_params(**changes: dict[str, Any]) -> Params:
    """The repository's params.yaml with these keys of its sections changed."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in changes.items():
        data[section].update(values)
    return parse_params(data, source="params.yaml")


def sandbox_params(roster: Path) -> Params:
    return shipped_params(sandbox={"roster": roster.name}, api={"base_url": SANDBOX}, reference={"base_url": SANDBOX})


def endpoints(api_url: str) -> list[str]:
    reply = httpx.get(f"{api_url}/models/{MODEL_ID}/endpoints", headers=AUTH)
    assert reply.status_code == 200, reply.text
    return sorted(e["tag"] for e in reply.json()["data"]["endpoints"])


def test_a_stage_opens_a_gateway_of_its_own_roster_on_the_shared_sandbox(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    shared = latency_sandbox(ROSTER)
    monkeypatch.setenv(SHARED_SANDBOX_ENV, shared.url + "/")

    def no_own_sandbox(self: SandboxProcess, *args: Any) -> SandboxProcess:
        raise AssertionError("a stage started a sandbox of its own beside the shared one")

    monkeypatch.setattr(SandboxProcess, "start", no_own_sandbox)
    write(tmp_path / "other.yaml", roster_dict(provider("gamma"), provider("delta"), provider("epsilon")))
    with open_targets(sandbox_params(tmp_path / "other.yaml"), root=tmp_path, stage="survey", needs_model=False) as targets:
        base = targets.sandbox_url
        assert base is not None and base.startswith(f"{shared.url}/gateways/")
        assert (targets.api_url, targets.reference_url) == (f"{base}/api/v1", f"{base}/reference/v1")
        assert endpoints(targets.api_url) == ["delta/int4", "epsilon/int4", "gamma/int4"]  # the stage's roster
        assert endpoints(shared.api_url) == ["alpha/int4", "beta/int4"]  # beside the sandbox's own
    assert httpx.get(f"{base}/api/v1/models").status_code == 404  # closed with the stage
    assert httpx.get(f"{shared.url}/health").json()["status"] == "ok"  # the sandbox serves on
    assert capsys.readouterr().err == ""


def test_each_gateway_starts_as_a_new_sandbox_would(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accounts, counters and the drift clock are the gateway's: what one stage spent or
    drifted is not the next stage's, as with a sandbox process of its own per stage."""
    roster = roster_dict(provider("alpha", drift=[{"after_requests": 1, "precision": "nvfp4"}]), credits={"default_usd": 1.0})
    monkeypatch.setenv(SHARED_SANDBOX_ENV, latency_sandbox(ROSTER).url)
    ask = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(2):  # two stages, one after the other
        with shared_gateway(write(tmp_path / "r.yaml", roster), needs_model=False) as base:
            assert base is not None
            stats = httpx.get(f"{base}/api/v1/sandbox/stats", headers=AUTH).json()
            assert (stats["requests"], stats["key"]["usage"], stats["drift"]) == (0, 0.0, {"alpha/int4": None})
            for _ in range(2):
                assert httpx.post(f"{base}/api/v1/chat/completions", json=ask, headers=AUTH).status_code == 200
            stats = httpx.get(f"{base}/api/v1/sandbox/stats", headers=AUTH).json()
            assert stats["requests"] == 2 and stats["key"]["usage"] > 0 and stats["drift"]["alpha/int4"] is not None


def test_a_stage_that_needs_the_model_starts_its_own_beside_a_latency_sandbox(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv(SHARED_SANDBOX_ENV, latency_sandbox(ROSTER).url)
    with shared_gateway(write(tmp_path / "r.yaml", ROSTER), needs_model=True) as base:
        assert base is None
    assert capsys.readouterr().err == ""  # no surprise: the shared one serves no model


def test_a_shared_sandbox_that_does_not_answer_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(SHARED_SANDBOX_ENV, "http://127.0.0.1:9")  # the discard port: refused
    with shared_gateway(write(tmp_path / "r.yaml", ROSTER), needs_model=False) as base:
        assert base is None
    assert "at http://127.0.0.1:9 (QUANTHUNT_SANDBOX_URL) opened no gateway (ConnectError); this stage starts its own" in (
        capsys.readouterr().err
    )


def test_gateways_are_opened_and_closed_with_clear_errors() -> None:
    client = TestClient(SandboxServer(Roster.model_validate(ROSTER), LatencyEngine(reply_tokens=4)))
    bad = client.post("/gateways", json={"roster": {"providers": []}})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("roster: providers: ")
    assert client.post("/gateways", content=b"not json").json()["error"]["message"] == 'the body must be JSON: {"roster": {...}}'
    assert client.get("/gateways").status_code == 405
    opened = client.post("/gateways", json={"roster": ROSTER})
    assert opened.status_code == 201 and opened.json()["mode"] == "latency"
    path = opened.json()["path"]
    assert client.get(f"{path}/health").json()["status"] == "ok"
    missing = client.get(f"{path}/api/v1/nowhere")
    assert missing.status_code == 404 and path in missing.json()["error"]["message"]  # errors name the full path
    assert client.delete(path).status_code == 204
    assert client.get(f"{path}/health").status_code == 404
    assert client.get("/health").json()["status"] == "ok"


WAITER = """
import os, signal, sys, time, httpx
url, out = os.environ["QUANTHUNT_SANDBOX_URL"], sys.argv[1]
mode = httpx.get(url + "/health", timeout=10).json()["mode"]
def stop(signum, frame):  # a stage finishing its requests on the sandbox after a stop
    status = httpx.get(url + "/health", timeout=10).json()["status"]
    open(out, "a").write(f"{signal.Signals(signum).name} {status}\\n")
    sys.exit(128 + signum)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
open(out, "a").write(f"{url} {mode}\\n")
while True:
    time.sleep(0.1)
"""


@pytest.mark.model
@pytest.mark.parametrize(("sig", "whom", "code"), [(signal.SIGINT, "group", 130), (signal.SIGTERM, "share", 143)])
def test_a_stop_reaches_the_command_while_the_sandbox_serves_it(
    tmp_path: Path, sig: signal.Signals, whom: str, code: int
) -> None:
    """``share`` runs the command beside a model sandbox, logged to logs/sandbox-shared.log.
    Ctrl-C at a terminal signals the whole job (``share`` and the command): the command
    stops while the sandbox, in a session of its own, still serves it; a SIGTERM sent to
    ``share`` alone (a supervisor's) is passed on. ``share`` exits with the command's code
    and stops the sandbox after it."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["sandbox"]["roster"] = write(tmp_path / "r.yaml", ROSTER).name
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    seen = tmp_path / "seen.txt"
    share = subprocess.Popen(  # its own process group, as a terminal's job
        [str(Path(sys.executable).parent / "quanthunt"), "sandbox", "share", "--", sys.executable, "-c", WAITER, str(seen)],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (seen.exists() and seen.read_text().endswith("\n")):
        assert share.poll() is None and time.monotonic() < deadline, share.communicate()
        time.sleep(0.1)
    if whom == "group":
        os.killpg(share.pid, sig)
    else:
        share.send_signal(sig)
    _, stderr = share.communicate(timeout=60)
    started, stopped = seen.read_text().splitlines()
    url, mode = started.split()
    assert mode == "model" and (tmp_path / "logs" / "sandbox-shared.log").is_file()
    assert stopped == f"{sig.name} ok", stderr  # the sandbox answered the stopping command
    assert share.returncode == code, stderr
    with pytest.raises(httpx.ConnectError):  # and is stopped after it
        httpx.get(f"{url}/health", timeout=2)


def test_share_without_a_sandbox_runs_the_command_alone(tmp_path: Path) -> None:
    live = shipped_params(api={"base_url": "https://openrouter.ai/api/v1"}, reference={"base_url": "http://127.0.0.1:8000/v1"})
    check = "import os, sys; sys.exit(7 if 'QUANTHUNT_SANDBOX_URL' in os.environ else 5)"
    assert run_with_shared_sandbox(live, root=tmp_path, command=[sys.executable, "-c", check]) == 5
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ConfigError, match="cannot run 'no-such-program-here'"):
        run_with_shared_sandbox(live, root=tmp_path, command=["no-such-program-here"])
