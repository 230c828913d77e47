"""Many hosts on one dataset and one team budget, coordinated through a PostgreSQL ledger
(``quanthunt.ledger_postgres``): nothing home-made stands between the hosts but the
database's transactions, row locks and advisory locks.

Roles:

- the **coordinator** is the host running ``dvc repro``: its generate stage ``publish``es
  the job (the team's and the run's budgets, the job itself, the work queue seeded
  idempotently), works as a worker too, reaps dead workers, and exports the records to
  the dataset's file (``export``), so DVC caches it as on one host;
- a **worker** (``quanthunt worker``) needs only the ledger's URL, the API key and
  quanthunt: it joins an open job (``Worker.join``) and claims records from the queue.

What holds, across all hosts together:

- **Spend never exceeds a cap.** Money is spent only out of a budget lease, and a lease is
  granted in one transaction that locks the run's and the team's budget rows and grants
  no more than both have left (their ``CHECK`` constraints say the same). Each host spends
  its lease through its in-memory ``Budget``.
- **No record is written twice, and no late write lands.** A claim is (worker, epoch);
  a record's line lands only under its claim (``ledger_postgres.CLAIM``), and every commit
  of a worker first takes a shared lock on its own row and checks it is not retired
  (``ledger_postgres.ALIVE``): retiring a worker, the only way its claims are taken over,
  updates that row, so a commit and a takeover are ordered.
- **A dead worker's money is accounted.** A worker is presumed dead when its session's
  advisory lock is gone (the process died: its connections closed) or its heartbeat is
  older than ``dead_after_s`` on the server's clock (stopped, partitioned). ``retire``
  then, in one transaction: its in-flight requests become unknown (possibly billed, at
  their reservation), its claims go back to the queue, and its lease is settled from its
  attempts. A worker retires itself the same way when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import TypeAdapter

from quanthunt.errors import ConfigError
from quanthunt.jobs import Job
from quanthunt.ledger import Earlier, LedgerWriter, Transaction, WriteRecords, billing_of
from quanthunt.ledger_postgres import CLAIM, Fence, PostgresLedger
from quanthunt.params import Coordination
from quanthunt.prompts import PromptRecord, Turn
from quanthunt.records import sha256_line

WORKER_LOCKS = 0x7168
"""The advisory-lock space of worker sessions (key 1; key 2 is the worker's id)."""

JOB = TypeAdapter(Job)


@dataclass(frozen=True)
class Published:
    """A job as workers find it: the job, where to send it, and how the hosts keep time."""

    job: Job
    api_url: str
    coordination: Coordination
    request_timeout_s: float
    stop_grace_s: float

    @property
    def budget(self) -> str:
        """The run's budget row (its parent is the team's)."""
        return run_budget(self.job.run_id)


def team_budget(team: str) -> str:
    return f"team:{team}"


def run_budget(run_id: str) -> str:
    return f"run:{run_id}"


def publish(ledger: PostgresLedger, published: Published, records: Iterable[PromptRecord], *, team: str,
            team_cap_usd: float) -> int:  # fmt: skip
    """Open ``job`` for every host: the team's budget (made on first use; its cap must match),
    this run's budget under it, the job, and the work queue (records already done keep their
    state; failed and skipped ones are tried again, as a new run on one host would). Returns
    how many records are left to do."""
    job, team_name, run_name = published.job, team_budget(team), published.budget
    # Made before the transaction, which may run again (PostgresLedger.ride_out).
    queue = [(job.dataset, job.params_hash, r.id, position, orjson.dumps(r.to_json()).decode())
             for position, r in enumerate(records)]  # fmt: skip
    row = orjson.dumps(
        {"job": JOB.dump_python(job, mode="json"), "coordination": published.coordination.model_dump(),
         "api_url": published.api_url, "request_timeout_s": published.request_timeout_s,
         "stop_grace_s": published.stop_grace_s}
    ).decode()  # fmt: skip

    def body(tx: Transaction) -> int:
        tx.execute("INSERT INTO budgets (name, cap_usd) VALUES (?, ?) ON CONFLICT (name) DO NOTHING", (team_name, team_cap_usd))
        ((cap,),) = tx.execute("SELECT cap_usd FROM budgets WHERE name = ?", (team_name,))
        if abs(cap - team_cap_usd) > 1e-9:
            raise ConfigError(
                f"survey.budget.usd: the team budget {team!r} in the ledger ({ledger.where}) has a cap of ${cap:g}, "
                f"params say ${team_cap_usd:g}; make them agree (the ledger's row is budgets.{team_name})"
            )
        tx.execute(
            "INSERT INTO budgets (name, parent, cap_usd) VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING",
            (run_name, team_name, job.max_usd),
        )
        tx.execute(
            """INSERT INTO jobs (dataset, params_hash, run_id, budget, job, api_url) VALUES (?, ?, ?, ?, ?, ?)
               ON CONFLICT (dataset, params_hash) DO UPDATE SET run_id = excluded.run_id, budget = excluded.budget,
                      job = excluded.job, api_url = excluded.api_url, state = 'open', opened_at = now()""",
            (job.dataset, job.params_hash, job.run_id, run_name, row, published.api_url),
        )
        tx.executemany(
            """INSERT INTO work (dataset, params_hash, record_id, position, prompt) VALUES (?, ?, ?, ?, ?)
               ON CONFLICT (dataset, params_hash, record_id) DO NOTHING""",
            queue,
        )
        tx.execute(
            "UPDATE work SET state = 'todo' WHERE dataset = ? AND params_hash = ? AND state IN ('failed', 'skipped')",
            (job.dataset, job.params_hash),
        )
        ((left,),) = tx.execute(
            "SELECT COUNT(*) FROM work WHERE dataset = ? AND params_hash = ? AND state IN ('todo', 'claimed')",
            (job.dataset, job.params_hash),
        )
        return int(left)

    return ledger.transact(body)


def find_job(ledger: PostgresLedger, dataset: str | None = None) -> Published | None:
    """The open job with work left (the oldest, or ``dataset``'s), as published."""
    rows = ledger.query(
        """SELECT j.job FROM jobs j WHERE j.state = 'open' AND (?::text IS NULL OR j.dataset = ?)
                  AND EXISTS (SELECT 1 FROM work w WHERE w.dataset = j.dataset AND w.params_hash = j.params_hash
                                                     AND w.state = 'todo')
           ORDER BY j.opened_at LIMIT 1""",
        (dataset, dataset),
    )
    if not rows:
        return None
    body = orjson.loads(rows[0][0])
    job = JOB.validate_python(body["job"])
    return Published(job, body["api_url"], Coordination.model_validate(body["coordination"]),
                     request_timeout_s=body["request_timeout_s"], stop_grace_s=body["stop_grace_s"])  # fmt: skip


def close_job(ledger: PostgresLedger, dataset: str, params_hash: str) -> None:
    ledger.query("UPDATE jobs SET state = 'closed' WHERE dataset = ? AND params_hash = ? RETURNING 1", (dataset, params_hash))


def work_left(ledger: PostgresLedger, dataset: str, params_hash: str) -> dict[str, int]:
    """The queue's records by state."""
    rows = ledger.query(
        "SELECT state, COUNT(*) FROM work WHERE dataset = ? AND params_hash = ? GROUP BY state", (dataset, params_hash)
    )
    return {state: int(n) for state, n in rows}


def export(ledger: PostgresLedger, dataset: str, params_hash: str) -> list[str]:
    """Every written record's line, in the queue's order (the dataset's order)."""
    rows = ledger.query(
        """SELECT r.line FROM records r JOIN work w USING (dataset, params_hash, record_id)
           WHERE r.dataset = ? AND r.params_hash = ? ORDER BY w.position""",
        (dataset, params_hash),
    )
    return [line for (line,) in rows]


def worker_figures(ledger: PostgresLedger, budget: str) -> list[dict[str, Any]]:
    """What each worker of a run (its budget row) did, as the ledger has it."""
    rows = ledger.query(
        """SELECT w.id, w.host, w.pid, w.retired_why, w.leased_usd,
                  EXTRACT(EPOCH FROM COALESCE(w.retired_at, now()) - w.started_at),
                  COUNT(a.id), COUNT(a.id) FILTER (WHERE a.outcome = 'ok'), COALESCE(SUM(a.cost_usd), 0),
                  (SELECT COUNT(*) FROM records r WHERE r.worker = w.id)
           FROM workers w LEFT JOIN attempts a ON a.worker = w.id WHERE w.budget = ? GROUP BY w.id ORDER BY w.id""",
        (budget,),
    )
    names = ("id", "host", "pid", "ended", "leased_usd", "seconds", "attempts", "requests_ok", "cost_usd", "records")
    return [dict(zip(names, (*row[:4], float(row[4]), float(row[5]), *map(int, row[6:8]), float(row[8]), int(row[9])),
                     strict=True)) for row in rows]  # fmt: skip


def retire(ledger: PostgresLedger, worker: int, why: str) -> bool:
    """End a worker (itself, or one presumed dead) in one transaction: its in-flight
    requests become unknown, its claims go back to the queue, and its lease is settled
    from its attempts (settled cost, and the reservation of every unknown one). False when
    it was already retired."""

    def body(tx: Transaction) -> bool:
        rows = tx.execute(
            """SELECT w.budget, b.parent, w.leased_usd FROM workers w JOIN budgets b ON b.name = w.budget
               WHERE w.id = ? AND w.alive FOR UPDATE OF w""",
            (worker,),
        )
        if not rows:
            return False
        ((budget, parent, leased),) = rows
        tx.execute(
            """UPDATE requests r SET state = 'unknown_outcome' FROM work w
               WHERE w.owner = ? AND w.state = 'claimed' AND r.state = 'in_flight' AND r.dataset = w.dataset
                 AND r.params_hash = w.params_hash AND r.record_id = w.record_id""",
            (worker,),
        )
        tx.execute(
            """UPDATE attempts SET outcome = 'unknown', finished_at = extract(epoch FROM now())
               WHERE worker = ? AND outcome IS NULL""",
            (worker,),
        )
        ((settled, unknown),) = tx.execute(
            """SELECT COALESCE(SUM(cost_usd), 0), COALESCE(SUM(CASE WHEN outcome = 'unknown' THEN reserved_usd END), 0)
               FROM attempts WHERE worker = ?""",
            (worker,),
        )
        tx.execute("UPDATE work SET state = 'todo', owner = NULL WHERE owner = ? AND state = 'claimed'", (worker,))
        tx.execute(
            """UPDATE budgets SET reserved_usd = reserved_usd - ?, settled_usd = settled_usd + ?, unknown_usd = unknown_usd + ?
               WHERE name IN (?, ?)""",
            (leased, settled, unknown, budget, parent),
        )
        tx.execute("UPDATE workers SET alive = false, retired_at = now(), retired_why = ? WHERE id = ?", (why, worker))
        return True

    return ledger.transact(body)


def reap(ledger: PostgresLedger, dataset: str, params_hash: str, coordination: Coordination) -> list[int]:
    """Retire the job's workers presumed dead, and end their sessions (what they send
    later fails, and the fence refuses it anyway). Dead: no session holds the worker's
    advisory lock (the process is gone) and it has missed three heartbeats, or it has not
    beaten for ``dead_after_s`` (stopped, or cut off). Time is the server's, and counts
    from the server's start at the earliest: a restart drops every lock and holds every
    heartbeat back, and the workers that ride it out must not be taken for dead. So a
    missing lock counts only for a worker that has beaten since the server started (its
    heartbeat's session took the lock again): a live worker reaches a restarted server only
    at its next try, and its tries back off up to 1 s (``ledger_postgres.RIDE_OUT_PAUSE_S``),
    longer than three of the tests' 0.3 s heartbeats (a scale-out test saw both its workers
    taken for dead that way); one that died with the server is found by its silence.
    Returns their ids."""
    rows = ledger.query(
        """SELECT w.id, now() - GREATEST(w.heartbeat_at, pg_postmaster_start_time()) > make_interval(secs => ?),
                  now() - w.heartbeat_at > make_interval(secs => ?) AND w.heartbeat_at > pg_postmaster_start_time(),
                  EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                                                     AND l.classid = ? AND l.objid = w.id AND l.objsubid = 2)
           FROM workers w WHERE w.alive AND w.dataset = ? AND w.params_hash = ?""",
        (coordination.dead_after_s, 3 * coordination.heartbeat_s, WORKER_LOCKS, dataset, params_hash),
    )
    dead = [(int(worker), "its session ended" if not locked else "its heartbeat stopped")
            for worker, silent, late, locked in rows if silent or (late and not locked)]  # fmt: skip
    for worker, why in dead:
        ledger.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ?", (application_name(worker),)
        )
        retire(ledger, worker, f"presumed dead: {why}")
    return [worker for worker, _ in dead]


