"""The OpenRouter client: requests match the spec, replies and failures are typed,
and the key never leaks. Against the sandbox over loopback and in-process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.sandbox import MODEL_ID, provider, roster_dict

from quanthunt.errors import ConfigError
from quanthunt.gateway import (
    TRANSIENT,
    ApiKey,
    Gateway,
    GatewayError,
    Routing,
    chat_body,
    error_from,
    parse_chat_reply,
    resolve_api_key,
    retry_after_seconds,
)
from quanthunt.generation import OUT_OF_MONEY
from quanthunt.replies import same_provider
from quanthunt.sandbox.app import create_app
from quanthunt.sandbox.engine import LatencyEngine
from quanthunt.sandbox.roster import Roster, load_roster
from quanthunt.sandbox.server import SandboxProcess
from quanthunt.urls import check_base_url

Contract = Callable[[str, Any], None]
KEY = ApiKey("sk-or-v1-test-0000000000000000")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def in_process(roster: Roster | None = None) -> Gateway:
    default = load_roster()
    roster = roster or default.model_copy(
        update={"providers": tuple(p.model_copy(update={"latency_ms": 0.0}) for p in default.providers)}
    )
    app = create_app(roster, LatencyEngine(reply_tokens=8))
    return Gateway("http://127.0.0.1/api/v1", api_key=KEY, transport=httpx.ASGITransport(app=app))


@pytest.mark.parametrize(
    "routing",
    [
        None,
        Routing.pinned("moonshotai/int4"),
        Routing(order=("a", "b"), allow_fallbacks=True, quantizations=("int4", "unknown"), data_collection="deny", sort="price"),
        Routing(ignore=("together",), require_parameters=True),
    ],
)
def test_request_bodies_validate_against_the_spec(contract: Contract, routing: Routing | None) -> None:
    body = chat_body(
        model=MODEL_ID, messages=MESSAGES, max_tokens=32, temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"],
        logprobs=True, top_logprobs=5, routing=routing,
    )  # fmt: skip
    contract("ChatRequest", body)
    if routing is not None:
        contract("ProviderPreferences", body["provider"])


def test_the_client_sends_what_chat_body_builds(contract: Contract) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, json={"error": {"code": 500, "message": "stop here"}})

    body = chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=8, routing=Routing.pinned("x"))
    gateway = Gateway("https://gateway.example/api/v1", api_key=KEY, transport=httpx.MockTransport(handler))
    with pytest.raises(GatewayError):
        run(gateway.chat(body))
    sent = json.loads(seen[0].content)
    assert sent == body
    contract("ChatRequest", sent)
    assert seen[0].headers["authorization"] == f"Bearer {KEY.reveal()}"
    assert seen[0].url == "https://gateway.example/api/v1/chat/completions"


def test_endpoints_chat_generation_and_key_in_process() -> None:
    async def scenario() -> None:
        async with in_process() as gw:
            endpoints = await gw.endpoints(MODEL_ID)
            assert {e.provider_name for e in endpoints} >= {"Moonshot AI", "Chutes", "Novita"}
            novita = next(e for e in endpoints if e.provider_name == "Novita")
            assert not novita.supports_logprobs
            fireworks = next(e for e in endpoints if e.provider_name == "Fireworks")
            assert fireworks.usd_per_million() == pytest.approx((0.6 * 0.96, 2.5 * 0.96))
            reply = await gw.chat(
                chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=8, logprobs=True, routing=Routing.pinned("chutes"))
            )
            assert reply.provider == "Chutes" and reply.usage is not None and reply.usage.completion_tokens == 8
            assert reply.logprobs is not None and len(reply.logprobs) == 8
            assert reply.generation_id and reply.generation_id.startswith("gen-")
            generation = await gw.generation(reply.generation_id)
            assert generation.provider_name == "Chutes" and generation.total_cost == pytest.approx(reply.usage.cost)
            key = await gw.key()
            assert key.usage == pytest.approx(reply.usage.cost)

    run(scenario())


@pytest.mark.parametrize(
    ("setup", "request_kind", "status", "kind"),
    [
        ({}, "unknown_model", 404, "http_404"),
        ({}, "filtered", 404, "constraint_filtered"),
        ({"credits": {"default_usd": 0}}, "chat", 402, "openrouter_credits"),
        ({"faults": {"rate_limit": 1.0, "retry_after_s": 7}}, "chat", 429, "http_429"),
        ({"faults": {"unavailable": 1.0}}, "chat", 503, "http_503"),
        ({"faults": {"finish_error": 1.0}}, "chat", 200, "finish_error"),
    ],
)
def test_failures_are_typed(setup: dict[str, Any], request_kind: str, status: int, kind: str) -> None:
    credits = setup.get("credits")
    entry = provider("a", faults=setup.get("faults", {}))
    roster = Roster.model_validate({**roster_dict(entry), **({"credits": credits} if credits else {})})

    async def scenario() -> GatewayError:
        async with in_process(roster) as gw:
            with pytest.raises(GatewayError) as info:
                if request_kind == "unknown_model":
                    await gw.endpoints("acme/nothing")
                elif request_kind == "filtered":
                    await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4, routing=Routing.pinned("nobody")))
                else:
                    await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4))
            return info.value

    error = run(scenario())
    assert (error.status, error.kind) == (status, kind)
    assert KEY.reveal() not in str(error)
    if kind == "http_429":
        assert error.retry_after_s == 7


def test_transport_failures_over_loopback(latency_sandbox: Callable[..., SandboxProcess]) -> None:
    sandbox = latency_sandbox(
        roster_dict(provider("reset", faults={"connection_reset": 1.0}), provider("bad", faults={"malformed_json": 1.0}))
    )

    async def scenario() -> tuple[GatewayError, GatewayError]:
        async with Gateway(sandbox.api_url, api_key=KEY) as gw:
            with pytest.raises(GatewayError) as reset:
                await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4, routing=Routing.pinned("reset")))
            with pytest.raises(GatewayError) as bad:
                await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4, routing=Routing.pinned("bad")))
            return reset.value, bad.value

    reset, bad = run(scenario())
    assert reset.kind == "disconnect"
    assert bad.kind == "malformed" and bad.generation_id  # billed: reconcilable through /generation


def test_unreachable_gateway_is_one_clear_line() -> None:
    async def scenario() -> GatewayError:
        async with Gateway("http://127.0.0.1:9/api/v1", api_key=KEY) as gw:
            with pytest.raises(GatewayError) as info:
                await gw.endpoints(MODEL_ID)
            return info.value

    error = run(scenario())
    assert error.kind == "connect"
    assert str(error).startswith("cannot reach 127.0.0.1:9")
    assert "\n" not in str(error)


def test_base_urls_and_keys() -> None:
    assert check_base_url("https://openrouter.ai/api/v1/") == "https://openrouter.ai/api/v1"
    assert check_base_url("http://localhost:8000/v1") == "http://localhost:8000/v1"
    with pytest.raises(ValueError, match="plain http"):
        check_base_url("http://openrouter.ai/api/v1")
    with pytest.raises(ConfigError, match="gateway base URL plain http"):
        Gateway("http://10.0.0.5/api/v1", api_key=KEY)
    assert resolve_api_key("https://openrouter.ai/api/v1", {"OPENROUTER_API_KEY": " sk-x "}).reveal() == "sk-x"
    assert resolve_api_key("http://127.0.0.1:1/api/v1", {}).reveal() == "sk-quanthunt-sandbox"
    with pytest.raises(ConfigError, match="OPENROUTER_API_KEY is not set"):
        resolve_api_key("https://openrouter.ai/api/v1", {})
    assert KEY.reveal() not in repr(KEY) and KEY.reveal() not in f"{KEY}"


def test_retry_after_parsing() -> None:
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("Wed, 02 Dec 2026 12:00:10 GMT", now=1796212800.0) == pytest.approx(10.0)
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None
    assert retry_after_seconds("-4") == 0.0


def refused_chat(roster: Roster) -> GatewayError:
    """The error a chat request to an in-process gateway on ``roster`` raises."""

    async def scenario() -> GatewayError:
        async with in_process(roster) as gw:
            with pytest.raises(GatewayError) as info:
                await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4))
            return info.value

    return run(scenario())


def test_a_402_without_a_limit_source_is_out_of_money() -> None:
    # The spec's own 402 example carries no error.metadata; only the in-flight budget's 402 is worth waiting for.
    spec_example = error_from(402, "Payment Required", b'{"error": {"code": 402, "message": "Insufficient credits"}}', {}, "x")
    assert spec_example.kind in OUT_OF_MONEY
    error = refused_chat(
        Roster.model_validate(roster_dict(provider("a"), credits={"default_usd": 0, "limit_source_in_402": False}))
    )
    assert error.status == 402 and error.kind in OUT_OF_MONEY


def test_an_http_200_with_a_top_level_error_is_a_typed_failure() -> None:
    error = refused_chat(Roster.model_validate(roster_dict(provider("a", faults={"error_200": 1.0}))))
    assert (error.status, error.kind) == (200, "http_502") and error.kind in TRANSIENT
    assert "Provider returned error" in str(error)
    with pytest.raises(GatewayError) as info:
        parse_chat_reply(b'{"error": {"code": "overloaded", "message": "try later"}}', None, "gw")
    assert (info.value.status, info.value.kind) == (200, "provider_error")


def test_generation_lookup_waits_out_the_lag() -> None:
    roster = Roster.model_validate(roster_dict(provider("a"), generation_lookup_delay_s=1.0))

    async def scenario() -> tuple[float, float, float]:
        async with in_process(roster) as gw:
            reply = await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4))
            assert reply.generation_id and reply.usage is not None and reply.usage.cost
            record = await gw.generation(reply.generation_id)  # asked at once: 404 for the first second
            started = time.monotonic()
            with pytest.raises(GatewayError, match="404"):
                await gw.generation("gen-never", lag_s=0.3)
            return record.total_cost, reply.usage.cost, time.monotonic() - started

    looked_up, paid, gave_up_after = run(scenario())
    assert looked_up == pytest.approx(paid)
    assert 0.3 <= gave_up_after < 3


def test_a_reply_may_name_its_provider_by_slug() -> None:
    deepinfra = provider("deepinfra", name="DeepInfra", tag="deepinfra/fp4", reply_provider_as="slug")
    roster = Roster.model_validate(roster_dict(deepinfra))

    async def scenario() -> str | None:
        async with in_process(roster) as gw:
            reply = await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4))
            return reply.provider

    named = run(scenario())
    assert named == "deepinfra"
    assert same_provider(named, "DeepInfra", "deepinfra/fp4") and same_provider("DEEPINFRA", "DeepInfra", "deepinfra/fp4")
    assert not same_provider("Chutes", "DeepInfra", "deepinfra/fp4") and not same_provider(None, "DeepInfra", "deepinfra")


def test_a_pin_on_a_base_slug_ignores_its_variants() -> None:
    base = provider("deepinfra", name="DeepInfra", tag="deepinfra")
    turbo = provider("deepinfra", name="DeepInfra", tag="deepinfra/turbo", pricing={"prompt": "0", "completion": "0"})
    roster = Roster.model_validate(roster_dict(base, turbo, provider("chutes")))
    tags = tuple(p.tag for p in roster.providers)
    assert Routing().pin("deepinfra", siblings=tags).ignore == ("deepinfra/turbo",)
    assert Routing().pin("deepinfra/turbo", siblings=tags).ignore is None  # a variant tag names one endpoint

    async def served_by(routing: Routing) -> set[str]:
        endpoints = set()
        async with in_process(roster) as gw:
            for _ in range(8):
                reply = await gw.chat(chat_body(model=MODEL_ID, messages=MESSAGES, max_tokens=4, routing=routing))
                assert reply.generation_id
                record = await gw.generation(reply.generation_id)
                endpoints |= {str(r["endpoint_id"]) for r in record.provider_responses or []}
        return endpoints

    assert run(served_by(Routing.pinned("deepinfra"))) == {"deepinfra/turbo"}  # the free variant wins the load balancing
    assert run(served_by(Routing().pin("deepinfra", siblings=tags))) == {"deepinfra"}
