"""Every sandbox reply validates against schemas derived from OpenRouter's OpenAPI spec."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict
from starlette.testclient import TestClient

Contract = Callable[[str, Any], None]
CHAT = "/api/v1/chat/completions"


def chat(client: TestClient, **body: Any) -> Any:
    payload = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, **body}
    return client.post(CHAT, json=payload, headers=AUTH)


@pytest.fixture
def client(inprocess: Callable[..., TestClient]) -> TestClient:
    return inprocess()


def test_models_and_endpoints(client: TestClient, contract: Contract) -> None:
    models = client.get("/api/v1/models")
    assert models.status_code == 200
    contract("ModelsListResponse", models.json())
    reply = client.get(f"/api/v1/models/{MODEL_ID}/endpoints")
    assert reply.status_code == 200
    data = reply.json()["data"]
    contract("ListEndpointsResponse", data)
    assert len(data["endpoints"]) == 10  # DeepInfra has two
    for endpoint in data["endpoints"]:
        contract("PublicEndpoint", endpoint)
        assert "precision" not in json.dumps(endpoint)  # the truth stays hidden


def test_chat_result_generation_and_key(client: TestClient, contract: Contract) -> None:
    reply = chat(client, logprobs=True, top_logprobs=3, provider={"only": ["moonshotai"]})
    assert reply.status_code == 200
    body = reply.json()
    contract("ChatResult", body)
    assert body["provider"] == "Moonshot AI"
    assert reply.headers["x-generation-id"] == body["id"]
    usage = body["usage"]
    assert usage["completion_tokens"] == len(body["choices"][0]["logprobs"]["content"]) == 8
    assert usage["cost"] == pytest.approx(usage["prompt_tokens"] * 6e-7 + 8 * 2.5e-6)

    generation = client.get("/api/v1/generation", params={"id": body["id"]}, headers=AUTH)
    assert generation.status_code == 200
    contract("GenerationResponse", generation.json())
    data = generation.json()["data"]
    assert data["provider_name"] == "Moonshot AI"
    assert data["total_cost"] == usage["cost"]
    assert [a["status"] for a in data["provider_responses"]] == [200]

    key = client.get("/api/v1/key", headers=AUTH)
    contract("KeyResponse", key.json())
    assert key.json()["data"]["usage"] == pytest.approx(usage["cost"])
    assert key.json()["data"]["limit_remaining"] == pytest.approx(100 - usage["cost"])


def test_streaming_chunks(client: TestClient, contract: Contract) -> None:
    with client.stream(
        "POST",
        CHAT,
        json={
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "logprobs": True,
        },
        headers=AUTH,
    ) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for chunk in chunks:
        contract("ChatStreamingResponse", {"data": chunk})
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 5


def test_error_bodies(inprocess: Callable[..., TestClient], contract: Contract) -> None:
    client = inprocess()
    assert client.post(CHAT, json={}).status_code == 401
    contract("UnauthorizedResponse", client.post(CHAT, json={}).json())
    contract("BadRequestResponse", client.post(CHAT, content=b"{", headers=AUTH).json())
    contract("NotFoundResponse", client.get("/api/v1/models/nobody/nothing/endpoints").json())
    broke = inprocess({**roster_dict(provider("a")), "credits": {"default_usd": 0}})
    reply = chat(broke)
    assert reply.status_code == 402
    contract("PaymentRequiredResponse", reply.json())
    assert reply.json()["error"]["metadata"]["limit_source"] == "openrouter_credits"


@pytest.mark.parametrize(
    ("fault", "status", "schema"),
    [
        ("rate_limit", 429, "TooManyRequestsResponse"),
        ("server_error", 500, "InternalServerResponse"),
        ("bad_gateway", 502, "BadGatewayResponse"),
        ("unavailable", 503, "ServiceUnavailableResponse"),
    ],
)
def test_injected_error_bodies(
    inprocess: Callable[..., TestClient], contract: Contract, fault: str, status: int, schema: str
) -> None:
    client = inprocess(roster_dict(provider("a", faults={fault: 1.0, "retry_after_s": 2})))
    reply = chat(client)
    assert reply.status_code == status
    contract(schema, reply.json())
    assert ("retry-after" in reply.headers) == (fault == "rate_limit")
    if fault == "rate_limit":
        assert reply.headers["retry-after"] == "2"


def test_finish_reason_error_is_a_200_and_not_billed(inprocess: Callable[..., TestClient], contract: Contract) -> None:
    client = inprocess(roster_dict(provider("a", faults={"finish_error": 1.0})))
    reply = chat(client)
    assert reply.status_code == 200
    body = reply.json()
    contract("ChatResult", body)
    assert body["choices"][0]["finish_reason"] == "error"
    assert body["choices"][0]["error"]["code"] == 502
    assert body["usage"]["cost"] == 0
    assert client.get("/api/v1/key", headers=AUTH).json()["data"]["usage"] == 0