def application_name(worker: int) -> str:
    """How a worker's sessions are named on the server (so a reaper can end them)."""
    return f"quanthunt-worker-{worker}"


class Worker:
    """One host's membership of a job: its claims (the ledger's ``Fence``), its budget
    leases, its heartbeat. Calls that reach the database run on a thread, so a slow or
    partitioned server never stalls the event loop."""

    def __init__(self, ledger: PostgresLedger, published: Published, worker: int) -> None:
        self.ledger, self.published, self.id = ledger, published, worker
        self.job = published.job
        self.coordination = published.coordination
        self.alive = True
        self.leased_usd = 0.0
        self.fenced = 0
        """Records this worker lost to a takeover (its writes were refused)."""
        self.last_error: Exception | None = None
        """Why the last heartbeat failed (the server away: the next beat tries again)."""

    @classmethod
    def register(cls, ledger: PostgresLedger, published: Published) -> Worker:
        """Join ``published`` as a new worker: a row with this host and pid, the session's
        advisory lock (held until the process ends), and the ledger's fence."""
        job = published.job
        ((worker,),) = ledger.query(
            "INSERT INTO workers (host, pid, dataset, params_hash, budget) VALUES (?, ?, ?, ?, ?) RETURNING id",
            (socket.gethostname(), os.getpid(), job.dataset, job.params_hash, published.budget),
        )
        ledger.hold_session_lock(WORKER_LOCKS, int(worker), application_name(int(worker)))
        ledger.fence = Fence(int(worker))
        return cls(ledger, published, int(worker))

    async def heartbeat(self) -> bool:
        """Say this worker is alive; False when it was presumed dead (it must stop)."""
        rows = await asyncio.to_thread(
            self.ledger.query, "UPDATE workers SET heartbeat_at = now() WHERE id = ? AND alive RETURNING id", (self.id,)
        )
        self.alive = bool(rows)
        return self.alive

    async def keep_alive(self, on_dead: Any) -> None:
        """Heartbeat and reap until cancelled; ``on_dead(why)`` when this worker is presumed dead."""
        job = self.job
        while True:
            try:
                if not await self.heartbeat():
                    on_dead("this worker was presumed dead (its claims were taken over)")
                    return
                await asyncio.to_thread(reap, self.ledger, job.dataset, job.params_hash, self.coordination)
            except Exception as exc:
                self.last_error = exc
            await asyncio.sleep(self.coordination.heartbeat_s)

    async def lease(self, worst_usd: float) -> float:
        """More budget: up to ``lease_requests`` worst-case requests, no more than the run's
        and the team's budgets have left. Returns what was granted (0: a cap is reached)."""
        want = worst_usd * self.coordination.lease_requests
        granted = await asyncio.to_thread(self._lease, want)
        self.leased_usd += granted
        return granted

    def _lease(self, want: float) -> float:
        return self.ledger.transact(functools.partial(self._grant, want))

    def _grant(self, want: float, tx: Transaction) -> float:
        """The lease, in the caller's transaction: both budget rows locked in one order
        (so two workers of one run cannot deadlock), the grant no more than either has left."""
        rows = tx.execute(
            """SELECT cap_usd - settled_usd - unknown_usd - reserved_usd FROM budgets
               WHERE name IN (?, (SELECT parent FROM budgets WHERE name = ?)) ORDER BY name FOR UPDATE""",
            (self.published.budget, self.published.budget),
        )
        grant = max(0.0, min([want, *(float(left) for (left,) in rows)]))
        if grant <= 0:
            return 0.0
        tx.execute("UPDATE workers SET leased_usd = leased_usd + ? WHERE id = ? AND alive", (grant, self.id))
        if tx.rowcount != 1:
            return 0.0
        tx.execute(
            """UPDATE budgets SET reserved_usd = reserved_usd + ?
               WHERE name IN (?, (SELECT parent FROM budgets WHERE name = ?))""",
            (grant, self.published.budget, self.published.budget),
        )
        return grant

    async def claim(self) -> list[PromptRecord]:
        """The next records of the queue (up to ``claim``), now this worker's; none when the
        queue is empty or this worker was presumed dead."""
        rows = await asyncio.to_thread(self._claim)
        fence = self.ledger.fence
        assert fence is not None
        records = []
        for record_id, epoch, prompt in rows:
            fence.epochs[self.job.dataset, self.job.params_hash, record_id] = int(epoch)
            body = orjson.loads(prompt)
            records.append(PromptRecord(body["id"], tuple(Turn(**t) for t in body["conversations"])))
        return records

    def _claim(self) -> list[tuple[str, int, str]]:
        job = self.job
        rows = self.ledger.query(
            """UPDATE work SET state = 'claimed', owner = ?, epoch = epoch + 1
                   WHERE (dataset, params_hash, record_id) IN (
                         SELECT dataset, params_hash, record_id FROM work
                         WHERE dataset = ? AND params_hash = ? AND state = 'todo'
                         ORDER BY position LIMIT ? FOR UPDATE SKIP LOCKED)
                     AND EXISTS (SELECT 1 FROM workers WHERE id = ? AND alive)
                   RETURNING record_id, epoch, prompt, position""",
            (self.id, job.dataset, job.params_hash, self.coordination.claim, self.id),
        )
        return [(r, int(e), p) for r, e, p, _ in sorted(rows, key=lambda row: row[3])]

    def resume(self, records: Sequence[PromptRecord]) -> Earlier:
        """What earlier owners of ``records`` finished and spent: done turns, costs, attempts by billing."""
        job, ids = self.job, [r.id for r in records]
        turns = self.ledger.query(
            """SELECT record_id, turn, reply FROM requests
               WHERE dataset = ? AND params_hash = ? AND state = 'done' AND record_id = ANY(?)""",
            (job.dataset, job.params_hash, ids),
        )
        attempts = self.ledger.query(
            """SELECT record_id, turn, outcome, cost_usd FROM attempts WHERE dataset = ? AND params_hash = ?
                      AND outcome IS NOT NULL AND record_id = ANY(?)""",
            (job.dataset, job.params_hash, ids),
        )
        costs: dict[str, float] = {}
        counts: dict[tuple[str, int], Counter[str]] = {}
        for record_id, turn, outcome, cost in attempts:
            costs[record_id] = costs.get(record_id, 0.0) + float(cost)
            counts.setdefault((record_id, int(turn)), Counter())[billing_of(outcome, cost)] += 1
        return Earlier({(r, int(t)): orjson.loads(reply) for r, t, reply in turns if reply}, costs, counts)

    async def end(self, record_id: str, state: str) -> None:
        """A claimed record failed or was skipped: say so in the queue (under the claim)."""
        job = self.job
        fence = self.ledger.fence
        assert fence is not None
        await asyncio.to_thread(
            self.ledger.query,
            f"""UPDATE work SET state = ? WHERE dataset = ? AND params_hash = ? AND record_id = ?
                                                AND {CLAIM.replace("%s", "?")} RETURNING 1""",  # noqa: S608 - fixed text
            (state, job.dataset, job.params_hash, record_id, *fence.claim(job.dataset, job.params_hash, record_id)),
        )

    async def retire(self, why: str) -> None:
        """End this worker: unfinished claims back to the queue, its lease settled."""
        await asyncio.to_thread(retire, self.ledger, self.id, why)


