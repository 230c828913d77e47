"""The ledger in a local SQLite file (WAL): the default backend, for one host.

One connection serves reads and the writer's transactions, on the event loop's thread
(``Ledger.threaded`` is false: measured faster than a writer thread).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from quanthunt.errors import ConfigError
from quanthunt.ledger import Ledger, StartAttempt, Transaction
from quanthunt.ledger_schema import MIGRATIONS, Dialect

TYPES = Dialect(real="REAL", identity="INTEGER PRIMARY KEY AUTOINCREMENT")


class _Tx(Transaction):
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self._rowcount = 0

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cursor = self.db.execute(sql, args)
        self._rowcount = cursor.rowcount
        return cursor.fetchall()

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.db.executemany(sql, rows)

    @property
    def rowcount(self) -> int:
        return self._rowcount


class SqliteLedger(Ledger):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # durable against process crashes; WAL keeps it consistent
            self.db.execute("PRAGMA busy_timeout=10000")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{path}: not a usable ledger database ({exc})") from None

    def close(self) -> None:
        self.db.close()

    def _migrate(self) -> None:
        self.db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
        applied = {row[0] for row in self.db.execute("SELECT version FROM schema_migrations")}
        for version, migration in enumerate(MIGRATIONS, start=1):
            if version in applied:
                continue
            with self.transaction() as tx:
                migration(tx, TYPES)
                self.db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield _Tx(self.db)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.db.execute(sql, args).fetchall()

    def _start(self, tx: Transaction, ops: Sequence[StartAttempt]) -> list[int | None]:
        ids: list[int | None] = []
        now = time.time()
        for op in ops:
            ((attempt,),) = tx.execute(
                """INSERT INTO requests (dataset, record_id, turn, params_hash, state, attempts, reserved_usd,
                                         created_at, updated_at)
                   VALUES (?, ?, ?, ?, 'in_flight', 1, ?, ?, ?)
                   ON CONFLICT (dataset, record_id, turn, params_hash) DO UPDATE SET state='in_flight', attempts=attempts+1,
                                reserved_usd=excluded.reserved_usd, updated_at=excluded.updated_at
                   RETURNING attempts""",
                (*op.key.tuple(), op.reserved_usd, now, now),
            )
            tx.execute(
                """INSERT INTO attempts (dataset, record_id, turn, params_hash, attempt, run_id, started_at, reserved_usd)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                (*op.key.tuple(), attempt, op.run_id, now, op.reserved_usd),
            )
            ids.append(int(self.db.execute("SELECT last_insert_rowid()").fetchone()[0]))
        return ids
