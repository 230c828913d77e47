"""The auditor's requests: retries honour Retry-After and stop on permanent errors; a probe
request under its endpoint's adaptive limit (``Auditor.send``) that timed out is sent again
unchanged (the same probe, the same seed) under the lowered limit and counted as possibly
billed; a connection that never opened is retried as any transient failure and billed by
nobody; an endpoint that queues slows only its own probes (over loopback, latency mode)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.congestion import DESIGN, FAST, FAST_PROVIDERS, PROBES, QUEUEING, fastest, finishing_times
from fixtures.sandbox import roster_dict

from quanthunt.gateway import ApiKey, Gateway, GatewayError, chat_body
from quanthunt.ledger import open_ledger
from quanthunt.measurements import Audit
from quanthunt.paid_replies import PaidReplies
from quanthunt.reference import Reference
from quanthunt.sandbox.server import SandboxProcess
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
    limit = auditor.limits["alpha/x"]
    assert limit.cuts == 1 and limit.allowed == 2  # one in flight: cut to 1; a success: 2


def test_a_request_that_times_out_alone_uses_up_its_attempts() -> None:
    audit, bodies, auditor = audit_with([httpx.ReadTimeout] * 5)
    assert len(bodies) == 3  # the free retry under the cut, then max_attempts (2) with the gateway to itself
    assert audit.unusable == {"timeout": 1} and audit.possibly_billed == 3 and auditor.limits["alpha/x"].cuts == 1


def test_a_connection_that_never_opened_is_not_possibly_billed() -> None:
    audit, bodies, auditor = audit_with([httpx.ConnectTimeout])
    assert len(bodies) == 2 and audit.errors == {"connect": 1}
    assert audit.possibly_billed == 0 and auditor.limits["alpha/x"].cuts == 0


# -- a slow endpoint slows only its own probes ------------------------------------------------


def test_a_queueing_endpoint_slows_only_its_own_probes(latency_sandbox: Callable[..., SandboxProcess]) -> None:
    """Issue 27: with one limit for every endpoint, the queueing one's timeouts cut it for all
    and the fast ones took 6.4 s and 7.4 s instead of the 1.2 s and 2.3 s they took alone;
    now each endpoint's timeouts cut only its own limit. Only the queueing endpoint's limit
    is ever cut, and the fast ones finish within half as long again as alone, which the
    shared limit's 5x fails. How close to alone they finish (within 20 %) is a timing, printed
    by ``benchmarks/slow_endpoint.py``: a busy CI machine measured 1.48 s alone and 1.79 s
    together here, best of two each."""
    sandbox = latency_sandbox(roster_dict(QUEUEING, *FAST_PROVIDERS))
    finishing_times(sandbox, FAST)  # warm: the first audit of a fresh sandbox is the slowest on a loaded machine
    # A busy test machine can only slow a run down (measured once: 1.75 s alone, then 1.12 s
    # with the queueing endpoint), so each side is the fastest of two runs.
    alone = fastest(finishing_times(sandbox, FAST)[0] for _ in range(2))
    runs = [finishing_times(sandbox, ("slow", *FAST)) for _ in range(2)]  # listed first: its requests go out first
    together = fastest(times for times, _, _ in runs)
    print(f"\nfast endpoints alone {alone}, with the queueing one {together}")
    for _, audits, auditor in runs:
        assert audits["slow"].errors["timeout"] > 0, "the queueing endpoint never timed out: nothing tests its congestion"
        assert auditor.limits["slow/int4"].cuts > 0
        for slug in FAST:
            assert auditor.limits[f"{slug}/int4"].cuts == 0
            assert len(audits[slug].logprob) == len(PROBES) and not audits[slug].errors, audits[slug]
    for slug in FAST:
        assert together[slug] <= 1.5 * alone[slug], (slug, alone, together)


# -- paid probe replies are used again, never bought twice -----------------------------------


def ask_twice(tmp_path: Path, *, gateways: tuple[str, str] = ("gw", "gw"), max_age_s: float = 3600) -> tuple[list[Audit], int]:
    """Two runs ask the same probe request, each with the ledger's paid replies; returns
    their audits and how many requests reached the gateway."""
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=REPLY | {"id": f"gen-{len(sent)}"})

    async def run(gateway_identity: str, run_id: str) -> Audit:
        ledger = open_ledger("sqlite:///state/ledger.sqlite", tmp_path)
        paid = PaidReplies(ledger, gateway=gateway_identity, run_id=run_id, max_age_s=max_age_s)
        gateway = Gateway("http://127.0.0.1/api/v1", api_key=ApiKey("k"), transport=httpx.MockTransport(handler))
        try:
            async with paid, gateway, Reference("http://127.0.0.1/api/v1", model="m/x") as reference:
                auditor = Auditor(gateway, reference, DESIGN, concurrency=4, paid=paid)
                audit = Audit("Alpha", "alpha/x", "sample")
                reply = await auditor._ask(audit, PROBES[0], 0, logprobs=False)
                assert reply.content == "hi" and reply.id in {"gen-1", "gen-2"}
                return audit
        finally:
            ledger.close()

    audits = [asyncio.run(run(identity, f"run-{i}")) for i, identity in enumerate(gateways)]
    return audits, len(sent)


def test_a_probe_reply_an_earlier_run_bought_is_used_again_with_its_cost(tmp_path: Path) -> None:
    (first, second), sent = ask_twice(tmp_path)
    assert sent == 1
    assert (first.reused, first.cost_usd, first.reused_cost_usd) == (0, 0.001, 0.0)
    assert (second.reused, second.cost_usd, second.reused_cost_usd) == (1, 0.001, 0.001)
    assert second.served_by == first.served_by == {"Alpha": 1} and second.tokens == first.tokens == 1


def test_a_reply_is_bought_again_for_another_gateway_or_when_reuse_is_off(tmp_path: Path) -> None:
    (_, other), sent = ask_twice(tmp_path / "a", gateways=("sandbox:roster-1", "sandbox:roster-2"))
    assert sent == 2 and other.reused == 0
    (_, again), sent = ask_twice(tmp_path / "b", max_age_s=0)
    assert sent == 2 and again.reused == 0 and again.reused_cost_usd == 0
