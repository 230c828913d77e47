"""The PostgreSQL test server (tests/fixtures/postgres.py) and the partition proxy
(tests/fixtures/blackhole.py). The shared ledger's tests trust both to behave like the real
thing: a server that keeps what it acknowledged across a crash, databases that do not leak
into each other, and a partition that answers nothing rather than failing fast."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.blackhole import TcpProxy
from fixtures.postgres import PostgresServer, find_bindir


def _uids(pid: int) -> tuple[int, int]:
    """The process's real and effective uid, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            real, effective = line.split()[1:3]
            return int(real), int(effective)
    raise AssertionError(f"no Uid line for pid {pid}")


def _make_bindir(root: Path, *names: str) -> Path:
    root.mkdir(parents=True)
    for name in names:
        path = root / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


# --- the server -----------------------------------------------------------------------------


def test_server_answers_with_its_clock(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT now(), current_setting('server_encoding')").fetchone()
    assert row is not None
    now, encoding = row
    assert abs(now - datetime.now(UTC)) < timedelta(minutes=1)
    assert encoding == "UTF8"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process owners from /proc")
def test_server_does_not_run_as_root(postgres_server: PostgresServer, postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT current_setting('data_directory'), pg_backend_pid()").fetchone()
        assert row is not None
        data_directory, backend_pid = row
        backend = _uids(backend_pid)
    owner = Path(data_directory).stat().st_uid
    assert Path(data_directory) == postgres_server.data_dir
    assert owner != 0
    assert _uids(postgres_server.postmaster_pid) == (owner, owner)
    assert backend == (owner, owner)
    if os.geteuid() != 0:
        assert owner == os.geteuid()  # not root: no reason to run it as anyone else


def test_databases_are_isolated(postgres_server: PostgresServer, postgres_url: str) -> None:
    other_name = f"other_{uuid.uuid4().hex[:12]}"
    other_url = postgres_server.create_database(other_name)
    try:
        with psycopg.connect(postgres_url) as first:
            first.execute("CREATE TABLE ledger (entry text)")
            first.execute("INSERT INTO ledger VALUES ('first')")
        with psycopg.connect(other_url) as second:
            row = second.execute("SELECT to_regclass('ledger')").fetchone()
            assert row == (None,)
            second.execute("CREATE TABLE ledger (entry text)")
            second.execute("INSERT INTO ledger VALUES ('second')")
        with psycopg.connect(postgres_url) as first:
            assert first.execute("SELECT entry FROM ledger").fetchall() == [("first",)]
    finally:
        postgres_server.drop_database(other_name)


def test_restart_immediate_keeps_committed_rows_and_loses_the_rest(postgres_server: PostgresServer, postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE ledger (id int PRIMARY KEY, entry text)")
        conn.execute("INSERT INTO ledger SELECT i, 'committed' FROM generate_series(1, 500) AS i")
        conn.commit()
        started = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    pending = psycopg.connect(postgres_url)
    pending.execute("INSERT INTO ledger VALUES (501, 'uncommitted')")  # left open across the crash

    postgres_server.restart_immediate()
    pending.close()

    with psycopg.connect(postgres_url) as conn:
        restarted = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
        counts = conn.execute("SELECT entry, count(*) FROM ledger GROUP BY entry").fetchall()
        conn.execute("INSERT INTO ledger VALUES (502, 'after')")  # and it takes writes again
        conn.commit()
    assert started is not None and restarted is not None and restarted[0] > started[0]
    assert counts == [("committed", 500)]
    assert "automatic recovery in progress" in postgres_server.log_tail(200)  # a crash, not a clean stop


def test_find_bindir_takes_path_first_then_the_newest_debian_version(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    full = ("initdb", "pg_ctl", "postgres")
    _make_bindir(lib / "9.6" / "bin", *full)
    _make_bindir(lib / "13" / "bin", *full)
    fifteen = _make_bindir(lib / "15" / "bin", *full)
    _make_bindir(lib / "16" / "bin", "psql")  # a client-only install: not a server
    assert find_bindir(path="", lib_root=lib) == fifteen  # 15 > 13 > 9.6, compared as numbers

    on_path = tmp_path / "local-bin"
    on_path.mkdir()
    for name in full:
        (on_path / name).symlink_to(lib / "13" / "bin" / name)
    assert find_bindir(path=str(on_path), lib_root=lib) == lib / "13" / "bin"

    assert find_bindir(path="", lib_root=tmp_path / "absent") is None


def test_postgresql_is_installed_here() -> None:
    """`make test` installs PostgreSQL (`make postgres`), so its tests must run, not skip."""
    assert find_bindir() is not None


# --- the partition proxy --------------------------------------------------------------------


def _proxy_url(proxy: TcpProxy) -> str:
    return f"postgresql://quanthunt@127.0.0.1:{proxy.port}/postgres"


def test_a_blackhole_stalls_queries_until_it_ends(postgres_server: PostgresServer) -> None:
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy, psycopg.connect(_proxy_url(proxy), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

        proxy.blackhole(3.0)
        answer: dict[str, Any] = {}
        query = threading.Thread(target=lambda: answer.update(row=conn.execute("SELECT 42").fetchone()), daemon=True)
        started = time.monotonic()
        query.start()
        query.join(timeout=1.0)
        assert query.is_alive(), "a query crossed the blackhole"
        assert proxy.blackholed

        query.join(timeout=15.0)  # the partition heals: the stalled query is answered, the stream intact
        assert not query.is_alive()
        assert answer == {"row": (42,)}
        assert time.monotonic() - started >= 2.5
        assert not proxy.blackholed
        assert conn.execute("SELECT 43").fetchone() == (43,)

        with psycopg.connect(_proxy_url(proxy), connect_timeout=5) as fresh:
            assert fresh.execute("SELECT 44").fetchone() == (44,)


def test_connecting_during_a_blackhole_times_out_rather_than_being_refused(postgres_server: PostgresServer) -> None:
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        proxy.blackhole(60.0)
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="timeout"):
            psycopg.connect(_proxy_url(proxy), connect_timeout=2)
        assert time.monotonic() - started >= 1.5

        proxy.heal()
        with psycopg.connect(_proxy_url(proxy), connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
