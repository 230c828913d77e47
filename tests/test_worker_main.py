"""`quanthunt worker` as a user meets it before any work: a ledger it cannot use is a
one-line error naming where the URL came from (never its password), and a ledger with
no open job is nothing to do (a real PostgreSQL server for that one)."""

from __future__ import annotations

import subprocess

import pytest
from fixtures.project import BIN

from quanthunt.errors import EXIT_BAD_INPUT


def worker(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(BIN)} | ({"QUANTHUNT_LEDGER_URL": url} if url is not None else {})
    return subprocess.run([str(BIN / "quanthunt"), "worker", *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///state/ledger.sqlite", "workers share a PostgreSQL ledger"),
        ("mysql://db/ledger", "is not a ledger URL"),
        ("postgresql://quanthunt:hunter2@127.0.0.1:1/ledger?connect_timeout=2", "cannot reach the ledger"),
    ],
)
def test_a_ledger_a_worker_cannot_use_is_one_line_naming_the_variable(url: str, message: str) -> None:
    done = worker(url=url)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --ledger / $QUANTHUNT_LEDGER_URL: ") and message in line, line
    assert "hunter2" not in done.stderr + done.stdout


def test_no_url_at_all_is_a_usage_error() -> None:
    done = worker()
    assert done.returncode == 2 and "--ledger" in done.stderr, done.stderr


def test_a_ledger_with_no_open_job_is_nothing_to_do(postgres_url: str) -> None:
    done = worker("--ledger", postgres_url)
    assert done.returncode == 0, done.stderr
    assert "no open job with records left" in done.stderr and "nothing to do" in done.stderr, done.stderr
