"""Many workers on one shared ledger (a real PostgreSQL server started by the suite): the
published job, budget leases under the run's and the team's caps, claims and their fence,
reaping the dead, and whole runs of several in-process workers (an in-process chat client
in place of HTTP; ``tests/stages/test_scale_out.py`` runs real worker processes)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator

import pytest
from fixtures.postgres import PostgresServer
from test_generation import HASH, FixedCostChat, job, records

from quanthunt.errors import ConfigError
from quanthunt.generation import Engine
from quanthunt.jobs import Job
from quanthunt.ledger import FinishAttempt, LedgerWriter, RequestKey, StartAttempt, WriteRecords
from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.shared import (
    ClaimSink,
    Coordination,
    Published,
    Worker,
    export,
    find_job,
    publish,
    reap,
    retire,
    work_left,
)
from quanthunt.worker_run import claimed

COST = 1e-5
"""What a request costs: below its worst case (a 16-token answer at the test job's prices)."""
FAST = Coordination(heartbeat_s=0.1, dead_after_s=1.0, claim=4, lease_requests=4)


def published(the_job: Job) -> Published:
    return Published(the_job, "http://127.0.0.1:9/api/v1", FAST, request_timeout_s=30.0, stop_grace_s=5.0)


@pytest.fixture
def connect(postgres_url: str) -> Iterator[Callable[[], PostgresLedger]]:
    """Opens ledgers on one fresh database, each with its own sessions as a separate host
    would have (all closed afterwards)."""
    opened: list[PostgresLedger] = []

    def connect() -> PostgresLedger:
        opened.append(PostgresLedger(postgres_url))
        return opened[-1]

    yield connect
    for ledger in opened:
        ledger.close()


def test_a_published_job_reads_back_whole_and_seeding_again_adds_nothing(connect: Callable[[], PostgresLedger]) -> None:
    ledger = connect()
    the_job = job(max_usd=2.0)
    assert publish(ledger, published(the_job), records("a", "b", "c"), team="ml", team_cap_usd=5.0) == 3
    assert publish(ledger, published(the_job), records("a", "b", "c", "d"), team="ml", team_cap_usd=5.0) == 4
    found = find_job(ledger)
    assert found == published(the_job)
    assert work_left(ledger, "chat", HASH) == {"todo": 4}
    assert ledger.query("SELECT name, parent, cap_usd FROM budgets ORDER BY name") == [
        ("run:run", "team:ml", 2.0), ("team:ml", None, 5.0)
    ]  # fmt: skip


def test_a_team_cap_that_disagrees_with_the_ledger_is_refused(connect: Callable[[], PostgresLedger]) -> None:
    ledger = connect()
    publish(ledger, published(job()), records("a"), team="ml", team_cap_usd=5.0)
    other = dataclasses.replace(job(), run_id="another")
    with pytest.raises(ConfigError, match=r"survey\.budget\.usd: the team budget 'ml' .* \$5, params say \$7"):
        publish(ledger, published(other), records("a"), team="ml", team_cap_usd=7.0)


def test_leases_of_two_runs_never_exceed_their_caps_or_the_teams(connect: Callable[[], PostgresLedger]) -> None:
    """Two users with separate runs on one team budget: each run is held to its own cap,
    both together to the team's."""
    first, second = dataclasses.replace(job(max_usd=3.0), run_id="alice"), dataclasses.replace(job(max_usd=3.0), run_id="bob")
    ledger = connect()
    publish(ledger, published(first), records("a"), team="ml", team_cap_usd=4.0)
    publish(ledger, dataclasses.replace(published(second), job=dataclasses.replace(second, dataset="code")), records("a"),
            team="ml", team_cap_usd=4.0)  # fmt: skip
    alice = Worker.register(connect(), published(first))
    bob = Worker.register(connect(), dataclasses.replace(published(second), job=dataclasses.replace(second, dataset="code")))

    async def lease_all() -> list[float]:
        grants: list[float] = []
        for _ in range(6):
            grants += await asyncio.gather(alice.lease(0.25), bob.lease(0.25))
        return grants

    grants = asyncio.run(lease_all())
    assert sum(grants) == pytest.approx(4.0)
    assert alice.leased_usd <= 3.0 + 1e-9 and bob.leased_usd <= 3.0 + 1e-9
    rows = dict(ledger.query("SELECT name, settled_usd + unknown_usd + reserved_usd FROM budgets"))
    assert rows["team:ml"] == pytest.approx(4.0)
    assert rows["run:alice"] + rows["run:bob"] == pytest.approx(4.0)


def test_a_worker_presumed_dead_loses_its_claims_and_cannot_write_after(connect: Callable[[], PostgresLedger]) -> None:
    """The zombie: its claim is taken over, then nothing it starts or writes lands, but the
    cost of an attempt it finishes is kept."""
    ledger = connect()
    publish(ledger, published(job()), records("r"), team="ml", team_cap_usd=5.0)
    zombie = Worker.register(connect(), published(job()))
    (record,) = asyncio.run(zombie.claim())
    key = RequestKey("chat", record.id, 0, HASH)
    started = zombie.ledger.write(StartAttempt(key, "run", 0.5))
    assert started is not None
    assert retire(ledger, zombie.id, "presumed dead: its heartbeat stopped")
    heir = Worker.register(connect(), published(job()))
    assert [r.id for r in asyncio.run(heir.claim())] == ["r"]

    assert zombie.ledger.write(StartAttempt(key, "run", 0.5)) is None
    zombie.ledger.write(FinishAttempt(key, started, state="done", outcome="ok", cost_usd=0.125, reply={"content": "late"}))
    assert zombie.ledger.write(WriteRecords("chat", HASH, [("r", "{}", "0" * 64)])) == set()
    assert asyncio.run(zombie.heartbeat()) is False
    assert ledger.query("SELECT state, reply FROM requests") == [("unknown_outcome", None)]
    assert ledger.query("SELECT outcome, cost_usd FROM attempts") == [("ok", 0.125)]
    assert ledger.done_records("chat", HASH) == {}
    assert heir.ledger.write(StartAttempt(key, "run", 0.5)) is not None


def test_a_worker_whose_process_died_is_reaped_and_its_money_accounted(connect: Callable[[], PostgresLedger]) -> None:
    ledger = connect()
    publish(ledger, published(job()), records("a", "b"), team="ml", team_cap_usd=5.0)
    dying = Worker.register(connect(), published(job()))
    asyncio.run(dying.lease(0.5))
    asyncio.run(dying.claim())
    attempt = dying.ledger.write(StartAttempt(RequestKey("chat", "a", 0, HASH), "run", 0.5))
    paid = dying.ledger.write(StartAttempt(RequestKey("chat", "b", 0, HASH), "run", 0.5))
    dying.ledger.write(FinishAttempt(RequestKey("chat", "b", 0, HASH), paid, state="done", outcome="ok", cost_usd=0.25))
    assert attempt is not None
    assert reap(ledger, "chat", HASH, FAST) == []  # alive: its session holds the lock
    dying.ledger.close()  # what kill -9 does to its sessions
    asyncio.run(asyncio.sleep(2 * FAST.heartbeat_s + 0.1))
    assert reap(ledger, "chat", HASH, FAST) == [dying.id]
    assert work_left(ledger, "chat", HASH) == {"todo": 2}
    assert ledger.state_counts("chat") == {"unknown_outcome": 1, "done": 1}
    budget = ledger.query("SELECT settled_usd, unknown_usd, reserved_usd FROM budgets WHERE name = 'run:run'")
    assert budget == [(0.25, 0.5, pytest.approx(0.0, abs=1e-12))]


def work_in_process(ledger: PostgresLedger, the_published: Published, chat: FixedCostChat) -> tuple[Worker, Engine]:
    """One worker's share, as ``worker_run.work`` runs it but with ``chat`` in place of HTTP."""

    async def scenario() -> tuple[Worker, Engine]:
        worker = Worker.register(ledger, the_published)
        writer = LedgerWriter(ledger, interval_s=0.001)
        writer.start()
        sink = ClaimSink(worker, writer)
        engine = Engine(the_published.job, chat, ledger, writer, sink, done_turns={}, lease=worker.lease)
        await engine.run(claimed(worker, engine))
        await sink.close()
        await writer.close()
        await worker.retire(engine.progress.stop_reason or "finished")
        return worker, engine

    return asyncio.run(scenario())


def test_three_workers_write_every_record_once_and_spend_within_the_cap(connect: Callable[[], PostgresLedger]) -> None:
    ledger = connect()
    ids = [f"r{i:02d}" for i in range(30)]
    the_job = job(concurrency=3, max_usd=1.0)
    publish(ledger, published(the_job), records(*ids), team="ml", team_cap_usd=5.0)
    chats = [FixedCostChat(COST) for _ in range(3)]

    async def everyone() -> list[tuple[Worker, Engine]]:
        return await asyncio.gather(*(asyncio.to_thread(work_in_process, connect(), published(the_job), c) for c in chats))

    shares = asyncio.run(everyone())
    lines = [json.loads(line) for line in export(ledger, "chat", HASH)]
    assert [r["id"] for r in lines] == ids
    assert sum(c.calls for c in chats) == 30
    assert sum(e.progress.records_done for _, e in shares) == 30
    assert work_left(ledger, "chat", HASH) == {"done": 30}
    spend = ledger.spend(dataset="chat")
    assert (spend.settled_usd, spend.unknown_usd) == (pytest.approx(30 * COST), 0.0)
    budget = ledger.query("SELECT settled_usd, unknown_usd, reserved_usd FROM budgets WHERE name = 'team:ml'")
    assert budget == [(pytest.approx(30 * COST), 0.0, pytest.approx(0.0, abs=1e-9))]


def test_a_run_stops_at_the_teams_cap_across_workers(connect: Callable[[], PostgresLedger]) -> None:
    ledger = connect()
    ids = [f"r{i:02d}" for i in range(40)]
    the_job = job(concurrency=2, max_usd=10.0)
    publish(ledger, published(the_job), records(*ids), team="ml", team_cap_usd=2e-4)

    async def everyone() -> list[tuple[Worker, Engine]]:
        return await asyncio.gather(
            *(asyncio.to_thread(work_in_process, connect(), published(the_job), FixedCostChat(COST)) for _ in range(2))
        )

    shares = asyncio.run(everyone())
    assert all("team's" in (e.progress.stop_reason or "") for _, e in shares), [e.progress.stop_reason for _, e in shares]
    spend = ledger.spend(dataset="chat")
    assert 0 < spend.settled_usd + spend.unknown_usd <= 2e-4
    assert work_left(ledger, "chat", HASH)["todo"] > 0


def test_a_restart_takes_no_worker_for_dead_before_it_could_reconnect(
    connect: Callable[[], PostgresLedger], postgres_server: PostgresServer
) -> None:
    """A restart drops every session lock; a live worker takes its lock again only when it
    next reaches the server. Three heartbeats after the restart, neither a live worker nor
    one that died with the server is taken for dead (no lock tells them apart yet); after
    ``dead_after_s`` of silence the dead one is, and the one that beat again is not."""
    patient = Coordination(heartbeat_s=0.1, dead_after_s=3.0, claim=4, lease_requests=4)
    ledger = connect()
    publish(ledger, published(job()), records("a", "b"), team="ml", team_cap_usd=5.0)
    live, gone = Worker.register(connect(), published(job())), Worker.register(connect(), published(job()))
    gone.ledger.close()  # its process died while the server was down
    postgres_server.restart_immediate()
    restarted = time.monotonic()
    time.sleep(3 * patient.heartbeat_s + 0.2)
    assert reap(ledger, "chat", HASH, patient) == []  # both lockless and late: it once retired both
    while time.monotonic() < restarted + patient.dead_after_s + 0.5:
        assert asyncio.run(live.heartbeat()) is True  # reconnects, takes its lock again, beats
        time.sleep(patient.heartbeat_s)
    assert reap(ledger, "chat", HASH, patient) == [gone.id]
    why = ledger.query("SELECT id, alive, retired_why FROM workers ORDER BY id")
    assert why == [(live.id, True, None), (gone.id, False, "presumed dead: its session ended")]
