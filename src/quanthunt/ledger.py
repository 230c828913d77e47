"""The request ledger: a crash-safe record of every request generation sends and what
it cost, in SQLite (WAL). One row per request key (dataset, record, turn, params hash),
one row per HTTP attempt (append-only history), one row per finished record with the
sha256 of its output line (tamper evidence).

Writes are grouped: ``LedgerWriter`` runs queued operations in one transaction every few
milliseconds (about 8 µs of CPU per row instead of ~90 µs for a commit each), and a
caller that needs durability (e.g. "in flight" must be on disk before the request is
sent) awaits the commit of its operation.

Schema changes are numbered migrations recorded in ``schema_migrations``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from quanthunt.errors import ConfigError

STATES = ("pending", "in_flight", "done", "failed", "unknown_outcome", "quarantined")
"""Request states. ``unknown_outcome``: in flight when a run died, or its reply was lost
after the gateway may have billed it; counted as possibly billed until reconciled."""

OUTCOMES = ("ok", "failed_unbilled", "failed_billed", "unknown", "quarantined", "reconciled")
"""Attempt outcomes: what each HTTP attempt ended as."""

BILLING = ("billed", "possibly_billed", "unbilled")
"""What an attempt cost, as provenance counts it (``billing_of``)."""


def billing_of(outcome: str, cost_usd: float) -> str:
    """``unknown``: the gateway may have charged it; a reconciled attempt is billed when the
    gateway's generation record shows a charge."""
    if outcome == "unknown":
        return "possibly_billed"
    if outcome == "failed_unbilled" or (outcome == "reconciled" and not cost_usd):
        return "unbilled"
    return "billed"


MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE requests (
        dataset TEXT NOT NULL,
        record_id TEXT NOT NULL,
        turn INTEGER NOT NULL,
        params_hash TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending','in_flight','done','failed','unknown_outcome','quarantined')),
        attempts INTEGER NOT NULL DEFAULT 0,
        reserved_usd REAL NOT NULL DEFAULT 0,
        settled_usd REAL NOT NULL DEFAULT 0,
        provider TEXT,
        generation_id TEXT,
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        reply TEXT,
        last_error TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (dataset, record_id, turn, params_hash)
    );
    CREATE TABLE attempts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        dataset TEXT NOT NULL,
        record_id TEXT NOT NULL,
        turn INTEGER NOT NULL,
        params_hash TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        outcome TEXT CHECK (outcome IS NULL OR outcome IN
            ('ok','failed_unbilled','failed_billed','unknown','quarantined','reconciled')),
        http_status INTEGER,
        error_kind TEXT,
        provider TEXT,
        generation_id TEXT,
        reserved_usd REAL NOT NULL,
        cost_usd REAL NOT NULL DEFAULT 0,
        prompt_tokens INTEGER,
        completion_tokens INTEGER
    );
    CREATE INDEX attempts_by_key ON attempts (dataset, record_id, turn, params_hash);
    CREATE INDEX attempts_by_run ON attempts (run_id);
    CREATE TABLE records (
        dataset TEXT NOT NULL,
        record_id TEXT NOT NULL,
        params_hash TEXT NOT NULL,
        line_sha256 TEXT NOT NULL,
        line TEXT NOT NULL,
        written_at REAL NOT NULL,
        PRIMARY KEY (dataset, record_id, params_hash)
    );
    """,
    """
    CREATE TABLE monitors (
        verification_run_id TEXT NOT NULL,
        dataset TEXT NOT NULL,
        tag TEXT NOT NULL,
        served INTEGER NOT NULL,
        state TEXT NOT NULL,
        stopped INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL,
        PRIMARY KEY (verification_run_id, dataset, tag)
    );
    CREATE TABLE monitor_path (
        verification_run_id TEXT NOT NULL,
        dataset TEXT NOT NULL,
        tag TEXT NOT NULL,
        idx INTEGER NOT NULL,
        e_value REAL NOT NULL,
        PRIMARY KEY (verification_run_id, dataset, tag, idx)
    );
    """,
)
"""Numbered migrations: 1 the request ledger, 2 the generate stage's monitors (one
provider's monitor state per verification and dataset, see ``quanthunt.monitor``)."""


@dataclass(frozen=True)
class RequestKey:
    dataset: str
    record_id: str
    turn: int
    params_hash: str

    def tuple(self) -> tuple[str, str, int, str]:
        return (self.dataset, self.record_id, self.turn, self.params_hash)


