"""The ledger in PostgreSQL, which many hosts can share (``ledger.url`` or
``$QUANTHUNT_LEDGER_URL`` = ``postgresql://user@host:port/db``; the ``postgres`` extra
installs psycopg).

Two connections per process: one for reads, one for transactions. Transactions hold a
lock, so the group-commit writer's thread (``Ledger.threaded``) and recovery on the event
loop's thread take turns on it. Sessions that sit idle inside a transaction are cut by
the server (``idle_in_transaction_session_timeout``), so a stalled host cannot hold locks.
A server that goes away (a restart, a partition) is ridden out on fresh connections
(``ride_out``). What only a shared ledger has: the schema of ``shared_work``, and the
fence a worker's commits go through (``ALIVE``, ``CLAIM``; ``quanthunt.shared`` says why).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from quanthunt.config_files import hide_userinfo, one_line
from quanthunt.errors import ConfigError
from quanthunt.ledger import FINISH, FinishAttempt, Ledger, Operation, StartAttempt, Transaction, WriteRecords
from quanthunt.ledger_schema import Dialect, monitors, probe_replies, replaced_records, requests_and_attempts, run_script

try:
    import psycopg
except ImportError:  # pragma: no cover - depends on the install
    psycopg = None  # type: ignore[assignment]

T = TypeVar("T")

IDLE_IN_TRANSACTION_S = 30
"""A session idle inside a transaction this long is ended by the server."""

RIDE_OUT_S = 120.0
"""How long a host keeps trying while the server is away (a restart, a partition) before
an operation fails."""

RIDE_OUT_PAUSE_S = 1.0
"""The longest pause between two tries (they start 50 ms apart and double)."""

CONNECTION: dict[str, Any] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
"""libpq settings: a server that stops answering (a partition: packets vanish, nothing
resets the connection) is noticed within ~10 s instead of TCP's ~15 minutes."""


TYPES = Dialect(real="DOUBLE PRECISION", identity="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY")


def shared_work(tx: Transaction, types: Dialect) -> None:
    """What lets many hosts work one dataset (``quanthunt.shared``): budgets with their cap
    as a constraint, the published jobs, the workers (liveness on the server's clock), the
    work queue whose claims fence every write, and which worker made each attempt and wrote
    each record."""
    run_script(
        tx,
        """
        ALTER TABLE attempts ADD COLUMN worker BIGINT;
        ALTER TABLE records ADD COLUMN worker BIGINT;
        CREATE INDEX attempts_by_worker ON attempts (worker);
        CREATE TABLE budgets (
            name TEXT PRIMARY KEY,
            parent TEXT REFERENCES budgets (name),
            cap_usd DOUBLE PRECISION NOT NULL CHECK (cap_usd >= 0),
            settled_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
            unknown_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
            reserved_usd DOUBLE PRECISION NOT NULL DEFAULT 0 CHECK (reserved_usd >= -1e-9),
            CHECK (settled_usd + unknown_usd + reserved_usd <= cap_usd + 1e-9)
        );
        CREATE TABLE jobs (
            dataset TEXT NOT NULL,
            params_hash TEXT NOT NULL,
            run_id TEXT NOT NULL,
            budget TEXT NOT NULL REFERENCES budgets (name),
            job TEXT NOT NULL,
            api_url TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'closed')),
            opened_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            PRIMARY KEY (dataset, params_hash)
        );
        CREATE TABLE workers (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            dataset TEXT NOT NULL,
            params_hash TEXT NOT NULL,
            budget TEXT NOT NULL REFERENCES budgets (name),
            started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            alive BOOLEAN NOT NULL DEFAULT true,
            leased_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
            retired_at TIMESTAMPTZ,
            retired_why TEXT,
            FOREIGN KEY (dataset, params_hash) REFERENCES jobs
        );
        CREATE TABLE work (
            dataset TEXT NOT NULL,
            params_hash TEXT NOT NULL,
            record_id TEXT NOT NULL,
            position INTEGER NOT NULL,
            prompt TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'todo' CHECK (state IN ('todo', 'claimed', 'done', 'failed', 'skipped')),
            owner BIGINT REFERENCES workers (id),
            epoch INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (dataset, params_hash, record_id),
            FOREIGN KEY (dataset, params_hash) REFERENCES jobs
        );
        CREATE INDEX work_todo ON work (dataset, params_hash, position) WHERE state = 'todo';
        CREATE INDEX work_claimed ON work (owner) WHERE state = 'claimed';
        """,
    )


