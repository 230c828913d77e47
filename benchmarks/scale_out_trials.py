"""Scale-out on a shared PostgreSQL ledger under faults, over many seeded trials: the
coordinator (`quanthunt generate`) and `quanthunt worker` processes on one dataset against
a latency-mode sandbox, and what holds after each run.

Usage: ``.venv/bin/python benchmarks/scale_out_trials.py [--trials 20] [--records 300] [--workers 3]
[--concurrency 64] [--seed 0] [--partition-s 30] [--latency-ms 1000]``

Each kill trial gets a fresh database on one PostgreSQL server and a fresh dataset in one
project; once the workers have joined, 1 to 3 times at seeded random instants a seeded
random worker is killed with SIGKILL and replaced by a fresh one; then the coordinator is
waited for. Three scenario trials follow: "zombie" (a worker holding claims is SIGSTOPped
until it is presumed dead, then SIGCONTed), "restart" (PostgreSQL restarted with
``pg_ctl -m immediate`` once records are being written) and "partition" (a worker that
reaches the database through a proxy has it blackhole for ``--partition-s`` seconds once
its requests have started). A trial that breaks an invariant is counted, and the run goes on:

- lost / duplicated: each record once in the published dataset, and once in the ledger;
- unaccounted: what the sandbox charged during the trial lies in [settled, settled + unknown];
- over cap: settled + unknown, and the team budget's draw, within the team's cap;
- sessions: no worker held more than 2 sessions (pg_stat_activity, sampled through the run);
- coordinator: the coordinator exited 0;
- late writes (zombie): the stopped worker started and wrote nothing after it was retired;
- not staged: the harm could not be done as planned (no worker held claims to stop or cut off).

Per trial it prints kills (and how many of the victims held claims), records published,
workers retired as presumed dead, settled, unknown and charged USD, and the most sessions
a worker held; then the totals and the wall time. Exits 1 when any trial broke an invariant.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures, as pipeline_bed does

import psycopg
from fixtures.blackhole import TcpProxy
from fixtures.postgres import PostgresError, PostgresServer
from fixtures.sandbox import provider
from fixtures.scale_out import Fleet
from kill_anywhere import SPEND
from pipeline_bed import Bed, make_bed

TEAM_CAP_USD = 0.5
"""The team's budget (survey.budget.usd), which every host of a trial draws on."""
COORDINATION = {"heartbeat_s": 0.3, "dead_after_s": 1.5, "claim": 8, "lease_requests": 16}
"""Fast values, as the scale-out tests use: a silent worker is presumed dead within 2 s."""
COORDINATOR_CONCURRENCY = 8
"""The coordinator's requests in flight (generate.concurrency). A host claims records well
ahead of its requests (its engine's queue holds twice its concurrency), so a coordinator at
the workers' 64 would claim a 300-record dataset before any worker has started."""
MAX_SESSIONS = 2
KILL_GAP_S = (0.2, 1.5)
"""A kill comes this long (uniform) after the workers joined, or after the previous kill."""
FAILURES = ("lost", "duplicated", "unaccounted", "over cap", "sessions", "coordinator", "late writes", "not staged")
SESSIONS_SQL = """SELECT application_name, COUNT(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name LIKE 'quanthunt-worker-%' GROUP BY 1"""

Play = Callable[[Fleet], list[bool]]
"""Starts a trial's fleet and does its harm; returns, for each worker it killed, whether
that worker held claims."""


@dataclass
class Outcome:
    """What one trial left behind, and the invariants it broke."""

    name: str
    kills: list[bool]
    """Each kill: whether its victim held claims."""
    exit_code: int | None
    records: int
    """Records the trial's dataset has."""
    published: list[str]
    """The record ids in the published dataset, as written."""
    written: int
    """Records in the ledger."""
    retired: int
    settled: float
    unknown: float
    charged: float
    team_draw: float
    """What the team budget counts as settled, possibly billed or reserved."""
    sessions: int
    staged: bool = True
    late: int | None = None
    """Attempts started and records written by the zombie after it was retired."""

    def failures(self) -> list[str]:
        distinct = len(set(self.published))
        broken = {
            "lost": min(distinct, self.written) < self.records,
            "duplicated": len(self.published) > distinct or self.written > self.records,
            "unaccounted": not self.settled - 1e-9 <= self.charged <= self.settled + self.unknown + 1e-9,
            "over cap": max(self.settled + self.unknown, self.team_draw) > TEAM_CAP_USD + 1e-9,
            "sessions": self.sessions > MAX_SESSIONS,
            "coordinator": self.exit_code != 0,
            "late writes": bool(self.late),
            "not staged": not self.staged,
        }
        return [name for name in FAILURES if broken[name]]

    def line(self) -> str:
        failed = self.failures()
        verdict = "ok" if not failed else f"FAILED ({', '.join(failed)})"
        notes = f"  late writes: {self.late}" if self.late is not None else ""
        if self.written != len(set(self.published)):
            notes += f"  ledger: {self.written} records"
        kills = f"{len(self.kills)}/{sum(self.kills)}"
        return (
            f"{self.name:<10} {kills:>6} {len(set(self.published)):>5}/{self.records:<5} {self.retired:>7} "
            f"{self.settled:>9.4f} {self.unknown:>9.4f} {self.charged:>9.4f} {self.sessions:>8}  {verdict}{notes}"
        )


