"""The request ledger: a crash-safe record of every request generation sends and what
it cost. One row per request key (dataset, record, turn, params hash), one row per HTTP
attempt (append-only history), one row per finished record with the sha256 of its output
line (tamper evidence), the generate stage's monitors, the records it set aside to make
again (``ReplaceRecords``, ``replaced``), and the verify stage's paid probe replies
(``SaveProbeReply``, ``paid_probe_replies``).

One interface, two backends, chosen by URL (``open_ledger``): SQLite (WAL) in a local
file, the default (``quanthunt.ledger_sqlite``), and PostgreSQL, which many hosts can
share (``quanthunt.ledger_postgres``). Writes are operations (``StartAttempt``,
``FinishAttempt``, ``WriteRecords``, ``SaveMonitor``, ``NoteGenerationIds``,
``SaveProbeReply``, ``ReplaceRecords``) that a backend applies in one transaction per
batch (``Ledger.commit``).

Writes are grouped: ``LedgerWriter`` commits the queued operations in one transaction
every few milliseconds (on SQLite about 8 µs of CPU per row instead of ~90 µs for a
commit each), and a caller that needs durability (e.g. "in flight" must be stored before
the request is sent) awaits the commit of its operation.

Schema changes are named migrations, each backend's own, recorded in ``schema_migrations``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import orjson

from quanthunt.errors import ConfigError
from quanthunt.urls import check_ledger_url

STATES = ("pending", "in_flight", "done", "failed", "unknown_outcome", "quarantined")
"""Request states. ``unknown_outcome``: in flight when a run died, or its reply was lost
after the gateway may have billed it; counted as possibly billed until reconciled."""

OUTCOMES = ("ok", "failed_unbilled", "failed_billed", "unknown", "quarantined", "reconciled")
"""Attempt outcomes: what each HTTP attempt ended as."""

BILLING = ("billed", "possibly_billed", "unbilled")
"""What an attempt cost, as provenance counts it (``billing_of``)."""

URL_VARIABLE = "QUANTHUNT_LEDGER_URL"
"""The ledger's URL when set, before ``ledger.url`` in params: where a password may go."""


def billing_of(outcome: str, cost_usd: float) -> str:
    """``unknown``: the gateway may have charged it; a reconciled attempt is billed when the
    gateway's generation record shows a charge."""
    if outcome == "unknown":
        return "possibly_billed"
    if outcome == "failed_unbilled" or (outcome == "reconciled" and not cost_usd):
        return "unbilled"
    return "billed"


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


class Earlier(NamedTuple):
    """What earlier runs (or earlier owners) of some records left: the replies of their
    finished turns, their settled cost, and their attempts by billing."""

    turns: dict[tuple[str, int], dict[str, Any]]
    costs: dict[str, float]
    attempts: dict[tuple[str, int], Counter[str]]


# -- write operations ----------------------------------------------------------------------


@dataclass(frozen=True)
class StartAttempt:
    """The request is about to be sent: ``in_flight``, one more attempt. Its result is the
    attempt's id."""

    key: RequestKey
    run_id: str
    reserved_usd: float


@dataclass(frozen=True)
class FinishAttempt:
    """An attempt ended: its outcome and cost, and the request's new state (with the reply
    when it is ``done``)."""

    key: RequestKey
    attempt_id: int
    state: str
    outcome: str
    cost_usd: float
    http_status: int | None = None
    error_kind: str | None = None
    provider: str | None = None
    generation_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reply: dict[str, Any] | None = None
    error: str | None = None

    def attempt_row(self, now: float) -> tuple[Any, ...]:
        """The values of ``FINISH[0]``, in its order."""
        return (now, self.outcome, self.http_status, self.error_kind, self.provider, self.generation_id, self.cost_usd,
                self.prompt_tokens, self.completion_tokens, self.attempt_id)  # fmt: skip

    def request_row(self, now: float) -> tuple[Any, ...]:
        """The values of ``FINISH[1]``, in its order."""
        reply = orjson.dumps(self.reply).decode() if self.reply is not None else None
        return (self.state, self.cost_usd, self.provider, self.generation_id, self.prompt_tokens,
                self.completion_tokens, reply, self.error, now, *self.key.tuple())  # fmt: skip


