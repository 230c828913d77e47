"""SIGKILL `quanthunt generate` at random instants (seeded), resume, and check after
every kill: no record twice, every record the ledger marked done is in the file, no
run spent more than its cap, and the sandbox charged no more than the ledger accounts
for. The benchmark benchmarks/kill_anywhere.py runs the same loop at scale."""

from __future__ import annotations

import random
import signal
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from fixtures.generation import GenerationBed

CAP = 0.05


def invariants(bed: GenerationBed) -> int:
    records = bed.records()  # a half-written last line would fail to parse here: prepare_output must cut it first
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "a record appears twice"
    db = sqlite3.connect(bed.project.root / "state/ledger.sqlite")
    marked = {r for (r,) in db.execute("SELECT record_id FROM records WHERE dataset='tiny'")}
    spent = "SUM(cost_usd), COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN reserved_usd END), 0)"
    per_run = [c + u for c, u in db.execute(f"SELECT {spent} FROM attempts GROUP BY run_id")]
    settled, unknown = db.execute(f"SELECT {spent} FROM attempts").fetchone()
    db.close()
    assert marked <= set(ids), f"done in the ledger but missing from the file: {sorted(marked - set(ids))[:3]}"
    assert all(spent <= CAP + 1e-12 for spent in per_run)
    assert (settled or 0) - 1e-9 <= bed.charged_usd() <= (settled or 0) + unknown + 1e-9
    return len(ids)


def attempts(bed: GenerationBed) -> int:
    """Requests the ledger has recorded (none before the first run made its tables)."""
    path = bed.project.root / "state/ledger.sqlite"
    if not path.exists():
        return 0
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM attempts").fetchone()[0])
    except sqlite3.OperationalError:  # no such table yet
        return 0
    finally:
        db.close()


def wait_until_sending(bed: GenerationBed, proc: Any, before: int, timeout_s: float = 300) -> None:
    """Until ``proc`` has recorded a request of its own. The random instant is counted from
    here, not from the start: a busy machine took over 9 s to start a run, so every kill of
    a fixed 3-9 s window landed before the first request and the test measured nothing."""
    deadline = time.monotonic() + timeout_s
    while attempts(bed) <= before:
        assert proc.poll() is None and time.monotonic() < deadline, "the run never sent a request"
        time.sleep(0.1)


def test_kill_anywhere_then_resume(generation_bed: Callable[..., GenerationBed]) -> None:
    bed = generation_bed(
        records=300,
        latency_ms=1000,
        params={"generate.max_usd_per_run": CAP, "generate.concurrency": 16, "generate.sampling.max_tokens": 48},
    )
    rng = random.Random(1234)
    counts = []
    for _ in range(6):
        proc = bed.project.start("generate", "tiny", "--params", "params.yaml")
        wait_until_sending(bed, proc, attempts(bed))
        time.sleep(rng.uniform(0.0, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        counts.append(invariants(bed))
    bed.project.set_param("generate.concurrency", 64)  # the last run need not wait its turn 16 at a time
    final = bed.generate()
    assert final.returncode == 0, final.stderr
    assert invariants(bed) == 300
    print(f"records after each kill: {counts}")
    assert counts == sorted(counts)  # progress is never lost
    assert counts[-1] < 300  # the kills did land mid-run
