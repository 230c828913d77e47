"""Generation at 2,000 requests in flight: quanthunt's engine (ledger, budget and
provenance on) against the official openai SDK and raw aiohttp, side by side, against
the latency-mode sandbox (1 s latency), each client in its own process on asyncio's
standard event loop (what ``quanthunt generate`` runs on; uvloop was measured no faster
here: 0.37 ms against 0.39 ms of CPU a request, but 93-94 % of the bound against 98 %).

Usage: ``.venv/bin/python benchmarks/generation_throughput.py [--requests 20000] [--in-flight 2000] [--sdk-requests 4000]
[--clients quanthunt,raw-aiohttp,openai-sdk] [--ramp-up-s S]``

Prints per client: achieved requests/s over the whole run and in steady state (the
middle half of the completions, leaving out the first wave's connection set-up and the
last wave's tail), each against the Little's-law bound (in flight ÷ latency); client CPU
ms per request (the client's modules are imported before the clock starts; the engine's
ledger, sink and record-building are inside it); peak RSS; p50/p99 latency; and the
sandbox's own CPU per request over the same interval. The openai SDK runs fewer requests
(it costs ~10-20 ms of CPU each); its figures are per request all the same. quanthunt
runs with its params' default ``generate.ramp_up_s`` (its first wave spread over that
long) unless ``--ramp-up-s`` says otherwise; the peers send their first wave at once.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from quanthunt.params import load_params
from quanthunt.sandbox.server import SandboxProcess

MODEL = "huggingfacetb/smollm2-135m-instruct"
KEY = "sk-bench-key-000000"
ROOT = Path(__file__).resolve().parents[1]
RAMP_UP_S = load_params(ROOT / "params.yaml").generate.ramp_up_s
"""params.yaml's ``generate.ramp_up_s``, what ``quanthunt generate`` uses."""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantiles(latencies: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(latencies, n=100)
    return q[49], q[98]


def steady_rate(finished: list[float]) -> float:
    """Completions per second over the middle half of the completions."""
    times = sorted(finished)
    first, last = len(times) // 4, 3 * len(times) // 4
    return (last - first) / (times[last] - times[first])


Timings = tuple[list[float], list[float]]
"""Per request: latency (s) and when it finished (``time.time()``)."""


# -- the clients (each runs in a child process: `python this.py --client NAME ...`) -------------


async def raw_aiohttp(url: str, total: int, in_flight: int) -> Timings:
    import aiohttp

    gate, latencies, finished = asyncio.Semaphore(in_flight), [], []
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
                finished.append(time.time())

        await asyncio.gather(*(one() for _ in range(total)))
    return latencies, finished


async def openai_sdk(url: str, total: int, in_flight: int) -> Timings:
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=in_flight), timeout=600))  # fmt: skip
    gate, latencies, finished = asyncio.Semaphore(in_flight), [], []

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16)
            latencies.append(time.perf_counter() - start)
            finished.append(time.time())

    await asyncio.gather(*(one() for _ in range(total)))
    return latencies, finished


def bench_roster(latency_ms: float) -> dict[str, Any]:
    """The benchmarks' sandbox: one provider answering after ``latency_ms``, at no token rate limit."""
    provider = {"name": "Moonshot AI", "slug": "moonshotai", "tag": "moonshotai/int4", "quantization": "int4",
                "precision": "int4-native", "pricing": {"prompt": "0.0000006", "completion": "0.0000025"},
                "latency_ms": latency_ms, "throughput_tps": 1e9}  # fmt: skip
    return {"providers": [provider], "credits": {"default_usd": 1e6}}