class ClaimSink:
    """A worker's records go to the ledger, not a file: each line is written (with its
    sha256) once its turns' ledger writes have committed, fenced on the claim; the
    coordinator exports them. A line the fence refused is counted, not an error."""

    def __init__(self, worker: Worker, writer: LedgerWriter) -> None:
        self.worker, self.writer = worker, writer
        self.path = f"the ledger's records ({worker.ledger.where})"
        self._outstanding: set[asyncio.Future[None]] = set()

    @property
    def backlog(self) -> int:
        return len(self._outstanding)

    def add(self, record_id: str, line: str, *, after: Iterable[asyncio.Future[Any]] = ()) -> asyncio.Future[None]:
        future = asyncio.ensure_future(self._write(record_id, line, tuple(after)))
        self._outstanding.add(future)
        future.add_done_callback(self._outstanding.discard)
        return future

    async def _write(self, record_id: str, line: str, after: tuple[asyncio.Future[Any], ...]) -> None:
        await asyncio.gather(*after)
        job = self.worker.job
        written = await self.writer.write(WriteRecords(job.dataset, job.params_hash, [(record_id, line, sha256_line(line))]))
        if record_id not in written:
            self.worker.fenced += 1

    def finished(self, record_id: str, state: str) -> None:
        """A record ended without a line (``failed``, ``skipped``)."""
        future = asyncio.ensure_future(self.worker.end(record_id, state))
        self._outstanding.add(future)
        future.add_done_callback(self._outstanding.discard)

    async def drain(self) -> None:
        if self._outstanding:
            await asyncio.gather(*self._outstanding, return_exceptions=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.drain()