@dataclass(frozen=True)
class WriteRecords:
    """Records written to the output: (record id, line, line sha256) each."""

    dataset: str
    params_hash: str
    lines: Sequence[tuple[str, str, str]]


@dataclass(frozen=True)
class SaveMonitor:
    """A provider's monitor: its count of monitored replies, and its state when given
    (``ProviderMonitor.state()``; the path goes to ``monitor_path``, ``points`` at a time)."""

    verification_run_id: str
    dataset: str
    tag: str
    served: int
    state: dict[str, Any] | None = None
    points: Sequence[tuple[int, float]] = ()


@dataclass(frozen=True)
class NoteGenerationIds:
    """(attempt id, generation id) pairs learned from response headers."""

    notes: Sequence[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class SaveProbeReply:
    """A probe reply verify paid for, keyed by the sha256 of the request that bought it
    (``quanthunt.paid_replies``)."""

    request_sha256: str
    tag: str
    probe_id: str
    reply: str
    cost_usd: float
    run_id: str


@dataclass(frozen=True)
class ReplaceRecords:
    """Set written records aside to make them again (``quanthunt.refill``): each line moves
    to ``replaced_records`` (kept, never deleted), and its turns from ``from_turn`` on are
    no longer done (``quarantined``: their replies are not reused); the turns before it
    stay done, so a resumed run reuses them."""

    dataset: str
    params_hash: str
    records: Sequence[tuple[str, int, str]]
    """(record id, first turn to make again, why) each."""


Operation = StartAttempt | FinishAttempt | WriteRecords | SaveMonitor | NoteGenerationIds | SaveProbeReply | ReplaceRecords
KINDS: tuple[type, ...] = (
    NoteGenerationIds, StartAttempt, FinishAttempt, WriteRecords, SaveMonitor, SaveProbeReply, ReplaceRecords,
)  # fmt: skip
"""The order in which a commit applies each kind's batch."""


class Transaction(abc.ABC):
    """One transaction's statements, with ``?`` placeholders whatever the backend."""

    @abc.abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement; its rows (none for a statement that returns none)."""

    @abc.abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    @property
    @abc.abstractmethod
    def rowcount(self) -> int:
        """Rows the last ``execute`` changed."""


FINISH = (
    """UPDATE attempts SET finished_at=?, outcome=?, http_status=?, error_kind=?, provider=?,
              generation_id=COALESCE(?, generation_id), cost_usd=?, prompt_tokens=?, completion_tokens=?
       WHERE id=?""",
    """UPDATE requests SET state=?, settled_usd=settled_usd+?, reserved_usd=0, provider=COALESCE(?, provider),
              generation_id=COALESCE(?, generation_id), prompt_tokens=COALESCE(?, prompt_tokens),
              completion_tokens=COALESCE(?, completion_tokens), reply=COALESCE(?, reply), last_error=?, updated_at=?
       WHERE dataset=? AND record_id=? AND turn=? AND params_hash=?""",
)
"""An attempt's end, then its request's (``FinishAttempt`` gives the rows)."""

UNWRITTEN = "record_id NOT IN (SELECT record_id FROM records WHERE dataset=? AND params_hash=?)"
"""Records not written yet (the ledger has no line for them)."""


class Ledger(abc.ABC):
    """The ledger's interface. Reads run directly; writes are operations committed in
    batches (``commit``: through ``LedgerWriter`` when async, directly for recovery and
    tests). The SQL is shared; a backend supplies connections, transactions, migrations
    and the one statement the two databases cannot share (``_start``)."""

    where: str
    """The ledger as messages name it (a path, or a URL without its password)."""
    threaded: ClassVar[bool] = False
    """Whether ``LedgerWriter`` runs commits on a thread: true when a commit waits on a
    server (a thread lets the event loop go on); false for SQLite, whose commits were
    measured faster on the loop's own thread (GIL hand-offs cost more than they overlap)."""

    # -- the backend's part -----------------------------------------------------------------

    @abc.abstractmethod
    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """A read outside any transaction (``?`` placeholders)."""

    @abc.abstractmethod
    def transaction(self) -> contextlib.AbstractContextManager[Transaction]:
        """One transaction: committed when the block ends, rolled back when it raises."""

    @abc.abstractmethod
    def _start(self, tx: Transaction, ops: Sequence[StartAttempt]) -> list[int | None]:
        """Mark the requests in flight and insert their attempts; the attempts' ids (None:
        refused by a fence, see ``quanthunt.shared``)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- writes ------------------------------------------------------------------------------

    def commit(self, ops: Sequence[Operation]) -> list[Any]:
        """Apply ``ops`` in one transaction, each kind as one batch (``KINDS`` order); one
        result each, in ``ops``' order (``StartAttempt``: the attempt's id, or None when a
        fenced ledger refused it; ``WriteRecords`` on a fenced ledger: the ids written;
        otherwise None).

        Operations queued together never depend on each other (a caller awaits the commit
        an operation needs: a reply's finish waits for its start, a record's line for its
        turns' finishes), so grouping them by kind is safe, and it is what makes a batch
        cheap: interleaved one by one, a server backend paid a round trip per operation
        (measured: ~1 ms each, which held four workers to ~450 requests/s)."""
        results: list[Any] = [None] * len(ops)
        indexed = sorted(enumerate(ops), key=lambda item: KINDS.index(type(item[1])))
        with self.transaction() as tx:
            self._begin(tx)
            for kind, run in groupby(indexed, key=lambda item: type(item[1])):
                batch = list(run)
                for (index, _), result in zip(batch, self._apply(tx, kind, [op for _, op in batch]), strict=True):
                    results[index] = result
        return results

    def _begin(self, tx: Transaction) -> None:  # noqa: B027 - a hook: nothing to check on one host
        """What a backend checks first in every commit (a shared ledger: its fence)."""

    def write(self, op: Operation) -> Any:
        """One operation, committed now (recovery, adoption and tests)."""
        return self.commit([op])[0]

    def _apply(self, tx: Transaction, kind: type, ops: list[Any]) -> list[Any]:
        """One batch of operations of one kind; a result each."""
        now = time.time()
        if kind is StartAttempt:
            return self._start(tx, ops)
        if kind is FinishAttempt:
            tx.executemany(FINISH[0], [op.attempt_row(now) for op in ops])
            tx.executemany(FINISH[1], [op.request_row(now) for op in ops])
        elif kind is WriteRecords:
            tx.executemany(
                """INSERT INTO records VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (dataset, record_id, params_hash)
                   DO UPDATE SET line_sha256=excluded.line_sha256, line=excluded.line, written_at=excluded.written_at""",
                [(op.dataset, record_id, op.params_hash, sha, line, now) for op in ops for record_id, line, sha in op.lines],
            )
        elif kind is SaveMonitor:
            for op in ops:
                self._save_monitor(tx, op, now)
        elif kind is NoteGenerationIds:
            tx.executemany("UPDATE attempts SET generation_id=? WHERE id=?", [(g, a) for op in ops for a, g in op.notes])
        elif kind is ReplaceRecords:
            for op in ops:
                self._replace_records(tx, op, now)
        elif kind is SaveProbeReply:
            tx.executemany(
                """INSERT INTO probe_replies VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_sha256)
                   DO UPDATE SET reply=excluded.reply, cost_usd=excluded.cost_usd, run_id=excluded.run_id,
                                 created_at=excluded.created_at""",
                [(op.request_sha256, op.tag, op.probe_id, op.reply, op.cost_usd, op.run_id, now) for op in ops],
            )
        return [None] * len(ops)

    @staticmethod
    def _replace_records(tx: Transaction, op: ReplaceRecords, now: float) -> None:
        for record_id, from_turn, why in op.records:
            key = (op.dataset, record_id, op.params_hash)
            tx.execute(
                """INSERT INTO replaced_records
                   SELECT dataset, record_id, params_hash, line_sha256, line, ?, ?, ? FROM records
                   WHERE dataset=? AND record_id=? AND params_hash=?
                   ON CONFLICT (dataset, record_id, params_hash, line_sha256) DO NOTHING""",
                (from_turn, why, now, *key),
            )
            tx.execute("DELETE FROM records WHERE dataset=? AND record_id=? AND params_hash=?", key)
            tx.execute(
                """UPDATE requests SET state='quarantined', updated_at=?
                   WHERE dataset=? AND record_id=? AND params_hash=? AND turn>=? AND state='done'""",
                (now, *key, from_turn),
            )

    @staticmethod
    def _save_monitor(tx: Transaction, op: SaveMonitor, now: float) -> None:
        key = (op.verification_run_id, op.dataset, op.tag)
        if op.state is None:
            tx.execute(
                """INSERT INTO monitors VALUES (?, ?, ?, ?, '{}', 0, ?)
                   ON CONFLICT (verification_run_id, dataset, tag)
                   DO UPDATE SET served=excluded.served, updated_at=excluded.updated_at""",
                (*key, op.served, now),
            )
        else:
            body = orjson.dumps({k: v for k, v in op.state.items() if k != "path"}).decode()
            tx.execute(
                """INSERT INTO monitors VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (verification_run_id, dataset, tag)
                   DO UPDATE SET served=excluded.served, state=excluded.state, stopped=excluded.stopped,
                                 updated_at=excluded.updated_at""",
                (*key, op.served, body, int(op.state.get("stopped") is not None), now),
            )
        tx.executemany(
            """INSERT INTO monitor_path VALUES (?, ?, ?, ?, ?) ON CONFLICT (verification_run_id, dataset, tag, idx)
               DO UPDATE SET e_value=excluded.e_value""",
            [(*key, i, e) for i, e in op.points],
        )

    # -- reads and recovery ------------------------------------------------------------------

    def monitor_states(self, verification_run_id: str) -> dict[tuple[str, str], dict[str, Any]]:
        """(dataset, tag) → saved monitor state with its path, for every dataset of one
        verification (as ``ProviderMonitor.restore`` takes it; a monitor whose replies were
        all still being scored has only ``served``, ``stopped`` and an empty path)."""
        rows = self.query("SELECT dataset, tag, served, state FROM monitors WHERE verification_run_id=?", (verification_run_id,))
        states = {
            (dataset, tag): {"stopped": None} | json.loads(state) | {"served": served, "path": []}
            for dataset, tag, served, state in rows
        }
        points = self.query(
            "SELECT dataset, tag, idx, e_value FROM monitor_path WHERE verification_run_id=? ORDER BY idx",
            (verification_run_id,),
        )
        for dataset, tag, index, e_value in points:
            if (dataset, tag) in states:
                states[dataset, tag]["path"].append([index, e_value])
        return states

    def paid_probe_replies(self, since: float) -> dict[str, tuple[str, float, str, float]]:
        """request sha256 → (reply, cost, run id, bought at) of every probe reply bought at
        or after ``since`` (a Unix time)."""
        rows = self.query(
            "SELECT request_sha256, reply, cost_usd, run_id, created_at FROM probe_replies WHERE created_at >= ?", (since,)
        )
        return {key: (reply, float(cost), run_id, float(at)) for key, reply, cost, run_id, at in rows}

    def replaced(self, dataset: str, params_hash: str) -> list[tuple[str, str, int, str, float]]:
        """(record id, line, from turn, why, when) of every record set aside to make again,
        oldest first."""
        rows = self.query(
            """SELECT record_id, line, from_turn, why, replaced_at FROM replaced_records
               WHERE dataset=? AND params_hash=? ORDER BY replaced_at, record_id""",
            (dataset, params_hash),
        )
        return [(r, line, int(turn), why, float(at)) for r, line, turn, why, at in rows]

    def done_turns(self, dataset: str, params_hash: str) -> dict[tuple[str, int], dict[str, Any]]:
        """Replies of the finished turns of records not written yet, by (record id, turn):
        what a resumed run reuses instead of asking again (written records are skipped
        whole, so their replies stay on disk)."""
        rows = self.query(
            f"SELECT record_id, turn, reply FROM requests WHERE dataset=? AND params_hash=? AND state='done' AND {UNWRITTEN}",  # noqa: S608 - fixed text
            (dataset, params_hash, dataset, params_hash),
        )
        return {(r, t): json.loads(reply) for r, t, reply in rows if reply}

    def done_records(self, dataset: str, params_hash: str) -> dict[str, tuple[str, str]]:
        """record id → (line sha256, line) for every record written."""
        rows = self.query(
            "SELECT record_id, line_sha256, line FROM records WHERE dataset=? AND params_hash=?", (dataset, params_hash)
        )
        return {r: (sha, line) for r, sha, line in rows}

    def recover(self, dataset: str) -> int:
        """Requests left ``in_flight`` by a run that died become ``unknown_outcome`` (their
        attempts: ``unknown``, possibly billed). Returns how many."""
        with self.transaction() as tx:
            tx.execute(
                "UPDATE attempts SET outcome='unknown', finished_at=? WHERE dataset=? AND outcome IS NULL", (time.time(), dataset)
            )
            tx.execute("UPDATE requests SET state='unknown_outcome' WHERE dataset=? AND state='in_flight'", (dataset,))
            return tx.rowcount

    def unknown_with_generation_id(self, dataset: str) -> list[tuple[int, str]]:
        rows = self.query(
            "SELECT id, generation_id FROM attempts WHERE dataset=? AND outcome='unknown' AND generation_id IS NOT NULL",
            (dataset,),
        )
        return [(int(i), str(g)) for i, g in rows]

    def reconcile(self, attempt_id: int, cost_usd: float) -> None:
        """An unknown attempt's charge, learned from the gateway's generation record."""
        with self.transaction() as tx:
            (row,) = tx.execute("SELECT dataset, record_id, turn, params_hash FROM attempts WHERE id=?", (attempt_id,))
            tx.execute("UPDATE attempts SET outcome='reconciled', cost_usd=? WHERE id=?", (cost_usd, attempt_id))
            tx.execute(
                "UPDATE requests SET settled_usd=settled_usd+? WHERE dataset=? AND record_id=? AND turn=? AND params_hash=?",
                (cost_usd, *row),
            )

    def spend(self, *, dataset: str | None = None, run_id: str | None = None, params_hash: str | None = None) -> Spend:
        where, args = [], []
        if dataset is not None:
            where.append("dataset=?")
            args.append(dataset)
        if params_hash is not None:
            where.append("params_hash=?")
            args.append(params_hash)
        if run_id is not None:
            where.append("run_id=?")
            args.append(run_id)
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        ((settled, unknown, attempts, unknown_n),) = self.query(
            f"""SELECT COALESCE(SUM(cost_usd), 0),
                       COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN reserved_usd END), 0),
                       COUNT(*), COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN 1 ELSE 0 END), 0)
                FROM attempts {clause}""",  # noqa: S608 - the clause is built from fixed column names
            args,
        )
        return Spend(float(settled), float(unknown), int(attempts), int(unknown_n))

    def output_tokens(self, dataset: str, params_hash: str) -> int:
        ((tokens,),) = self.query(
            "SELECT COALESCE(SUM(completion_tokens), 0) FROM requests WHERE dataset=? AND params_hash=? AND state='done'",
            (dataset, params_hash),
        )
        return int(tokens)

    def record_costs(self, dataset: str, params_hash: str) -> dict[str, float]:
        """Settled spend per record (all attempts of all its turns, failed ones included)."""
        rows = self.query(
            "SELECT record_id, SUM(cost_usd) FROM attempts WHERE dataset=? AND params_hash=? GROUP BY record_id",
            (dataset, params_hash),
        )
        return {r: float(c) for r, c in rows}

    def unwritten_record_costs(self, dataset: str, params_hash: str) -> dict[str, float]:
        """Settled spend so far of records that have attempts but are not written yet (a
        resumed run adds its own attempts' costs to these)."""
        rows = self.query(
            f"SELECT record_id, SUM(cost_usd) FROM attempts WHERE dataset=? AND params_hash=? AND {UNWRITTEN} GROUP BY record_id",  # noqa: S608 - fixed text
            (dataset, params_hash, dataset, params_hash),
        )
        return {r: float(c) for r, c in rows if c}

    def unwritten_attempts(self, dataset: str, params_hash: str) -> dict[tuple[str, int], Counter[str]]:
        """Finished attempts of records not written yet, by (record id, turn) and billing
        (``billing_of``): a resumed run's provenance counts every earlier attempt too."""
        rows = self.query(
            f"""SELECT record_id, turn, outcome, cost_usd FROM attempts WHERE dataset=? AND params_hash=?
                       AND outcome IS NOT NULL AND {UNWRITTEN}""",  # noqa: S608 - fixed text
            (dataset, params_hash, dataset, params_hash),
        )
        counts: dict[tuple[str, int], Counter[str]] = {}
        for record_id, turn, outcome, cost in rows:
            counts.setdefault((record_id, int(turn)), Counter())[billing_of(outcome, cost)] += 1
        return counts

    def state_counts(self, dataset: str) -> dict[str, int]:
        rows = self.query("SELECT state, COUNT(*) FROM requests WHERE dataset=? GROUP BY state", (dataset,))
        return {s: int(n) for s, n in rows}


def configured_url(params_url: str) -> tuple[str, str]:
    """The ledger's URL and where it came from: ``$QUANTHUNT_LEDGER_URL`` when set (a
    password may be in it), else ``ledger.url`` in params."""
    if url := os.environ.get(URL_VARIABLE, ""):
        try:
            return check_ledger_url(url), f"${URL_VARIABLE}"
        except ValueError as exc:
            raise ConfigError(f"${URL_VARIABLE}: {exc}") from None
    return params_url, "ledger.url"


def open_ledger(params_url: str, root: Path) -> Ledger:
    """The configured ledger (``configured_url``); a relative SQLite path is under ``root``."""
    url, source = configured_url(params_url)
    scheme, _, rest = url.partition("://")
    if scheme == "sqlite":
        from quanthunt.ledger_sqlite import SqliteLedger

        path = Path(rest[1:])
        return SqliteLedger(path if path.is_absolute() else root / path)
    from quanthunt.ledger_postgres import PostgresLedger

    return PostgresLedger(url, source=source)


def resolve_batch(futures: Sequence[asyncio.Future[Any]], results: Sequence[Any] | None = None, *,
                  error: BaseException | None = None) -> None:  # fmt: skip
    """Answer the callers of a batch written together: each future with its result (``None``
    when ``results`` is not given), or every one with ``error``. A future its caller has
    cancelled meanwhile is left as it is."""
    outcomes = [None] * len(futures) if results is None else results
    for future, result in zip(futures, outcomes, strict=True):
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class LedgerWriter:
    """Group commit: operations queued from the event loop run in one transaction per
    ``interval_s``; ``await writer.write(op)`` returns once ``op`` is committed.

    On SQLite transactions run on the event loop's thread: a worker thread was measured
    slower (GIL hand-offs cost more than the SQLite time they overlap), and so was
    committing in the turn of the first caller after the interval instead of the writer
    task's own. A server backend (``Ledger.threaded``) commits on a thread, since its
    commits wait on the network; operations queued meanwhile go in the next batch."""

    def __init__(self, ledger: Ledger, *, interval_s: float = 0.005) -> None:
        self.ledger = ledger
        self.interval_s = interval_s
        self._pending: list[tuple[Operation, asyncio.Future[Any]]] = []
        self._generation_ids: list[tuple[int, str]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.commits = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, op: Operation) -> asyncio.Future[Any]:
        """Queue ``op``; the future resolves with its result after the commit."""
        if self._closed:
            raise RuntimeError("the ledger writer is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wakeup.set()
        return future

    async def write(self, op: Operation) -> Any:
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
                await self._commit()
            if self._closed and not self._pending:
                return

    async def _commit(self) -> None:
        """Everything queued, in one transaction; then resolve the callers' futures."""
        batch, self._pending = self._pending, []
        notes, self._generation_ids = self._generation_ids, []
        ops: list[Operation] = [NoteGenerationIds(notes)] if notes else []
        ops += [op for op, _ in batch]
        try:
            if self.ledger.threaded:
                results = await asyncio.to_thread(self.ledger.commit, ops)
            else:
                results = self.ledger.commit(ops)
        except BaseException as exc:
            resolve_batch([future for _, future in batch], error=exc)
            return
        self.commits += 1
        resolve_batch([future for _, future in batch], results[len(ops) - len(batch) :])

    async def close(self) -> None:
        """Commit everything queued, then stop."""
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._pending or self._generation_ids:
            await self._commit()