def bench_job(in_flight: int, ramp_up_s: float = RAMP_UP_S, *, dataset: str = "bench", run_id: str = "bench") -> Any:
    """The benchmarks' job: one endpoint pinned, no spending cap to speak of, params.yaml's
    generate section otherwise (a short answer, six attempts)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.verdicts import eligible

    from quanthunt.gateway import Routing
    from quanthunt.jobs import Job
    from quanthunt.params import Retry, Sampling

    settings = load_params(ROOT / "params.yaml").generate.model_copy(
        update={"sampling": Sampling(temperature=0.7, top_p=1.0, max_tokens=16, seed=0), "max_usd_per_run": 1e6,
                "retry": Retry(max_attempts=6, base_delay_s=0.5, max_delay_s=30, empty_answer_max_tokens=None),
                "max_output_tokens": None, "ramp_up_s": ramp_up_s, "concurrency": in_flight}
    )  # fmt: skip
    provider = eligible("Moonshot AI", "moonshotai/int4", "int4", 6e-7, 2.5e-6)
    return Job(dataset=dataset, model=MODEL, settings=settings, providers=(provider,),
               routing=Routing(only=(provider.tag,), allow_fallbacks=False, require_parameters=True), params_hash="p" * 64,
               run_id=run_id, concurrency=in_flight, verification_run_id="bench")  # fmt: skip


def bench_records(total: int) -> Iterator[Any]:
    from quanthunt.prompts import PromptRecord, Turn

    return (PromptRecord(f"r{i}", (Turn("user", f"hello number {i}"),)) for i in range(total))


async def quanthunt_engine(url: str, total: int, in_flight: int, ramp_up_s: float = RAMP_UP_S) -> Timings:
    from quanthunt.aiohttp_chat import AiohttpChat
    from quanthunt.gateway import ApiKey
    from quanthunt.generation import Engine
    from quanthunt.ledger import LedgerWriter
    from quanthunt.ledger_sqlite import SqliteLedger
    from quanthunt.records import RecordSink

    work = Path(tempfile.mkdtemp(prefix="qh-bench-"))
    ledger = SqliteLedger(work / "ledger.sqlite")
    writer = LedgerWriter(ledger)
    writer.start()
    sink = RecordSink(work / "out.jsonl", writer, "bench", "p" * 64)
    sink.start()
    job = bench_job(in_flight, ramp_up_s)
    async with AiohttpChat(url, api_key=ApiKey(KEY)) as chat:
        engine = Engine(job, chat, ledger, writer, sink, done_turns={})
        await engine.run(bench_records(total))
    await sink.close()
    await writer.close()
    rows = ledger.db.execute("SELECT finished_at - started_at, finished_at FROM attempts WHERE outcome='ok'").fetchall()
    lines = sum(1 for _ in (work / "out.jsonl").open())
    assert lines == total, f"{lines} records written of {total}"
    return [float(r[0]) for r in rows], [float(r[1]) for r in rows]


CLIENTS = {"quanthunt": quanthunt_engine, "openai-sdk": openai_sdk, "raw-aiohttp": raw_aiohttp}
MODULES = {
    "quanthunt": (
        "aiohttp",
        "orjson",
        "quanthunt.aiohttp_chat",
        "quanthunt.generation",
        "quanthunt.jobs",
        "quanthunt.records",
        "quanthunt.ledger",
        "quanthunt.prompts",
    ),
    "openai-sdk": ("httpx", "openai"),
    "raw-aiohttp": ("aiohttp",),
}


def child(name: str, url: str, total: int, in_flight: int, out: Path, ramp_up_s: float) -> None:
    for module in MODULES[name]:
        importlib.import_module(module)
    start, cpu0 = time.perf_counter(), time.process_time()
    run = CLIENTS[name](url, total, in_flight, ramp_up_s) if name == "quanthunt" else CLIENTS[name](url, total, in_flight)
    latencies, finished = asyncio.run(run)  # the standard loop, as `quanthunt generate` runs it
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures = {"wall": wall, "cpu": cpu, "rss_mb": rss_mb, "latencies": latencies, "steady_rate": steady_rate(finished)}
    out.write_text(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--sdk-requests", type=int, default=4_000)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=1000)
    parser.add_argument("--clients", default="quanthunt,raw-aiohttp,openai-sdk", help="which clients, in order")
    parser.add_argument("--ramp-up-s", type=float, default=RAMP_UP_S,
                        help="quanthunt's generate.ramp_up_s (default: params.yaml's)")  # fmt: skip
    parser.add_argument("--client", choices=sorted(CLIENTS))
    parser.add_argument("--url")
    parser.add_argument("--out", type=Path, help="where a client writes its figures (JSON)")
    args = parser.parse_args()
    if args.client:
        child(args.client, args.url, args.requests, args.in_flight, args.out, args.ramp_up_s)
        return
    roster = bench_roster(args.latency_ms)
    bound = args.in_flight / (args.latency_ms / 1000)
    print(f"latency-mode sandbox, {args.latency_ms:.0f} ms per request, {args.in_flight} in flight: "
          f"Little's-law bound {bound:.0f} req/s; quanthunt's first wave ramps up over {args.ramp_up_s:g} s")  # fmt: skip
    columns = [("client", 13), ("requests", 9), ("req/s", 7), ("of bound", 9), ("steady req/s", 13), ("of bound", 9),
               ("client CPU ms/req", 18), ("peak RSS MB", 12), ("p50 ms", 7), ("p99 ms", 7),
               ("sandbox CPU ms/req", 19)]  # fmt: skip
    header = "".join(f"{name:<{width}}" if i == 0 else f"{name:>{width}}" for i, (name, width) in enumerate(columns))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roster.yaml"
        path.write_text(yaml.safe_dump(roster))
        for name in args.clients.split(","):
            if name not in CLIENTS:
                parser.error(f"--clients: unknown client {name!r} (choose from {', '.join(sorted(CLIENTS))})")
            total = args.sdk_requests if name == "openai-sdk" else args.requests
            with SandboxProcess(mode="latency", roster=path) as sandbox:
                assert sandbox.pid is not None
                server0 = cpu_seconds(sandbox.pid)
                command = [sys.executable, __file__, "--client", name, "--url", sandbox.api_url, "--requests", str(total),
                           "--in-flight", str(args.in_flight), "--out", str(Path(tmp) / f"{name}.json"),
                           "--ramp-up-s", str(args.ramp_up_s)]  # fmt: skip
                subprocess.run(command, check=True)
                server = cpu_seconds(sandbox.pid) - server0
            result = json.loads((Path(tmp) / f"{name}.json").read_text())
            p50, p99 = quantiles(result["latencies"])
            rate = total / result["wall"]
            cpu_ms, server_ms = result["cpu"] * 1000 / total, server * 1000 / total
            steady = result["steady_rate"]
            rows.append(f"{name:<13}{total:>9}{rate:>7.0f}{rate / bound:>9.0%}{steady:>13.0f}{steady / bound:>9.0%}"
                        f"{cpu_ms:>18.3f}{result['rss_mb']:>12.0f}{p50 * 1000:>7.0f}{p99 * 1000:>7.0f}"
                        f"{server_ms:>19.3f}")  # fmt: skip
            print(rows[-1] if len(rows) > 1 else header + "\n" + rows[-1], flush=True)


if __name__ == "__main__":
    main()
