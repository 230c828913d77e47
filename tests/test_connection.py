"""Where a stage sends its requests (quanthunt.connection): the run's shared sandbox when
it serves the stage's roster as the stage needs it, else one of the stage's own; and the
command that runs a pipeline beside one shared sandbox (``quanthunt sandbox share``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fixtures.sandbox import provider, roster_dict

from quanthunt.connection import SHARED_SANDBOX_ENV, open_targets, run_with_shared_sandbox, shared_sandbox
from quanthunt.errors import ConfigError
from quanthunt.params import SANDBOX, Params, parse_params
from quanthunt.sandbox.roster import load_roster
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


def test_a_stage_uses_the_shared_sandbox_that_serves_its_roster(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    shared = latency_sandbox(ROSTER)
    monkeypatch.setenv(SHARED_SANDBOX_ENV, shared.url + "/")
    assert shared_sandbox(write(tmp_path / "same.yaml", ROSTER), needs_model=False) == shared.url
    assert capsys.readouterr().err == ""

    def no_own_sandbox(self: SandboxProcess, *args: Any) -> SandboxProcess:
        raise AssertionError("a stage started a sandbox of its own beside the shared one")

    monkeypatch.setattr(SandboxProcess, "start", no_own_sandbox)
    params = sandbox_params(tmp_path / "same.yaml")
    with open_targets(params, root=tmp_path, stage="survey", needs_model=False) as targets:
        assert (targets.api_url, targets.reference_url) == (f"{shared.url}/api/v1", f"{shared.url}/reference/v1")
        assert targets.sandbox_url == shared.url
        assert httpx.get(f"{targets.api_url}/models").status_code == 200
    assert httpx.get(f"{shared.url}/health").json()["status"] == "ok"  # leaving the stage leaves it serving


@pytest.mark.parametrize(
    ("stage_roster", "needs_model", "why"),
    [
        (roster_dict(provider("alpha")), False, "serves another roster"),
        (roster_dict(provider("alpha"), provider("beta", latency_ms=1)), False, "serves another roster"),
        (ROSTER, True, "serves no model (latency mode)"),
    ],
)
def test_a_stage_starts_its_own_when_the_shared_sandbox_serves_something_else(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], stage_roster: dict[str, Any], needs_model: bool, why: str,
) -> None:  # fmt: skip
    shared = latency_sandbox(ROSTER)
    monkeypatch.setenv(SHARED_SANDBOX_ENV, shared.url)
    assert shared_sandbox(write(tmp_path / "stage.yaml", stage_roster), needs_model=needs_model) is None
    assert capsys.readouterr().err == (
        f"note: the shared sandbox at {shared.url} ({SHARED_SANDBOX_ENV}) {why}; this stage starts its own\n"
    )


def test_a_shared_sandbox_that_does_not_answer_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(SHARED_SANDBOX_ENV, "http://127.0.0.1:9")  # the discard port: refused
    assert shared_sandbox(write(tmp_path / "r.yaml", ROSTER), needs_model=False) is None
    assert "http://127.0.0.1:9 (QUANTHUNT_SANDBOX_URL) does not answer; this stage starts its own" in capsys.readouterr().err


def test_a_roster_that_counts_from_the_start_is_never_shared(
    latency_sandbox: Callable[..., SandboxProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drifting = roster_dict(provider("alpha", drift=[{"after_requests": 3, "precision": "nvfp4"}]), provider("beta"))
    outage = roster_dict(provider("alpha"), reference_outage={"after": 5})
    for roster in (drifting, outage):
        path = write(tmp_path / "r.yaml", roster)
        assert load_roster(path).counts_from_start
        monkeypatch.setenv(SHARED_SANDBOX_ENV, latency_sandbox(roster).url)  # even one serving this very roster
        assert shared_sandbox(path, needs_model=False) is None
    assert not load_roster(write(tmp_path / "plain.yaml", ROSTER)).counts_from_start


ASK = """
import os, sys, httpx
url = os.environ["QUANTHUNT_SANDBOX_URL"]
health = httpx.get(url + "/health").json()
open(sys.argv[2], "w").write(" ".join([url, health["mode"], health["roster"]]))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.model
def test_share_runs_the_command_beside_one_model_sandbox_and_stops_it(tmp_path: Path) -> None:
    roster = write(tmp_path / "r.yaml", ROSTER)
    seen = tmp_path / "seen.txt"
    command = [sys.executable, "-c", ASK, "3", str(seen)]
    assert run_with_shared_sandbox(sandbox_params(roster), root=tmp_path, command=command) == 3  # the command's code
    url, mode, digest = seen.read_text().split()
    assert (mode, digest) == ("model", load_roster(roster).digest())
    assert (tmp_path / "logs" / "sandbox-shared.log").is_file()
    with pytest.raises(httpx.ConnectError):  # stopped once the command ended
        httpx.get(f"{url}/health", timeout=2)


def test_share_without_a_sandbox_runs_the_command_alone(tmp_path: Path) -> None:
    live = shipped_params(api={"base_url": "https://openrouter.ai/api/v1"}, reference={"base_url": "http://127.0.0.1:8000/v1"})
    check = "import os, sys; sys.exit(7 if 'QUANTHUNT_SANDBOX_URL' in os.environ else 5)"
    assert run_with_shared_sandbox(live, root=tmp_path, command=[sys.executable, "-c", check]) == 5
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ConfigError, match="cannot run 'no-such-program-here'"):
        run_with_shared_sandbox(live, root=tmp_path, command=["no-such-program-here"])
