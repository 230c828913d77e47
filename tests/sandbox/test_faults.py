"""Faults over real HTTP on loopback: what a client sees, and what gets billed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict

from quanthunt.sandbox.server import SandboxProcess

Start = Callable[[dict[str, Any]], SandboxProcess]
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def usage_of(sandbox: SandboxProcess) -> float:
    return float(httpx.get(f"{sandbox.api_url}/key", headers=AUTH).json()["data"]["usage"])


def one_fault(start: Start, fault: str, **extra: Any) -> SandboxProcess:
    return start(roster_dict(provider("a", faults={fault: 1.0, **extra})))


def test_timeout_sends_headers_then_holds_the_body_and_bills(latency_sandbox: Start) -> None:
    sandbox = one_fault(latency_sandbox, "timeout", timeout_s=30)
    client = httpx.Client(timeout=httpx.Timeout(5.0, read=0.5))
    with client, client.stream("POST", f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH) as reply:
        assert reply.status_code == 200
        gen_id = reply.headers["x-generation-id"]
        with pytest.raises(httpx.ReadTimeout):
            reply.read()
    assert usage_of(sandbox) > 0  # the provider did the work: possibly billed, reconcile by id
    record = httpx.get(f"{sandbox.api_url}/generation", params={"id": gen_id}, headers=AUTH).json()["data"]
    assert record["total_cost"] == pytest.approx(usage_of(sandbox))


@pytest.mark.parametrize(("fault", "billed"), [("connection_reset", False), ("truncated_body", True)])
def test_dropped_connections(latency_sandbox: Start, fault: str, billed: bool) -> None:
    sandbox = one_fault(latency_sandbox, fault)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert (usage_of(sandbox) > 0) is billed


def test_malformed_json_is_a_billed_200(latency_sandbox: Start) -> None:
    sandbox = one_fault(latency_sandbox, "malformed_json")
    reply = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert reply.status_code == 200
    with pytest.raises(ValueError):
        reply.json()
    assert usage_of(sandbox) > 0


def test_rate_limit_without_retry_after(latency_sandbox: Start) -> None:
    sandbox = one_fault(latency_sandbox, "rate_limit_no_retry_after")
    reply = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert reply.status_code == 429
    assert "retry-after" not in reply.headers


def test_fallback_to_the_next_provider_is_recorded(latency_sandbox: Start) -> None:
    sandbox = latency_sandbox(roster_dict(provider("bad", faults={"server_error": 1.0}), provider("good")))
    reply = httpx.post(
        f"{sandbox.api_url}/chat/completions", json={**BODY, "provider": {"order": ["bad", "good"]}}, headers=AUTH
    ).json()
    assert reply["provider"] == "Good"
    record = httpx.get(f"{sandbox.api_url}/generation", params={"id": reply["id"]}, headers=AUTH).json()["data"]
    assert [(a["provider_name"], a["status"]) for a in record["provider_responses"]] == [("Bad", 500), ("Good", 200)]
    no_fallback = httpx.post(
        f"{sandbox.api_url}/chat/completions",
        json={**BODY, "provider": {"order": ["bad", "good"], "allow_fallbacks": False}},
        headers=AUTH,
    )
    assert no_fallback.status_code == 500


def test_token_bucket_rate_limit(latency_sandbox: Start) -> None:
    sandbox = latency_sandbox(roster_dict(provider("a", rate_limit={"rps": 0.5, "burst": 1})))
    first = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    second = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert first.status_code == 200
    assert second.status_code == 429
    assert float(second.headers["retry-after"]) > 0


def test_in_flight_reservations_answer_402_with_retry_after(latency_sandbox: Start) -> None:
    # Each request may cost up to 100 output tokens * $0.01 = $1; the key has $3.
    expensive = provider("a", pricing={"prompt": "0", "completion": "0.01"}, latency_ms=1500)
    sandbox = latency_sandbox({**roster_dict(expensive), "credits": {"default_usd": 3}})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            body = {**BODY, "max_tokens": 100}
            return await asyncio.gather(
                *(client.post(f"{sandbox.api_url}/chat/completions", json=body, headers=AUTH) for _ in range(6))
            )

    replies = asyncio.run(burst())
    assert sorted(r.status_code for r in replies) == [200, 200, 200, 402, 402, 402]
    refused = [r for r in replies if r.status_code == 402]
    assert all(r.json()["error"]["metadata"]["limit_source"] == "openrouter_in_flight_budget" for r in refused)
    assert all(r.headers["retry-after"] == "1" for r in refused)


def test_mixture_is_deterministic_for_seeded_requests(latency_sandbox: Start) -> None:
    sandbox = latency_sandbox(roster_dict(provider("a", mixture={"nvfp4": 0.5})))

    def served(seeds: range) -> dict[str, int]:
        with httpx.Client(base_url=sandbox.api_url, headers=AUTH) as client:
            before = client.get("/sandbox/stats").json()["precisions"]
            for seed in seeds:
                client.post("/chat/completions", json={**BODY, "seed": seed})
            after = client.get("/sandbox/stats").json()["precisions"]
        return {k: after.get(k, 0) - before.get(k, 0) for k in after}

    first, again = served(range(40)), served(range(40))
    assert first == again
    assert 8 <= first["nvfp4"] <= 32  # about half of 40


def test_drift_changes_the_precision_after_n_requests_unseen_by_clients(latency_sandbox: Start) -> None:
    sandbox = latency_sandbox(roster_dict(provider("a", drift=[{"after_requests": 3, "precision": "nvfp4"}])))
    with httpx.Client(base_url=sandbox.api_url, headers=AUTH) as client:

        def listings() -> str:
            return client.get("/models").text + client.get(f"/models/{MODEL_ID}/endpoints").text

        def serve(n: int) -> tuple[dict[str, int], dict[str, int | None]]:
            replies = [client.post("/chat/completions", json=BODY) for _ in range(n)]
            assert [r.status_code for r in replies] == [200] * n
            assert not any(word in r.text for r in replies for word in ("drift", "nvfp4"))
            stats = client.get("/sandbox/stats").json()
            return stats["precisions"], stats["drift"]

        before = listings()
        assert not any(word in before for word in ("drift", "after_requests", "nvfp4"))  # the truth stays hidden
        assert serve(2) == ({"int4-native": 2}, {"a/int4": None})
        assert serve(1) == ({"int4-native": 3}, {"a/int4": 0})  # requests 1-3: the old truth; the drift is now due
        assert serve(2) == ({"int4-native": 3, "nvfp4": 2}, {"a/int4": 0})  # 4 on: re-quantized
        assert listings() == before  # still declares int4; nothing shows the change


def test_credits_can_be_topped_up(latency_sandbox: Start) -> None:
    sandbox = latency_sandbox({**roster_dict(provider("a")), "credits": {"default_usd": 0}})
    assert httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH).status_code == 402
    topped = httpx.post(f"{sandbox.api_url}/sandbox/credits", json={"add_usd": 1}, headers=AUTH)
    assert topped.json()["data"]["limit_remaining"] == 1
    assert httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH).status_code == 200


def test_empty_answer_is_a_billed_200_with_only_reasoning(latency_sandbox: Start, contract: Callable[[str, Any], None]) -> None:
    sandbox = one_fault(latency_sandbox, "empty_answer")
    reply = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert reply.status_code == 200
    body = reply.json()
    contract("ChatResult", body)
    (choice,) = body["choices"]
    assert choice["message"]["content"] is None and choice["message"]["reasoning"]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    assert usage_of(sandbox) == pytest.approx(body["usage"]["cost"]) and usage_of(sandbox) > 0


def test_error_200_is_a_top_level_error_and_not_billed(latency_sandbox: Start) -> None:
    sandbox = one_fault(latency_sandbox, "error_200")
    reply = httpx.post(f"{sandbox.api_url}/chat/completions", json=BODY, headers=AUTH)
    assert reply.status_code == 200
    assert reply.json() == {"error": {"code": 502, "message": "Provider returned error", "metadata": {"provider_name": "A"}}}
    assert usage_of(sandbox) == 0
