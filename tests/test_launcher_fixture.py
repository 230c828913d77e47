"""The launcher the stage tests run ``quanthunt`` with (tests/fixtures/launcher.py): a
command forked from the preloaded Python must answer exactly as a new interpreter does,
in its own directory and environment, and one that hangs is killed with what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fixtures.launcher import Launcher, launcher
from fixtures.project import BIN
from fixtures.sandbox import provider, roster_dict

QUANTHUNT = str(BIN / "quanthunt")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Launcher]:
    (tmp_path / "launcher").mkdir()
    with launcher(tmp_path / "launcher") as server:
        if server is None:
            pytest.skip("QUANTHUNT_TEST_FRESH_PROCESSES is set: the tests start no launcher")  # and use none
        yield server


def fresh(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_a_command_answers_as_a_new_interpreter_does(started: Launcher, tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("survey: [not, a, mapping\n")
    env = dict(os.environ)
    for argv in (
        [QUANTHUNT, "survey", "--params", "params.yaml"],  # a bad params file: exit 2 and one line
        [QUANTHUNT, "survey", "--params", "missing.yaml"],
        [QUANTHUNT, "no-such-command"],  # a usage error
    ):
        launched, new = started.run(argv, tmp_path, env, 60), fresh(argv, tmp_path, env)
        assert (launched.returncode, launched.stdout, launched.stderr) == (new.returncode, new.stdout, new.stderr)
        assert launched.returncode != 0 and launched.stderr


def test_each_command_has_its_own_directory_and_environment(started: Launcher, tmp_path: Path) -> None:
    for name, columns in (("narrow", "60"), ("wide", "160"), ("narrow-again", "60")):
        cwd = tmp_path / name
        cwd.mkdir()
        (cwd / "params.yaml").write_text(f"{name}: [\n")  # the error names this directory's file
        env = dict(os.environ, COLUMNS=columns)
        argv = [QUANTHUNT, "survey", "--params", "params.yaml"]
        assert started.run(argv, cwd, env, 60).stderr == fresh(argv, cwd, env).stderr
        argv = [QUANTHUNT, "survey", "--help"]  # rich wraps the help to $COLUMNS
        launched = started.run(argv, cwd, env, 60)
        assert launched.stdout == fresh(argv, cwd, env).stdout
        assert max(len(line) for line in launched.stdout.splitlines()) == int(columns)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_command_past_its_timeout_is_killed(started: Launcher, tmp_path: Path) -> None:
    roster = tmp_path / "roster.yaml"  # unique to this test: in the command line of what it starts
    roster.write_text(yaml.safe_dump(roster_dict(provider("alpha"))))
    marker = str(roster)
    argv = [QUANTHUNT, "sandbox", "serve", "--mode", "latency", "--port", "0", "--roster", marker]
    begun = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        started.run(argv, tmp_path, dict(os.environ, PYTHONUNBUFFERED="1"), timeout=8)
    assert 8 <= time.monotonic() - begun < 20
    assert "http://127.0.0.1:" in str(timed_out.value.stdout)  # it was serving when the timeout came
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []
    assert started.run([QUANTHUNT, "--help"], tmp_path, dict(os.environ), 60).returncode == 0  # the launcher serves on


def test_a_started_command_is_a_process_group_of_its_own_that_answers_signals(started: Launcher, tmp_path: Path) -> None:
    """``Launcher.start`` (``Project.start``): ``subprocess.Popen``'s contract for the stage
    tests that signal or kill a command mid-run, the command its own process group's leader."""
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump(roster_dict(provider("alpha"))))
    argv = [QUANTHUNT, "sandbox", "serve", "--mode", "latency", "--port", "0", "--roster", str(roster)]
    with started.start(argv, tmp_path, dict(os.environ, PYTHONUNBUFFERED="1")) as serving:
        assert os.getpgid(serving.pid) == serving.pid
        deadline = time.monotonic() + 30
        out = tmp_path / "launcher/1.out"  # the launcher's first command's output, written as it runs
        while not (out.exists() and "http://127.0.0.1:" in out.read_text()):
            assert serving.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(subprocess.TimeoutExpired):
            serving.wait(timeout=0.2)
        os.killpg(serving.pid, signal.SIGINT)  # a Ctrl-C at the terminal
        out, _ = serving.communicate(timeout=30)
    assert serving.returncode == serving.poll() is not None and "http://127.0.0.1:" in out
    killed = started.start([QUANTHUNT, "sandbox", "serve", "--mode", "latency", "--port", "0"], tmp_path, dict(os.environ))
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL


def test_the_server_ends_with_the_test_process_that_started_it(tmp_path: Path) -> None:
    """A test process killed outright (kill -9, an out-of-memory kill) leaves no launcher behind."""
    script = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
        "from fixtures.launcher import Launcher; "
        f"print(Launcher(Path({str(tmp_path)!r})).server.pid, flush=True); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server = int(parent.stdout.readline())
    assert _running(server)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(server)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie awaiting its reaper)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status
