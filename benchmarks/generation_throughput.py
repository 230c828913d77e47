"""Generation at 2,000 requests in flight: quanthunt's engine (ledger, budget and
provenance on) against the official openai SDK and raw aiohttp, side by side, against
the latency-mode sandbox (1 s latency), each client in its own process.

Usage: ``.venv/bin/python benchmarks/generation_throughput.py [--requests 20000] [--in-flight 2000] [--sdk-requests 4000]``

Prints per client: achieved requests/s against the Little's-law bound (in flight ÷
latency), client CPU ms per request, peak RSS, p50/p99 latency, and the sandbox's own CPU
per request over the same interval. The openai SDK runs fewer requests (it costs
~10-17 ms of CPU each); its figures are per request all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from quanthunt.sandbox.server import SandboxProcess

MODEL = "huggingfacetb/smollm2-135m-instruct"
KEY = "sk-bench-key-000000"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantiles(latencies: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(latencies, n=100)
    return q[49], q[98]


# -- the clients (each runs in a child process: `python this.py --client NAME ...`) -------------


async def raw_aiohttp(url: str, total: int, in_flight: int) -> list[float]:
    import aiohttp

    gate, latencies = asyncio.Semaphore(in_flight), []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers={"Authorization": f"Bearer {KEY}"}
    ) as session:

        async def one() -> None:
            async with gate:
                start = time.perf_counter()
                async with session.post(f"{url}/chat/completions", json=body) as reply:
                    await reply.read()
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(total)))
    return latencies


async def openai_sdk(url: str, total: int, in_flight: int) -> list[float]:
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=in_flight), timeout=600))  # fmt: skip
    gate, latencies = asyncio.Semaphore(in_flight), []

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one() for _ in range(total)))
    return latencies


async def quanthunt_engine(url: str, total: int, in_flight: int) -> list[float]:
    from quanthunt.gateway import AiohttpChat, ApiKey, Routing
    from quanthunt.generation import Eligible, Engine, Job, RecordSink, Retry, Sampling
    from quanthunt.ledger import Ledger, LedgerWriter
    from quanthunt.prompts import PromptRecord, Turn

    work = Path(tempfile.mkdtemp(prefix="qh-bench-"))
    ledger = Ledger(work / "ledger.sqlite")
    writer = LedgerWriter(ledger)
    writer.start()
    sink = RecordSink(work / "out.jsonl", ledger, writer, "bench", "p" * 64)
    sink.start()
    provider = Eligible("Moonshot AI", "moonshotai/int4", "int4", "equivalent", 6e-7, 2.5e-6, 8192)
    job = Job(dataset="bench", model=MODEL, sampling=Sampling(0.7, 1.0, 16, 0), providers=(provider,),
              routing=Routing(only=(provider.tag,), allow_fallbacks=False, require_parameters=True), params_hash="p" * 64,
              run_id="bench", max_usd=1e6, max_output_tokens=None, concurrency=in_flight, retry=Retry(6, 0.5, 30),
              verification_run_id="bench")  # fmt: skip
    records = (PromptRecord(f"r{i}", (Turn("user", f"hello number {i}"),)) for i in range(total))
    async with AiohttpChat(url, api_key=ApiKey(KEY)) as chat:
        engine = Engine(job, chat, ledger, writer, sink, done_turns={})
        await engine.run(records)
    await sink.close()
    await writer.close()
    rows = ledger.db.execute("SELECT finished_at - started_at FROM attempts WHERE outcome='ok'").fetchall()
    lines = sum(1 for _ in (work / "out.jsonl").open())
    assert lines == total, f"{lines} records written of {total}"
    return [float(r[0]) for r in rows]


CLIENTS = {"quanthunt": quanthunt_engine, "openai-sdk": openai_sdk, "raw-aiohttp": raw_aiohttp}


def child(name: str, url: str, total: int, in_flight: int) -> None:
    import uvloop

    start, cpu0 = time.perf_counter(), time.process_time()
    latencies = uvloop.run(CLIENTS[name](url, total, in_flight))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"wall": wall, "cpu": cpu, "rss_mb": rss_mb, "latencies": latencies}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--sdk-requests", type=int, default=4_000)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=1000)
    parser.add_argument("--client", choices=sorted(CLIENTS))
    parser.add_argument("--url")
    args = parser.parse_args()
    if args.client:
        child(args.client, args.url, args.requests, args.in_flight)
        return
    roster = {"providers": [{"name": "Moonshot AI", "slug": "moonshotai", "tag": "moonshotai/int4", "quantization": "int4",
                             "precision": "int4-native", "pricing": {"prompt": "0.0000006", "completion": "0.0000025"},
                             "latency_ms": args.latency_ms, "throughput_tps": 1e9}],
              "credits": {"default_usd": 1e6}}  # fmt: skip
    bound = args.in_flight / (args.latency_ms / 1000)
    print(f"latency-mode sandbox, {args.latency_ms:.0f} ms per request, {args.in_flight} in flight: "
          f"Little's-law bound {bound:.0f} req/s")  # fmt: skip
    columns = [("client", 13), ("requests", 9), ("req/s", 8), ("of bound", 9), ("client CPU ms/req", 19), ("peak RSS MB", 12),
               ("p50 ms", 8), ("p99 ms", 8), ("sandbox CPU ms/req", 20)]  # fmt: skip
    header = "".join(f"{name:<{width}}" if i == 0 else f"{name:>{width}}" for i, (name, width) in enumerate(columns))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roster.yaml"
        path.write_text(yaml.safe_dump(roster))
        for name in ("quanthunt", "raw-aiohttp", "openai-sdk"):
            total = args.sdk_requests if name == "openai-sdk" else args.requests
            with SandboxProcess(mode="latency", roster=path) as sandbox:
                assert sandbox.pid is not None
                server0 = cpu_seconds(sandbox.pid)
                command = [sys.executable, __file__, "--client", name, "--url", sandbox.api_url, "--requests", str(total),
                           "--in-flight", str(args.in_flight)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                server = cpu_seconds(sandbox.pid) - server0
            result = json.loads(done.stdout.strip().splitlines()[-1])
            p50, p99 = quantiles(result["latencies"])
            rate = total / result["wall"]
            cpu_ms, server_ms = result["cpu"] * 1000 / total, server * 1000 / total
            rows.append(f"{name:<13}{total:>9}{rate:>8.0f}{rate / bound:>9.0%}{cpu_ms:>19.3f}"
                        f"{result['rss_mb']:>12.0f}{p50 * 1000:>8.0f}{p99 * 1000:>8.0f}{server_ms:>20.3f}")  # fmt: skip
            print(rows[-1] if len(rows) > 1 else header + "\n" + rows[-1], flush=True)


if __name__ == "__main__":
    main()