HEADER = (
    f"{'trial':<10} {'kills':>6} {'records':>11} {'retired':>7} {'settled':>9} {'unknown':>9} {'charged':>9} {'sessions':>8}\n"
    f"{'':<10} {'/held':>6} {'':>11} {'dead':>7} {'USD':>9} {'USD':>9} {'USD':>9} {'/worker':>8}"
)


class SessionSampler:
    """The most sessions any one worker held at once on the trial's database, sampled every
    ``every_s`` from pg_stat_activity (through a server restart: a failed sample is skipped)."""

    def __init__(self, url: str, *, every_s: float = 0.2) -> None:
        self.url, self.every_s = url, every_s
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="sessions", daemon=True)

    def __enter__(self) -> SessionSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.url, autocommit=True, connect_timeout=2) as db:
                while not self._stop.wait(self.every_s):
                    counts = [int(n) for _, n in db.execute(SESSIONS_SQL).fetchall()]
                    self.most = max([self.most, *counts])
            self._stop.wait(self.every_s)


@dataclass
class Trials:
    """One PostgreSQL server and one project; each trial a fresh database and dataset."""

    server: PostgresServer
    bed: Bed
    args: argparse.Namespace
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self, name: str, play: Play, *, late: Callable[[Fleet], int] | None = None) -> Outcome:
        """A fresh fleet on a fresh database, started and harmed by ``play``; then the
        coordinator is waited for and the trial judged (``late``: what a retired worker
        started or wrote afterwards)."""
        dataset = f"t{len(self.outcomes) + 1:02d}_{name.replace(' ', '')}"
        url = self.server.create_database(dataset)
        self.bed.add_dataset(dataset, self.args.records)
        self.bed.env["QUANTHUNT_LEDGER_URL"] = url
        fleet = Fleet(self.bed.root, self.bed.env, dataset, url, self.charged_usd, TEAM_CAP_USD)
        charged_before = self.charged_usd()
        kills: list[bool] = []
        staged, exit_code = True, None
        with SessionSampler(url) as sessions:
            try:
                kills = play(fleet)
            except (AssertionError, psycopg.Error, PostgresError) as exc:  # the run went otherwise: still see it to its end
                staged = False
                print(f"  {dataset}: not staged: {type(exc).__name__}: {str(exc)[-1500:]}", flush=True)
            try:
                exit_code = fleet.finish() if fleet.coordinator is not None else None
            except subprocess.TimeoutExpired:
                print(f"  {dataset}: the coordinator did not finish", flush=True)
            finally:
                end(fleet)
        written, retired, settled, unknown, team_draw = ledger_figures(fleet)
        outcome = Outcome(name, kills, exit_code, self.args.records, self.bed.records(dataset), int(written), int(retired),
                          settled, unknown, self.quiet_charge() - charged_before, team_draw, sessions.most, staged,
                          late(fleet) if late is not None and staged else None)  # fmt: skip
        self.outcomes.append(outcome)
        print(outcome.line(), flush=True)
        if outcome.failures() and fleet.coordinator is not None:
            print(f"  coordinator: {fleet.coordinator_output()[-1200:]}", flush=True)
        return outcome

    def charged_usd(self) -> float:
        return float(self.bed.sandbox_stats()["key"]["usage"])

    def quiet_charge(self) -> float:
        """What the sandbox has charged, once no request still in flight adds to it (so a
        late charge is not counted against the next trial)."""
        quiet_s = 2 * self.args.latency_ms / 1000 + 0.5
        last = self.charged_usd()
        while True:
            time.sleep(quiet_s)
            now = self.charged_usd()
            if now == last:
                return now
            last = now


