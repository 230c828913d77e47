"""The auditor's requests: retries honour Retry-After and stop on permanent errors; a probe
request under the auditor's adaptive limit (``Auditor.send``) that timed out is sent again
unchanged (the same probe, the same seed) under the lowered limit and counted as possibly
billed; a connection that never opened is retried as any transient failure and billed by
nobody."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import pytest
from fixtures.params import SHIPPED

from quanthunt.gateway import ApiKey, Gateway, GatewayError, chat_body
from quanthunt.measurements import Audit
from quanthunt.probes import Design
from quanthunt.reference import Reference
from quanthunt.verification import Auditor, with_retries


def test_retries_honour_retry_after_and_stop_on_permanent_errors() -> None:
    calls: list[str] = []

    async def flaky() -> str:
        calls.append("x")
        if len(calls) < 3:
            raise GatewayError("busy", status=429, retry_after_s=0.01)
        return "ok"

    errors: Counter[str] = Counter()
    assert asyncio.run(with_retries(flaky, attempts=3, errors=errors)) == "ok"
    assert errors == {"http_429": 2}

    async def refused() -> str:
        raise GatewayError("bad request", status=400)

    with pytest.raises(GatewayError):
        asyncio.run(with_retries(refused, attempts=5, errors=errors))
    assert errors["http_400"] == 1


REPLY = {
    "id": "gen-1",
    "model": "m/x",
    "provider": "Alpha",
    "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cost": 0.001},
}
DESIGN = Design(model="m/x", seed=0, completions_per_prompt=1, sample_mode_completions_per_prompt=1, max_tokens=8,
                temperature=1.0, top_logprobs=5, max_attempts=2, reasoning=SHIPPED.reasoning)  # fmt: skip


def audit_with(failures: list[type[httpx.TimeoutException]]) -> tuple[Audit, list[Any], Auditor]:
    """Send one probe request through a gateway that fails with ``failures`` first."""
    bodies: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if len(bodies) <= len(failures):
            raise failures[len(bodies) - 1]("slow", request=request)
        return httpx.Response(200, json=REPLY)

    async def scenario() -> tuple[Audit, Auditor]:
        gateway = Gateway("http://127.0.0.1/api/v1", api_key=ApiKey("k"), transport=httpx.MockTransport(handler))
        async with gateway, Reference("http://127.0.0.1/api/v1", model="m/x") as reference:
            auditor = Auditor(gateway, reference, DESIGN, concurrency=64)
            audit = Audit("Alpha", "alpha/x", "sample")
            body = chat_body(model="m/x", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1234)
            try:
                await auditor.send(body, audit)
            except GatewayError as exc:
                audit.unusable_completion(exc.kind)
            return audit, auditor

    audit, auditor = asyncio.run(scenario())
    return audit, bodies, auditor


def test_timeouts_are_retried_unchanged_under_the_lower_limit_and_counted_possibly_billed() -> None:
    audit, bodies, auditor = audit_with([httpx.ReadTimeout] * 2)
    assert len(bodies) == 3 and all(b == bodies[0] for b in bodies) and bodies[0]["seed"] == 1234
    assert audit.possibly_billed == 2 and audit.errors == {"timeout": 2} and not audit.unusable
    assert auditor.limit.cuts == 1 and auditor.limit.allowed == 2  # one in flight: cut to 1; a success: 2


def test_a_request_that_times_out_alone_uses_up_its_attempts() -> None:
    audit, bodies, auditor = audit_with([httpx.ReadTimeout] * 5)
    assert len(bodies) == 3  # the free retry under the cut, then max_attempts (2) with the gateway to itself
    assert audit.unusable == {"timeout": 1} and audit.possibly_billed == 3 and auditor.limit.cuts == 1


def test_a_connection_that_never_opened_is_not_possibly_billed() -> None:
    audit, bodies, auditor = audit_with([httpx.ConnectTimeout])
    assert len(bodies) == 2 and audit.errors == {"connect": 1}
    assert audit.possibly_billed == 0 and auditor.limit.cuts == 0
