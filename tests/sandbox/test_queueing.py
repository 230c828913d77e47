"""A loaded provider (``max_concurrent``): it generates that many requests at once and
queues the rest, and a request whose client gave up waiting is still generated and billed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict

from quanthunt.sandbox.server import SandboxProcess

BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def test_a_provider_serves_its_slots_and_queues_the_rest(latency_sandbox: Callable[[dict[str, Any]], SandboxProcess]) -> None:
    sandbox = latency_sandbox(roster_dict(provider("a", latency_ms=300, max_concurrent=2)))

    async def six() -> tuple[list[float], list[str]]:
        async with httpx.AsyncClient(base_url=sandbox.api_url, headers=AUTH, timeout=30) as client:

            async def one() -> tuple[float, str]:
                started = time.monotonic()
                reply = await client.post("/chat/completions", json=BODY)
                return time.monotonic() - started, reply.raise_for_status().json()["id"]

            done = await asyncio.gather(*(one() for _ in range(6)))
            return sorted(s for s, _ in done), [g for _, g in done]

    waits, _ = asyncio.run(six())
    assert waits[1] < 0.6 and waits[-1] >= 0.85, waits  # two at a time: three waves of 0.3 s


def test_a_request_abandoned_in_the_queue_is_still_generated_and_billed(
    latency_sandbox: Callable[[dict[str, Any]], SandboxProcess],
) -> None:
    sandbox = latency_sandbox(roster_dict(provider("a", latency_ms=400, max_concurrent=1)))

    async def two() -> None:
        async with httpx.AsyncClient(base_url=sandbox.api_url, headers=AUTH, timeout=httpx.Timeout(5, read=0.6)) as client:
            first = asyncio.ensure_future(client.post("/chat/completions", json=BODY))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.ReadTimeout):  # behind the first one: 0.8 s until its reply
                await client.post("/chat/completions", json=BODY)
            (await first).raise_for_status()

    asyncio.run(two())
    time.sleep(0.5)  # the abandoned one finishes
    stats = httpx.get(f"{sandbox.api_url}/sandbox/stats", headers=AUTH).json()
    assert stats["served"] == {"a/int4": 2} and stats["key"]["requests_billed"] == 2, stats
