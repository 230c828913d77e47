"""SIGKILL `quanthunt generate` at random instants, resume, and check the invariants
after every kill: no record lost, none duplicated, no run over its cap, and the sandbox
charged no more than the ledger accounts for (settled + possibly billed).

Usage: ``.venv/bin/python benchmarks/kill_anywhere.py [--trials 100] [--records 2000] [--seed 0] [--max-delay 15]``

Each trial starts `quanthunt generate` on the current dataset at 2,000 requests in
flight (1 s latency), kills it after a seeded random delay (uniform from 0.5 s to
`--max-delay`), and checks. When a dataset is complete the next trial starts a new one,
so kills keep landing in every phase: start-up, recovery, mid-run and the final writes.
"""

from __future__ import annotations

import argparse
import random
import signal
import time

from pipeline_bed import make_bed

from quanthunt.errors import EXIT_OUT_OF_BUDGET

SPEND = "COALESCE(SUM(cost_usd), 0), COALESCE(SUM(CASE WHEN outcome='unknown' OR outcome IS NULL THEN reserved_usd END), 0)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--cap", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-delay", type=float, default=15.0,
        help="kills land uniformly in [0.5, MAX] s after the start; a whole 2,000-record run takes ~14 s here, "
        "about half of it start-up (imports, MLflow, recovery)",
    )  # fmt: skip
    args = parser.parse_args()
    providers = [
        {
            "name": "Alpha",
            "slug": "alpha",
            "tag": "alpha/int4",
            "quantization": "int4",
            "precision": "int4-native",
            "pricing": {"prompt": "0.000001", "completion": "0.000002"},
            "latency_ms": 1000,
            "throughput_tps": 1e9,
        }
    ]
    bed = make_bed(
        {"providers": providers, "credits": {"default_usd": 1e6}},
        settings={
            "generate.concurrency": args.in_flight,
            "generate.max_usd_per_run": args.cap,
            "generate.max_records": None,
            "generate.progress_interval_s": 60,
        },
    )
    rng = random.Random(args.seed)
    dataset_index, lost, duplicated, overspend, unexplained, mid_run = 0, 0, 0, 0, 0, 0
    bed.add_dataset("d0", args.records)
    started = time.perf_counter()
    for trial in range(1, args.trials + 1):
        name = f"d{dataset_index}"
        before = len(bed.records(name))
        proc = bed.popen("generate", name)
        time.sleep(rng.uniform(0.5, args.max_delay))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ids = bed.records(name)
        db = bed.ledger()
        marked = {r for (r,) in db.execute("SELECT record_id FROM records WHERE dataset=?", (name,))}
        per_run = [c + u for c, u in db.execute(f"SELECT {SPEND} FROM attempts GROUP BY run_id")]
        settled, unknown = db.execute(f"SELECT {SPEND} FROM attempts").fetchone()
        db.close()
        charged = float(bed.sandbox_stats()["key"]["usage"])
        lost += len(marked - set(ids))
        duplicated += len(ids) - len(set(ids))
        overspend += sum(1 for spent in per_run if spent > args.cap + 1e-12)
        unexplained += not (settled - 1e-9 <= charged <= settled + unknown + 1e-9)
        mid_run += before < len(ids) < args.records
        print(f"trial {trial:>3}: {name} {before:>5} -> {len(ids):>5} records", flush=True)
        if len(set(ids)) >= args.records:
            dataset_index += 1
            bed.add_dataset(f"d{dataset_index}", args.records)
    # Resume the last dataset to the end: a run that hits its cap exits 75, and is rerun as a user would.
    for _ in range(args.records // 500 + 2):
        final = bed.run("generate", f"d{dataset_index}")
        if final.returncode != EXIT_OUT_OF_BUDGET:
            break
    complete = len(set(bed.records(f"d{dataset_index}"))) == args.records and final.returncode == 0
    print(
        f"\n{args.trials} kill trials in {time.perf_counter() - started:.0f} s, {args.in_flight} requests in flight, "
        f"{dataset_index + 1} datasets of {args.records} records"
    )
    print(f"kills that landed mid-run (progress made, dataset unfinished): {mid_run}")
    print(
        f"records lost: {lost}; records duplicated: {duplicated}; runs over their ${args.cap} cap: {overspend}; "
        f"checks where the sandbox charged more than the ledger accounts for: {unexplained}; final resume complete: {complete}"
    )
    bed.sandbox.stop()


if __name__ == "__main__":
    main()
