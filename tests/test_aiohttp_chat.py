"""The generation hot path's client: it waits as long as a long answer needs, and buys it once."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from fixtures.sandbox import MODEL_ID, provider, roster_dict
from test_gateway import KEY, MESSAGES, run

from quanthunt.aiohttp_chat import AiohttpChat
from quanthunt.gateway import chat_body
from quanthunt.sandbox.server import SandboxProcess


def test_a_slow_long_answer_is_waited_for_not_bought_twice(latency_sandbox: Callable[..., SandboxProcess]) -> None:
    # 40 tokens at 20 tokens/s take 2 s: longer than the 1 s base timeout, within 1 s + 40 tokens at the 10/s floor.
    sandbox = latency_sandbox(roster_dict(provider("slow", throughput_tps=20)))

    async def scenario() -> tuple[int, float]:
        async with AiohttpChat(sandbox.api_url, api_key=KEY, timeout_s=1.0) as chat:
            reply = await chat.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=40))
        stats = httpx.get(f"{sandbox.api_url}/sandbox/stats", headers={"Authorization": f"Bearer {KEY.reveal()}"}).json()
        assert reply.usage is not None
        return reply.usage.completion_tokens, stats["key"]["requests_billed"]

    tokens, billed = run(scenario())
    assert (tokens, billed) == (40, 1)