def ledger_figures(fleet: Fleet) -> tuple[float, float, float, float, float]:
    """Records written, workers presumed dead, settled and unknown spend, and what the team
    budget counts as drawn; all 0 when the coordinator never made the ledger's tables."""
    try:
        ((written,),) = fleet.rows("SELECT COUNT(*) FROM records")
        ((retired,),) = fleet.rows("SELECT COUNT(*) FROM workers WHERE retired_why LIKE 'presumed dead%'")
        ((settled, unknown),) = fleet.rows(f"SELECT {SPEND} FROM attempts")
        ((team_draw,),) = fleet.rows(
            "SELECT COALESCE(SUM(settled_usd + unknown_usd + reserved_usd), 0) FROM budgets WHERE name LIKE 'team:%'"
        )
    except psycopg.errors.UndefinedTable:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    return float(written), float(retired), float(settled), float(unknown), float(team_draw)  # type: ignore[arg-type]


def end(fleet: Fleet) -> None:
    """Leave no process of the fleet running (or stopped)."""
    for proc in [fleet.coordinator, *(fleet.workers or [])]:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def holding_claims(pids: Iterable[int]) -> str:
    """Which of the processes ``pids`` hold claims (SQL)."""
    listed = ", ".join(str(pid) for pid in pids)
    return f"SELECT pid FROM workers WHERE pid IN ({listed}) AND id IN (SELECT owner FROM work WHERE state = 'claimed')"


