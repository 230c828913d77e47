"""The ledger in PostgreSQL, which many hosts can share (``ledger.url`` or
``$QUANTHUNT_LEDGER_URL`` = ``postgresql://user@host:port/db``; the ``postgres`` extra
installs psycopg).

Two connections per process: one for reads, one for transactions. Transactions hold a
lock, so the group-commit writer's thread (``Ledger.threaded``) and recovery on the event
loop's thread take turns on it. Sessions that sit idle inside a transaction are cut by
the server (``idle_in_transaction_session_timeout``), so a stalled host cannot hold locks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from quanthunt.config_files import hide_userinfo
from quanthunt.errors import ConfigError
from quanthunt.ledger import Ledger, StartAttempt, Transaction
from quanthunt.ledger_schema import MIGRATIONS, Dialect

try:
    import psycopg
except ImportError:  # pragma: no cover - depends on the install
    psycopg = None  # type: ignore[assignment]

IDLE_IN_TRANSACTION_S = 30
"""A session idle inside a transaction this long is ended by the server."""


TYPES = Dialect(real="DOUBLE PRECISION", identity="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY")

MIGRATION_LOCK = 0x71_75_61_6E_74
"""The advisory lock key that serialises migrations when several hosts start at once."""


def _placeholders(sql: str) -> str:
    """The shared SQL's ``?`` as psycopg's ``%s`` (the ledger's SQL has no other ``?`` or ``%``)."""
    return sql.replace("?", "%s")


class _Tx(Transaction):
    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self.cursor = cursor

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.cursor.execute(_placeholders(sql), args)
        return self.cursor.fetchall() if self.cursor.description is not None else []

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.cursor.executemany(_placeholders(sql), list(rows))

    @property
    def rowcount(self) -> int:
        return self.cursor.rowcount


class PostgresLedger(Ledger):
    threaded: ClassVar[bool] = True

    def __init__(self, url: str, *, source: str = "ledger.url") -> None:
        self.url = url
        self.where = hide_userinfo(url)
        if psycopg is None:
            raise ConfigError(f"{source}: a PostgreSQL ledger needs psycopg: pip install 'quanthunt[postgres]'")
        options = f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"
        try:
            self._reads = psycopg.connect(url, autocommit=True, options=options, application_name="quanthunt")
            self._writes = psycopg.connect(url, autocommit=True, options=options, application_name="quanthunt")
        except psycopg.Error as exc:
            raise ConfigError(f"{source}: cannot reach the ledger at {self.where} ({hide_userinfo(str(exc)).strip()})") from None
        self._lock = threading.Lock()
        self._migrate()

    def close(self) -> None:
        self._reads.close()
        self._writes.close()

    def _migrate(self) -> None:
        with self.transaction() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
            tx.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,
                                                                 applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"""
            )
            applied = {row[0] for row in tx.execute("SELECT version FROM schema_migrations")}
            for version, migration in enumerate(MIGRATIONS, start=1):
                if version not in applied:
                    migration(tx, TYPES)
                    tx.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", (version, migration.__name__))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        with self._lock, self._writes.transaction(), self._writes.cursor() as cursor:
            yield _Tx(cursor)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._reads.execute(_placeholders(sql), args).fetchall()

    def _start(self, tx: Transaction, ops: Sequence[StartAttempt]) -> list[int]:
        assert isinstance(tx, _Tx)
        now = time.time()
        tx.cursor.executemany(
            """WITH request AS (
                   INSERT INTO requests (dataset, record_id, turn, params_hash, state, attempts, reserved_usd,
                                         created_at, updated_at)
                   VALUES (%s, %s, %s, %s, 'in_flight', 1, %s, %s, %s)
                   ON CONFLICT (dataset, record_id, turn, params_hash) DO UPDATE SET state='in_flight',
                                attempts=requests.attempts+1, reserved_usd=excluded.reserved_usd,
                                updated_at=excluded.updated_at
                   RETURNING dataset, record_id, turn, params_hash, attempts)
               INSERT INTO attempts (dataset, record_id, turn, params_hash, attempt, run_id, started_at, reserved_usd)
               SELECT dataset, record_id, turn, params_hash, attempts, %s, %s, %s FROM request
               RETURNING id""",
            [(*op.key.tuple(), op.reserved_usd, now, now, op.run_id, now, op.reserved_usd) for op in ops],
            returning=True,
        )
        ids = []
        while True:
            ids.append(int(tx.cursor.fetchone()[0]))  # type: ignore[index]
            if not tx.cursor.nextset():
                return ids
