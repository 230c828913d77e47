"""Can the latency-mode sandbox hold 2,000 concurrent requests on 2 cores?

Usage: ``.venv/bin/python benchmarks/sandbox_concurrency.py [--in-flight 2000] [--requests 10000] [--latency-ms 1000]``

Starts the sandbox in latency mode (one provider, fixed latency, no faults) in its own
process, drives it with raw aiohttp at ``--in-flight`` concurrent requests, and prints the
concurrency the sandbox itself saw, requests/s against the Little's-law bound
(in flight ÷ latency), latency percentiles, and the sandbox's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from quanthunt.sandbox.server import SandboxProcess

MODEL = "huggingfacetb/smollm2-135m-instruct"
KEY = "sk-bench"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, in_flight: int, total: int) -> list[float]:
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "load test"}], "max_tokens": 16}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {KEY}"}) as session:

        async def one() -> None:
            async with gate:
                start = time.perf_counter()
                async with session.post(f"{url}/chat/completions", json=body) as reply:
                    await reply.read()
                    assert reply.status == 200, reply.status
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(total)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--latency-ms", type=float, default=1000)
    args = parser.parse_args()
    roster = {
        "providers": [
            {
                "name": "Moonshot AI",
                "slug": "moonshotai",
                "tag": "moonshotai/int4",
                "quantization": "int4",
                "precision": "int4-native",
                "pricing": {"prompt": "0.0000006", "completion": "0.0000025"},
                "latency_ms": args.latency_ms,
                "throughput_tps": 1e9,
            }
        ],
        "credits": {"default_usd": 1e6},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roster.yaml"
        path.write_text(yaml.safe_dump(roster))
        with SandboxProcess(mode="latency", roster=path) as sandbox:
            assert sandbox.pid is not None
            cpu0, t0, client0 = cpu_seconds(sandbox.pid), time.perf_counter(), time.process_time()
            latencies = asyncio.run(drive(sandbox.api_url, args.in_flight, args.requests))
            wall = time.perf_counter() - t0
            server_cpu = cpu_seconds(sandbox.pid) - cpu0
            client_cpu = time.process_time() - client0
            import httpx

            stats = httpx.get(f"{sandbox.api_url}/sandbox/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    bound = args.in_flight / (args.latency_ms / 1000)
    q = statistics.quantiles(latencies, n=100)
    print(f"requests {args.requests}, target in flight {args.in_flight}, server latency {args.latency_ms:.0f} ms")
    print(f"peak concurrent requests seen by the sandbox: {stats['peak_in_flight']}")
    print(
        f"throughput: {args.requests / wall:.0f} req/s (Little's-law bound {bound:.0f} req/s: {args.requests / wall / bound:.0%})"
    )
    print(f"latency p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms")
    per_request = 1000 / args.requests
    print(
        f"sandbox CPU {server_cpu * per_request:.3f} ms/request; raw aiohttp client CPU {client_cpu * per_request:.3f} ms/request"
    )


if __name__ == "__main__":
    main()