def start(fleet: Fleet, args: argparse.Namespace, *, first: str | None = None) -> None:
    """Start the fleet and wait until each worker has joined the job (or found nothing left
    to do). ``first``: a route to the database for one worker that joins, and claims, before
    the others start (a latecomer may find the queue claimed by those ahead of it)."""
    fleet.start(0 if first else args.workers, concurrency=args.concurrency)
    assert fleet.workers is not None
    if first is not None:
        fleet.workers.append(fleet.worker(args.concurrency, url=first))
        fleet.wait_until(holding_claims([fleet.workers[0].pid]))
        fleet.workers += [fleet.worker(args.concurrency) for _ in range(args.workers - 1)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        joined = {pid for (pid,) in fleet.rows("SELECT pid FROM workers")}
        if all(proc.pid in joined or proc.poll() is not None for proc in fleet.workers):
            return
        time.sleep(0.1)
    raise AssertionError("the workers never joined")


def killing(rng: random.Random, args: argparse.Namespace) -> Play:
    """A kill trial, its plan (how many kills, when, which worker) drawn before it starts."""
    plan = [(rng.uniform(*KILL_GAP_S), rng.randrange(args.workers)) for _ in range(rng.randint(1, 3))]

    def play(fleet: Fleet) -> list[bool]:
        start(fleet, args)
        assert fleet.coordinator is not None and fleet.workers is not None
        kills = []
        for gap_s, victim in plan:
            time.sleep(gap_s)
            if fleet.coordinator.poll() is not None:
                break
            proc = fleet.workers[victim]
            if proc.poll() is not None:
                continue  # it had found nothing left to do
            held = bool(fleet.rows(holding_claims([proc.pid])))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            fleet.workers[victim] = fleet.worker(args.concurrency)
            kills.append(held)
        return kills

    return play


def zombie(args: argparse.Namespace) -> tuple[Play, Callable[[Fleet], int]]:
    """SIGSTOP a worker holding claims until it is presumed dead and its claims are taken,
    then SIGCONT; afterwards, what it started or wrote after it was retired."""
    stopped: list[int] = []

    def play(fleet: Fleet) -> list[bool]:
        start(fleet, args)
        assert fleet.workers is not None
        holding = holding_claims(proc.pid for proc in fleet.workers)
        fleet.wait_until(holding)
        ((pid,), *_) = fleet.rows(holding)
        (proc,) = [proc for proc in fleet.workers if proc.pid == pid]
        stopped.append(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        try:
            fleet.wait_until(f"SELECT 1 FROM workers WHERE pid = {proc.pid} AND NOT alive")
            time.sleep(1.0)  # its claims go to the others meanwhile
        finally:
            proc.send_signal(signal.SIGCONT)
        return []

    def late(fleet: Fleet) -> int:
        ((n,),) = fleet.rows(
            f"""SELECT (SELECT COUNT(*) FROM attempts a WHERE a.worker = w.id AND a.started_at > extract(epoch FROM w.retired_at))
                     + (SELECT COUNT(*) FROM records r WHERE r.worker = w.id AND r.written_at > extract(epoch FROM w.retired_at))
                FROM workers w WHERE w.pid = {stopped[-1]}"""
        )
        return int(n)  # type: ignore[call-overload]

    return play, late


def restart(server: PostgresServer, args: argparse.Namespace) -> Play:
    """PostgreSQL stopped with ``-m immediate`` and started again once records are being written."""

    def play(fleet: Fleet) -> list[bool]:
        start(fleet, args)
        fleet.wait_until("SELECT 1 FROM records")
        server.restart_immediate()
        return []

    return play


@contextlib.contextmanager
def partition(args: argparse.Namespace) -> Iterator[Play]:
    """One worker reaches the database through a proxy, which blackholes for
    ``--partition-s`` once that worker's requests have started; the others are direct."""
    proxies: list[TcpProxy] = []

    def play(fleet: Fleet) -> list[bool]:
        host, port = fleet.url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
        proxies.append(TcpProxy(host, int(port)))
        start(fleet, args, first=fleet.url.replace(f"{host}:{port}", f"127.0.0.1:{proxies[-1].port}"))
        assert fleet.workers is not None
        cut = fleet.workers[0].pid
        fleet.wait_until(f"SELECT 1 FROM attempts a JOIN workers w ON w.id = a.worker WHERE w.pid = {cut}")
        proxies[-1].blackhole(args.partition_s)
        fleet.wait_until(f"SELECT 1 FROM workers WHERE pid = {cut} AND NOT alive")
        return []

    try:
        yield play
    finally:
        for proxy in proxies:
            proxy.close()


def summary(outcomes: list[Outcome], wall_s: float) -> str:
    broken = Counter(name for outcome in outcomes for name in outcome.failures())
    kills = [held for outcome in outcomes for held in outcome.kills]
    lines = [
        f"trials: {len(outcomes)} ({sum(o.name.startswith('kill') for o in outcomes)} kill trials and 3 scenarios)",
        f"kills: {len(kills)} ({sum(kills)} of a worker holding claims); "
        f"workers presumed dead: {sum(o.retired for o in outcomes)}",
        *(f"trials with {name}: {broken[name]}" for name in FAILURES),
        f"trials failed: {sum(bool(o.failures()) for o in outcomes)}",
        f"wall time: {wall_s:.0f} s",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill trials (the three scenarios come after them)")
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--workers", type=int, default=3, help="`quanthunt worker` processes besides the coordinator")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition-s", type=float, default=30.0)
    parser.add_argument("--latency-ms", type=float, default=1000.0, help="the sandbox's time to answer a request")
    args = parser.parse_args()
    started = time.perf_counter()
    providers = [
        provider("alpha", latency_ms=args.latency_ms),
        provider("beta", latency_ms=args.latency_ms, pricing={"prompt": "0.000002", "completion": "0.000004"}),
    ]
    bed = make_bed(
        {"providers": providers, "credits": {"default_usd": 1e6}},
        settings={"generate.max_records": None, "generate.concurrency": COORDINATOR_CONCURRENCY, "generate.monitor.share": 0,
                  "generate.request_timeout_s": 5, "generate.retry.base_delay_s": 0.05, "generate.retry.max_delay_s": 0.5,
                  "generate.progress_interval_s": 60, "survey.budget.usd": TEAM_CAP_USD, "ledger.coordination": COORDINATION,
                  "ledger.team": "ml"},
    )  # fmt: skip
    rng = random.Random(args.seed)
    print(
        f"{args.workers} workers at {args.concurrency} requests in flight and the coordinator at {COORDINATOR_CONCURRENCY}, "
        f"{args.records} records, {args.latency_ms:.0f} ms latency, team cap ${TEAM_CAP_USD}, seed {args.seed}\n\n{HEADER}",
        flush=True,
    )
    try:
        with PostgresServer() as server:
            trials = Trials(server, bed, args)
            for trial in range(1, args.trials + 1):
                trials.run(f"kill {trial}", killing(rng, args))
            stop, late = zombie(args)
            trials.run("zombie", stop, late=late)
            trials.run("restart", restart(server, args))
            with partition(args) as cut:
                trials.run("partition", cut)
    finally:
        bed.sandbox.stop()
    print(f"\n{summary(trials.outcomes, time.perf_counter() - started)}")
    sys.exit(1 if any(o.failures() for o in trials.outcomes) else 0)


if __name__ == "__main__":
    main()
