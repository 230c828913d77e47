"""Generation throughput on the two ledger backends, side by side in one run, against the
latency-mode sandbox (1 s latency), 2,000 requests in flight per process:

- ``sqlite``: the default, one process (``generation_throughput.quanthunt_engine``);
- ``sqlite@BASE``: the same before the ledger seam (``--base``, a git worktree of that
  commit running its own copy of this measurement), so a regression of the default shows;
- ``postgres x1`` and ``postgres x3``: 1 and 3 ``quanthunt worker`` processes on one job
  published to a PostgreSQL ledger (a server the benchmark starts), each with its own
  budget leases, claims and fenced writes.

Usage: ``.venv/bin/python benchmarks/scale_out_throughput.py [--requests 12000] [--in-flight 2000] [--base f917ac4]
[--configs sqlite,sqlite@base,postgres:1,postgres:3]``

Prints per configuration: requests, whole-run and steady requests/s (the middle half of the
completions, from the ledger's finish times), the workers' CPU ms per request, and
PostgreSQL's CPU ms per request (the postmaster and every backend, exited ones included:
the postmaster's children times). Each postgres worker runs ``--requests`` requests, so
x3 runs three times as many. On this 2-core machine 3 workers, the sandbox and the
server share two cores: CPU, not the ledger, bounds x3.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from generation_throughput import KEY, ROOT, bench_job, bench_records, bench_roster, cpu_seconds, steady_rate

sys.path.insert(0, str(ROOT / "tests"))

from fixtures.postgres import PostgresServer

from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.params import Coordination
from quanthunt.sandbox.server import SandboxProcess
from quanthunt.shared import Published, publish

BIN = Path(sys.executable).parent


def server_cpu_seconds(postmaster: int) -> float:
    """The server's CPU so far: the postmaster's own, its exited children's (reaped into its
    children times) and its live children's."""
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == postmaster:
                total += cpu_seconds(int(entry.name))
    return total


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sqlite(url: str, args: argparse.Namespace, tmp: Path, *, base: Path | None) -> dict[str, float]:
    """One engine process on a SQLite ledger (``base``: the old commit's own benchmark)."""
    out = tmp / ("sqlite-base.json" if base else "sqlite.json")
    script = (base or ROOT) / "benchmarks/generation_throughput.py"
    env = os.environ | ({"PYTHONPATH": str(base / "src")} if base else {})
    command = [sys.executable, str(script), "--client", "quanthunt", "--url", url, "--requests", str(args.requests),
               "--in-flight", str(args.in_flight), "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env=env, cwd=base or ROOT)
    result = json.loads(out.read_text())
    finished = sorted(result["latencies"])  # only their count matters below
    return {"requests": len(finished), "rate": args.requests / result["wall"], "steady": result["steady_rate"],
            "client_ms": result["cpu"] * 1000 / args.requests, "server_ms": float("nan")}  # fmt: skip


def run_postgres(url: str, args: argparse.Namespace, server: PostgresServer, workers: int) -> dict[str, float]:
    """``workers`` worker processes on one published job in a fresh database."""
    database = server.create_database(f"bench_{workers}_{int(time.time())}")
    ledger = PostgresLedger(database)
    total = args.requests * workers
    job = bench_job(args.in_flight, run_id=f"bench-{workers}")
    coordination = Coordination(heartbeat_s=2, dead_after_s=15, claim=512, lease_requests=4096)
    publish(ledger, Published(job, url, coordination, request_timeout_s=60, stop_grace_s=5),
            bench_records(total), team="bench", team_cap_usd=1e6)  # fmt: skip
    postmaster = server.postmaster_pid
    server0, children0, started = server_cpu_seconds(postmaster), children_cpu_seconds(), time.time()
    env = os.environ | {"QUANTHUNT_LEDGER_URL": database, "OPENROUTER_API_KEY": KEY}
    procs = [
        subprocess.Popen([str(BIN / "quanthunt"), "worker", "--concurrency", str(args.in_flight)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a worker failed (exit {proc.returncode}): {err[-2000:]}")
    server_s, client_s = server_cpu_seconds(postmaster) - server0, children_cpu_seconds() - children0
    finished = [float(t) for (t,) in ledger.query("SELECT finished_at FROM attempts WHERE outcome = 'ok'")]
    ((written,),) = ledger.query("SELECT COUNT(*) FROM records")
    ledger.close()
    if written != total:
        raise SystemExit(f"postgres x{workers}: {written} records written of {total}")
    return {"requests": total, "rate": total / (max(finished) - started), "steady": steady_rate(finished),
            "client_ms": client_s * 1000 / total, "server_ms": server_s * 1000 / total}  # fmt: skip


def worktree(commit: str, tmp: Path) -> Path:
    path = tmp / f"base-{commit}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), commit], check=True,
                   capture_output=True)  # fmt: skip
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12_000, help="per process")
    parser.add_argument("--in-flight", type=int, default=2000, help="per process")
    parser.add_argument("--latency-ms", type=float, default=1000)
    parser.add_argument("--base", default="f917ac4", help="the commit before the ledger seam, for sqlite@base")
    parser.add_argument("--configs", default="sqlite,sqlite@base,postgres:1,postgres:3")
    args = parser.parse_args()
    roster = bench_roster(args.latency_ms)
    bound = args.in_flight / (args.latency_ms / 1000)
    print(f"latency-mode sandbox, {args.latency_ms:.0f} ms per request, {args.in_flight} in flight per process "
          f"(Little's-law bound {bound:.0f} req/s per process), {os.cpu_count()} cores")  # fmt: skip
    print(f"{'configuration':<16}{'requests':>9}{'req/s':>8}{'steady req/s':>13}{'worker CPU ms/req':>18}"
          f"{'PostgreSQL CPU ms/req':>22}")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch, PostgresServer() as server:
        tmp = Path(scratch)
        (tmp / "roster.yaml").write_text(yaml.safe_dump(roster))
        for config in args.configs.split(","):
            with SandboxProcess(mode="latency", roster=tmp / "roster.yaml") as sandbox:
                name = config
                if config == "sqlite":
                    row = run_sqlite(sandbox.api_url, args, tmp, base=None)
                elif config == "sqlite@base":
                    row = run_sqlite(sandbox.api_url, args, tmp, base=worktree(args.base, tmp))
                    name = f"sqlite@{args.base}"
                elif config.startswith("postgres:"):
                    row = run_postgres(sandbox.api_url, args, server, int(config.split(":")[1]))
                    name = f"postgres x{config.split(':')[1]}"
                else:
                    parser.error(f"--configs: unknown configuration {config!r}")
            print(f"{name:<16}{row['requests']:>9.0f}{row['rate']:>8.0f}{row['steady']:>13.0f}{row['client_ms']:>18.3f}"
                  f"{row['server_ms']:>22.3f}", flush=True)  # fmt: skip
    subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


if __name__ == "__main__":
    main()