MIGRATIONS = (requests_and_attempts, monitors, shared_work, probe_replies, replaced_records)
"""In order (a migration keeps its number once applied, so new ones go at the end): the
schema both backends share, what only a shared ledger has, then the verify stage's paid
probe replies and the records generate set aside to make again."""

MIGRATION_LOCK = 0x71_75_61_6E_74
"""The advisory lock key that serialises migrations when several hosts start at once."""

ALIVE = "SELECT alive FROM workers WHERE id = %s FOR SHARE"
"""The fence, taken once per commit: this worker has not been retired. Only retiring a
worker takes its claims away, and retiring updates this row, so ``FOR SHARE`` orders every
commit against a takeover: either the commit lands first and the takeover sees it (its
requests in flight, its lines), or the takeover lands first and the commit finds the
worker retired and writes nothing but its attempts' costs."""

CLAIM = "owner = %s AND epoch = %s AND state = 'claimed'"
"""A record's line goes in only under the claim it was made under."""


@dataclass
class Fence:
    """A worker's identity and its claims (``ALIVE``, ``CLAIM``)."""

    worker: int
    epochs: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(dataset, params hash, record id) -> the epoch of this worker's claim on it."""

    def claim(self, dataset: str, params_hash: str, record_id: str) -> tuple[int, int]:
        """The values of ``CLAIM`` for one record (epoch -1: never ours, so refused)."""
        return self.worker, self.epochs.get((dataset, params_hash, record_id), -1)


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
        self.application_name = "quanthunt"
        self._session_lock: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self.fence: Fence | None = None
        """Set by a worker (``quanthunt.shared``): every commit is then fenced (``ALIVE``)."""
        self._retired = False
        """Whether the commit under way found this worker retired (``_begin``)."""
        self.reconnects = 0
        try:
            self._reads = self._connect(reads=True)
            self._writes = self._connect()
        except psycopg.Error as exc:
            reason = one_line(" ".join(hide_userinfo(str(exc)).split()), 300)  # libpq's message spans lines
            raise ConfigError(f"{source}: cannot reach the ledger at {self.where} ({reason})") from None
        self.ride_out(self._migrate)

    def _connect(self, *, reads: bool = False) -> psycopg.Connection[Any]:
        """A session; the reads session also holds the session lock when there is one (taken
        again after a reconnect; never waited for, so a session that outlived its process's
        connection cannot stall the reconnect)."""
        options = f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"
        connection = psycopg.connect(
            self.url, autocommit=True, options=options, application_name=self.application_name, **CONNECTION
        )
        if reads and self._session_lock is not None:
            connection.execute("SELECT pg_try_advisory_lock(%s, %s)", self._session_lock)
        return connection

    def close(self) -> None:
        self._reads.close()
        self._writes.close()

    def hold_session_lock(self, space: int, key: int, application_name: str) -> None:
        """Hold an advisory lock for as long as this process lives (taken again after a
        reconnect), and name the sessions, so that others can tell it is alive and end
        its sessions when they presume it dead."""
        self.application_name = application_name
        for connection in (self._reads, self._writes):
            connection.execute("SELECT set_config('application_name', %s, false)", (application_name,))
        self._reads.execute("SELECT pg_advisory_lock(%s, %s)", (space, key))
        self._session_lock = (space, key)

    def ride_out(self, operation: Callable[[], T]) -> T:
        """``operation()``, tried again on fresh connections while the server is away (up to
        ``RIDE_OUT_S``). A transaction whose commit was lost may so run twice: the ledger's
        operations are upserts or count conservatively (a second attempt row stays
        unknown, i.e. possibly billed), never a second payment."""
        deadline, pause = time.monotonic() + RIDE_OUT_S, 0.05
        while True:
            try:
                return operation()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, RIDE_OUT_PAUSE_S)
            with self._lock, contextlib.suppress(psycopg.OperationalError):
                if self._reads.broken or self._reads.closed:
                    self._reads = self._connect(reads=True)
                if self._writes.broken or self._writes.closed:
                    self._writes = self._connect()
                self.reconnects += 1

    def transact(self, body: Callable[[Transaction], T]) -> T:
        """``body(tx)`` in one transaction, ridden out like any operation (``ride_out``)."""

        def once() -> T:
            with self.transaction() as tx:
                return body(tx)

        return self.ride_out(once)

    def commit(self, ops: Sequence[Operation]) -> list[Any]:
        return self.ride_out(lambda: super(PostgresLedger, self).commit(ops))

    def _begin(self, tx: Transaction) -> None:
        """A fenced commit first takes ``ALIVE``."""
        self._retired = False
        if self.fence is not None:
            assert isinstance(tx, _Tx)
            tx.cursor.execute(ALIVE, (self.fence.worker,))
            row = tx.cursor.fetchone()
            self._retired = row is None or not row[0]

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
        return self.ride_out(lambda: self._reads.execute(_placeholders(sql), args).fetchall())

    def _start(self, tx: Transaction, ops: Sequence[StartAttempt]) -> list[int | None]:
        assert isinstance(tx, _Tx)
        if self._retired:
            return [None] * len(ops)
        now = time.time()
        worker = self.fence.worker if self.fence is not None else None
        tx.cursor.executemany(
            """WITH request AS (
                   INSERT INTO requests (dataset, record_id, turn, params_hash, state, attempts, reserved_usd,
                                         created_at, updated_at)
                   VALUES (%s, %s, %s, %s, 'in_flight', 1, %s, %s, %s)
                   ON CONFLICT (dataset, record_id, turn, params_hash) DO UPDATE SET state='in_flight',
                                attempts=requests.attempts+1, reserved_usd=excluded.reserved_usd,
                                updated_at=excluded.updated_at
                   RETURNING dataset, record_id, turn, params_hash, attempts)
               INSERT INTO attempts (dataset, record_id, turn, params_hash, attempt, run_id, started_at, reserved_usd, worker)
               SELECT dataset, record_id, turn, params_hash, attempts, %s, %s, %s, %s FROM request
               RETURNING id""",
            [(*op.key.tuple(), op.reserved_usd, now, now, op.run_id, now, op.reserved_usd, worker) for op in ops],
            returning=True,
        )
        ids: list[int | None] = []
        while True:
            ids.extend(int(row[0]) for row in tx.cursor.fetchall())
            if not tx.cursor.nextset():
                return ids

    def _apply(self, tx: Transaction, kind: type, ops: list[Any]) -> list[Any]:
        """On a fenced ledger: a retired worker's finished attempts keep their cost (money
        spent is a fact) but nothing else it writes lands; a record's line lands only under
        the claim it was made under."""
        fence = self.fence
        if fence is None or kind not in (FinishAttempt, WriteRecords):
            return super()._apply(tx, kind, ops)
        now = time.time()
        if kind is FinishAttempt:
            if not self._retired:
                return super()._apply(tx, kind, ops)
            tx.executemany(FINISH[0], [op.attempt_row(now) for op in ops])
            return [None] * len(ops)
        if self._retired:
            return [set() for _ in ops]
        assert isinstance(tx, _Tx)
        # Pipelined: a round trip for the batch's claims and one for its lines, not one a line.
        claims = [
            (op.dataset, op.params_hash, r, *fence.claim(op.dataset, op.params_hash, r)) for op in ops for r, _, _ in op.lines
        ]
        landed: set[tuple[str, str, str]] = set()
        if claims:
            tx.cursor.executemany(
                f"""UPDATE work SET state = 'done' WHERE dataset = %s AND params_hash = %s AND record_id = %s AND {CLAIM}
                    RETURNING dataset, params_hash, record_id""",  # noqa: S608 - the claim is fixed text
                claims,
                returning=True,
            )
            while True:
                landed.update(tx.cursor.fetchall())
                if not tx.cursor.nextset():
                    break
        lines = [(op.dataset, r, op.params_hash, sha, line, now, fence.worker)
                 for op in ops for r, line, sha in op.lines if (op.dataset, op.params_hash, r) in landed]  # fmt: skip
        if lines:
            tx.cursor.executemany(
                """INSERT INTO records (dataset, record_id, params_hash, line_sha256, line, written_at, worker)
                   VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (dataset, record_id, params_hash) DO UPDATE
                   SET line_sha256 = excluded.line_sha256, line = excluded.line, written_at = excluded.written_at,
                       worker = excluded.worker""",
                lines,
            )
        return [{r for r, _, _ in op.lines if (op.dataset, op.params_hash, r) in landed} for op in ops]
