"""The engine's compute thread: closing it answers every request it holds."""

from __future__ import annotations

import asyncio

import pytest

from quanthunt.errors import SandboxError
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model_engine import ModelEngine

pytestmark = pytest.mark.model


def test_closing_fails_running_and_waiting_requests_instead_of_leaving_them_hanging() -> None:
    engine = ModelEngine.load()
    ids = tuple(engine.encode_chat([{"role": "user", "content": "hi"}]))

    async def scenario() -> list[BaseException | object]:
        # 40 long requests: a lane runs 32 of them, the other 8 wait for a free row.
        requests = [SamplingRequest(ids, 500, seed=i, ignore_eos=True) for i in range(40)]
        tasks = [asyncio.ensure_future(engine.complete("int4-native", r)) for r in requests]
        await asyncio.sleep(1.0)
        engine.close()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)

    answers = asyncio.run(scenario())
    assert len(answers) == 40 and all(isinstance(a, SandboxError) for a in answers), answers
