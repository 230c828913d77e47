"""Soak: drive `quanthunt generate` for N minutes against the latency-mode sandbox with
every fault on at a low rate; sample the client's memory and open files over time, count
requests and retries by kind, and reconcile the ledger with what the sandbox charged.

Usage: ``.venv/bin/python benchmarks/soak.py [--minutes 5] [--in-flight 500] [--fault-rate 0.01]``
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from pipeline_bed import make_bed

from quanthunt.sandbox.roster import FAULT_KINDS


def memory_mb(pid: int) -> dict[str, float]:
    """Resident memory in MB: all of it (VmRSS), and its anonymous (heap), file-backed
    and shared-memory parts (the ledger's WAL index is a mapped file)."""
    wanted = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name = line.split(maxsplit=1)[0] if line else ""
        if name in wanted:
            found[wanted[name]] = int(line.split()[1]) / 1024
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--in-flight", type=int, default=500)
    parser.add_argument("--fault-rate", type=float, default=0.01)
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--sample-s", type=float, default=15)
    args = parser.parse_args()
    faults = {kind: args.fault_rate for kind in FAULT_KINDS} | {"retry_after_s": 0.5, "timeout_s": 3}
    providers = [
        {
            "name": "Alpha",
            "slug": "alpha",
            "tag": "alpha/int4",
            "quantization": "int4",
            "precision": "int4-native",
            "pricing": {"prompt": "0.000001", "completion": "0.000002"},
            "latency_ms": 500,
            "throughput_tps": 1e9,
            "faults": faults,
        }
    ]
    bed = make_bed(
        {"providers": providers, "credits": {"default_usd": 1e6}},
        settings={
            "generate.concurrency": args.in_flight,
            "generate.max_usd_per_run": 1e4,
            "generate.max_records": None,
            "generate.request_timeout_s": 2,
            "generate.retry.max_attempts": 10,
            "generate.progress_interval_s": 60,
        },
    )
    bed.add_dataset("soak", args.records)
    proc = bed.popen("generate", "soak")
    started = time.perf_counter()
    samples = []
    print(f"{'minute':>7}{'records':>10}{'RSS MB':>9}{'anon':>7}{'file':>7}{'shmem':>7}{'open fds':>10}", flush=True)
    while time.perf_counter() - started < args.minutes * 60 and proc.poll() is None:
        time.sleep(args.sample_s)
        if proc.poll() is not None:
            break
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        memory = memory_mb(proc.pid)
        row = ((time.perf_counter() - started) / 60, len(bed.records("soak")), memory["rss"], fds)
        samples.append(row)
        print(f"{row[0]:>7.1f}{row[1]:>10}{row[2]:>9.0f}{memory['anon']:>7.0f}{memory['file']:>7.0f}{memory['shmem']:>7.0f}"
              f"{row[3]:>10}", flush=True)  # fmt: skip
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    db = bed.ledger()
    attempts = dict(db.execute("SELECT COALESCE(outcome, 'open'), COUNT(*) FROM attempts GROUP BY 1").fetchall())
    kinds = dict(db.execute("SELECT error_kind, COUNT(*) FROM attempts WHERE error_kind IS NOT NULL GROUP BY 1").fetchall())
    settled, unknown = db.execute(
        "SELECT COALESCE(SUM(cost_usd), 0), COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL "
        "THEN reserved_usd END), 0) FROM attempts"
    ).fetchone()
    db.close()
    ids = bed.records("soak")
    stats = bed.sandbox_stats()
    charged = float(stats["key"]["usage"])
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{minutes:.1f} minutes at {args.in_flight} in flight, every fault at {args.fault_rate:.0%}")
    print(f"sandbox requests {stats['requests']}; attempts by outcome {attempts}")
    print(f"failed attempts by kind {kinds}")
    print(f"records written {len(ids)} ({len(ids) - len(set(ids))} duplicated)")
    if samples:
        first, last = samples[0], samples[-1]
        peak_rss, peak_fds = max(s[2] for s in samples), max(s[3] for s in samples)
        print(
            f"RSS {first[2]:.0f} MB -> {last[2]:.0f} MB (peak {peak_rss:.0f}); open fds {first[3]} -> {last[3]} (peak {peak_fds})"
        )
    print(
        f"ledger settled ${settled:.6f} + possibly billed ${unknown:.6f}; sandbox charged ${charged:.6f} "
        f"({'consistent' if settled - 1e-9 <= charged <= settled + unknown + 1e-9 else 'INCONSISTENT'})"
    )
    bed.sandbox.stop()


if __name__ == "__main__":
    main()