@dataclass(frozen=True)
class Spend:
    """What the ledger knows was spent (``settled_usd``) and what may have been
    (``unknown_usd``: reservations of attempts whose outcome is unknown)."""

    settled_usd: float
    unknown_usd: float
    attempts: int
    unknown_attempts: int


class Ledger:
    """The ledger file. Reads run directly; writes go through ``LedgerWriter`` (async)
    or ``transaction()`` (sync, for recovery and tests)."""

    def __init__(self, path: Path) -> None:
        self.path = path
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
        for version, script in enumerate(MIGRATIONS, start=1):
            if version in applied:
                continue
            with self.transaction():
                for statement in filter(str.strip, script.split(";")):
                    self.db.execute(statement)
                self.db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- operations (run inside a transaction) --------------------------------------------

    def op_start(self, key: RequestKey, *, run_id: str, reserved_usd: float) -> int:
        """The request is about to be sent: ``in_flight``, one more attempt. Returns the
        attempt's row id."""
        now = time.time()
        (attempt,) = self.db.execute(
            """INSERT INTO requests (dataset, record_id, turn, params_hash, state, attempts, reserved_usd, created_at, updated_at)
               VALUES (?, ?, ?, ?, 'in_flight', 1, ?, ?, ?)
               ON CONFLICT DO UPDATE SET state='in_flight', attempts=attempts+1, reserved_usd=excluded.reserved_usd,
                                         updated_at=excluded.updated_at
               RETURNING attempts""",
            (*key.tuple(), reserved_usd, now, now),
        ).fetchone()
        cursor = self.db.execute(
            """INSERT INTO attempts (dataset, record_id, turn, params_hash, attempt, run_id, started_at, reserved_usd)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
            (*key.tuple(), attempt, run_id, now, reserved_usd),
        )
        return int(cursor.lastrowid or 0)

    def op_generation_ids(self, notes: list[tuple[int, str]]) -> None:
        """(attempt id, generation id) pairs learned from response headers."""
        self.db.executemany("UPDATE attempts SET generation_id=? WHERE id=?", [(g, a) for a, g in notes])

    def op_finish(
        self,
        key: RequestKey,
        attempt_id: int,
        *,
        state: str,
        outcome: str,
        cost_usd: float,
        http_status: int | None = None,
        error_kind: str | None = None,
        provider: str | None = None,
        generation_id: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        reply: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        now = time.time()
        self.db.execute(
            """UPDATE attempts SET finished_at=?, outcome=?, http_status=?, error_kind=?, provider=?,
                      generation_id=COALESCE(?, generation_id), cost_usd=?, prompt_tokens=?, completion_tokens=?
               WHERE id=?""",
            (
                now,
                outcome,
                http_status,
                error_kind,
                provider,
                generation_id,
                cost_usd,
                prompt_tokens,
                completion_tokens,
                attempt_id,
            ),
        )
        self.db.execute(
            """UPDATE requests SET state=?, settled_usd=settled_usd+?, reserved_usd=0, provider=COALESCE(?, provider),
                      generation_id=COALESCE(?, generation_id), prompt_tokens=COALESCE(?, prompt_tokens),
                      completion_tokens=COALESCE(?, completion_tokens), reply=COALESCE(?, reply), last_error=?, updated_at=?
               WHERE dataset=? AND record_id=? AND turn=? AND params_hash=?""",
            (state, cost_usd, provider, generation_id, prompt_tokens, completion_tokens,
             orjson.dumps(reply).decode() if reply is not None else None, error, now, *key.tuple()),
        )  # fmt: skip

    def op_records(self, dataset: str, params_hash: str, lines: list[tuple[str, str, str]]) -> None:
        """Mark records written: (record id, line, line sha256) each."""
        now = time.time()
        self.db.executemany(
            "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?)",
            [(dataset, record_id, params_hash, sha, line, now) for record_id, line, sha in lines],
        )

    def op_monitor(
        self, verification_run_id: str, dataset: str, tag: str, *, served: int, state: dict[str, Any] | None = None,
        points: Sequence[tuple[int, float]] = (),
    ) -> None:  # fmt: skip
        """Save a provider's monitor: its count of monitored replies, its state when given
        (``ProviderMonitor.state()``; the path goes to ``monitor_path``, ``points`` at a time)."""
        key = (verification_run_id, dataset, tag)
        now = time.time()
        if state is None:
            self.db.execute(
                """INSERT INTO monitors VALUES (?, ?, ?, ?, '{}', 0, ?)
                   ON CONFLICT DO UPDATE SET served=excluded.served, updated_at=excluded.updated_at""",
                (*key, served, now),
            )
        else:
            body = orjson.dumps({k: v for k, v in state.items() if k != "path"}).decode()
            self.db.execute(
                """INSERT INTO monitors VALUES (?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT DO UPDATE SET served=excluded.served, state=excluded.state, stopped=excluded.stopped,
                                             updated_at=excluded.updated_at""",
                (*key, served, body, state.get("stopped") is not None, now),
            )
        self.db.executemany("INSERT OR REPLACE INTO monitor_path VALUES (?, ?, ?, ?, ?)", [(*key, i, e) for i, e in points])

    # -- reads and recovery ---------------------------------------------------------------

    def monitor_states(self, verification_run_id: str) -> dict[tuple[str, str], dict[str, Any]]:
        """(dataset, tag) → saved monitor state with its path, for every dataset of one
        verification (as ``ProviderMonitor.restore`` takes it; a monitor whose replies were
        all still being scored has only ``served``, ``stopped`` and an empty path)."""
        rows = self.db.execute(
            "SELECT dataset, tag, served, state FROM monitors WHERE verification_run_id=?",
            (verification_run_id,),
        )
        states = {
            (dataset, tag): {"stopped": None} | json.loads(state) | {"served": served, "path": []}
            for dataset, tag, served, state in rows
        }
        points = self.db.execute(
            "SELECT dataset, tag, idx, e_value FROM monitor_path WHERE verification_run_id=? ORDER BY idx",
            (verification_run_id,),
        )
        for dataset, tag, index, e_value in points:
            if (dataset, tag) in states:
                states[dataset, tag]["path"].append([index, e_value])
        return states

    def done_turns(self, dataset: str, params_hash: str) -> dict[tuple[str, int], dict[str, Any]]:
        """Replies of the finished turns of records not written yet, by (record id, turn):
        what a resumed run reuses instead of asking again (written records are skipped
        whole, so their replies stay on disk)."""
        rows = self.db.execute(
            """SELECT record_id, turn, reply FROM requests WHERE dataset=? AND params_hash=? AND state='done'
                      AND record_id NOT IN (SELECT record_id FROM records WHERE dataset=? AND params_hash=?)""",
            (dataset, params_hash, dataset, params_hash),
        )
        return {(r, t): json.loads(reply) for r, t, reply in rows if reply}

    def done_records(self, dataset: str, params_hash: str) -> dict[str, tuple[str, str]]:
        """record id → (line sha256, line) for every record written."""
        rows = self.db.execute(
            "SELECT record_id, line_sha256, line FROM records WHERE dataset=? AND params_hash=?", (dataset, params_hash)
        )
        return {r: (sha, line) for r, sha, line in rows}

    def recover(self, dataset: str) -> int:
        """Requests left ``in_flight`` by a run that died become ``unknown_outcome`` (their
        attempts: ``unknown``, possibly billed). Returns how many."""
        with self.transaction():
            self.db.execute(
                "UPDATE attempts SET outcome='unknown', finished_at=? WHERE dataset=? AND outcome IS NULL", (time.time(), dataset)
            )
            cursor = self.db.execute(
                "UPDATE requests SET state='unknown_outcome' WHERE dataset=? AND state='in_flight'", (dataset,)
            )
            return cursor.rowcount

    def unknown_with_generation_id(self, dataset: str) -> list[tuple[int, str]]:
        rows = self.db.execute(
            "SELECT id, generation_id FROM attempts WHERE dataset=? AND outcome='unknown' AND generation_id IS NOT NULL",
            (dataset,),
        )
        return [(int(i), str(g)) for i, g in rows]

    def reconcile(self, attempt_id: int, cost_usd: float) -> None:
        """An unknown attempt's charge, learned from the gateway's generation record."""
        with self.transaction():
            row = self.db.execute(
                "SELECT dataset, record_id, turn, params_hash FROM attempts WHERE id=?", (attempt_id,)
            ).fetchone()
            self.db.execute("UPDATE attempts SET outcome='reconciled', cost_usd=? WHERE id=?", (cost_usd, attempt_id))
            self.db.execute(
                "UPDATE requests SET settled_usd=settled_usd+? WHERE dataset=? AND record_id=? AND turn=? AND params_hash=?",
                (cost_usd, *row),
            )

    def spend(self, *, dataset: str | None = None, run_id: str | None = None) -> Spend:
        where, args = [], []
        if dataset is not None:
            where.append("dataset=?")
            args.append(dataset)
        if run_id is not None:
            where.append("run_id=?")
            args.append(run_id)
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        settled, unknown, attempts, unknown_n = self.db.execute(
            f"""SELECT COALESCE(SUM(cost_usd), 0),
                       COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN reserved_usd END), 0),
                       COUNT(*), COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN 1 ELSE 0 END), 0)
                FROM attempts {clause}""",  # noqa: S608 - the clause is built from fixed column names
            args,
        ).fetchone()
        return Spend(float(settled), float(unknown), int(attempts), int(unknown_n))

    def output_tokens(self, dataset: str, params_hash: str) -> int:
        row = self.db.execute(
            "SELECT COALESCE(SUM(completion_tokens), 0) FROM requests WHERE dataset=? AND params_hash=? AND state='done'",
            (dataset, params_hash),
        ).fetchone()
        return int(row[0])

    def record_costs(self, dataset: str, params_hash: str) -> dict[str, float]:
        """Settled spend per record (all attempts of all its turns, failed ones included)."""
        rows = self.db.execute(
            "SELECT record_id, SUM(cost_usd) FROM attempts WHERE dataset=? AND params_hash=? GROUP BY record_id",
            (dataset, params_hash),
        )
        return {r: float(c) for r, c in rows}

    def unwritten_record_costs(self, dataset: str, params_hash: str) -> dict[str, float]:
        """Settled spend so far of records that have attempts but are not written yet (a
        resumed run adds its own attempts' costs to these)."""
        rows = self.db.execute(
            """SELECT record_id, SUM(cost_usd) FROM attempts WHERE dataset=? AND params_hash=? AND record_id NOT IN
                      (SELECT record_id FROM records WHERE dataset=? AND params_hash=?)
               GROUP BY record_id""",
            (dataset, params_hash, dataset, params_hash),
        )
        return {r: float(c) for r, c in rows if c}

    def unwritten_attempts(self, dataset: str, params_hash: str) -> dict[tuple[str, int], Counter[str]]:
        """Finished attempts of records not written yet, by (record id, turn) and billing
        (``billing_of``): a resumed run's provenance counts every earlier attempt too."""
        rows = self.db.execute(
            """SELECT record_id, turn, outcome, cost_usd FROM attempts WHERE dataset=? AND params_hash=?
                      AND outcome IS NOT NULL AND record_id NOT IN
                      (SELECT record_id FROM records WHERE dataset=? AND params_hash=?)""",
            (dataset, params_hash, dataset, params_hash),
        )
        counts: dict[tuple[str, int], Counter[str]] = {}
        for record_id, turn, outcome, cost in rows:
            counts.setdefault((record_id, int(turn)), Counter())[billing_of(outcome, cost)] += 1
        return counts

    def state_counts(self, dataset: str) -> dict[str, int]:
        return {
            s: int(n)
            for s, n in self.db.execute("SELECT state, COUNT(*) FROM requests WHERE dataset=? GROUP BY state", (dataset,))
        }


class LedgerWriter:
    """Group commit: operations queued from the event loop run in one transaction per
    ``interval_s``; ``await writer.write(op)`` returns once ``op`` is committed.

    Transactions run on the event loop's thread: a worker thread was measured slower (GIL
    hand-offs cost more than the SQLite time they overlap), and so was committing in the
    turn of the first caller after the interval instead of the writer task's own."""

    def __init__(self, ledger: Ledger, *, interval_s: float = 0.005) -> None:
        self.ledger = ledger
        self.interval_s = interval_s
        self._pending: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._generation_ids: list[tuple[int, str]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.commits = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, op: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue ``op`` (a callable running SQL on the ledger); the future resolves with its
        result after the commit."""
        if self._closed:
            raise RuntimeError("the ledger writer is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wakeup.set()
        return future

    async def write(self, op: Callable[[], Any]) -> Any:
        return await self.submit(op)

    def note_generation_id(self, attempt_id: int, generation_id: str) -> None:
        """Save an attempt's generation id with the next commit (nobody waits for it)."""
        self._generation_ids.append((attempt_id, generation_id))
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.interval_s and not self._closed:
                await asyncio.sleep(self.interval_s)
            if self._pending or self._generation_ids:
                self._commit()
            if self._closed and not self._pending:
                return

    def _commit(self) -> None:
        """Everything queued, in one transaction; then resolve the callers' futures."""
        batch, self._pending = self._pending, []
        notes, self._generation_ids = self._generation_ids, []
        try:
            with self.ledger.transaction():
                if notes:
                    self.ledger.op_generation_ids(notes)
                results = [op() for op, _ in batch]
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.commits += 1
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def close(self) -> None:
        """Commit everything queued, then stop."""
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._pending or self._generation_ids:
            self._commit()
