"""Bad requests get the right status and a body naming the problem; never a crash."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict
from starlette.testclient import TestClient

CHAT = "/api/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(inprocess: Callable[..., TestClient]) -> TestClient:
    return inprocess()


def error_of(reply: Any) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == reply.status_code
    return dict(body["error"])


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "Malformed JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"\xff\xfe", 400, "Malformed JSON"),
        ({"model": "acme/nonexistent", "messages": MESSAGES}, 400, "acme/nonexistent is not a valid model ID"),
        ({"messages": MESSAGES}, 400, "model is required"),
        ({"model": MODEL_ID, "messages": []}, 400, "messages must be a non-empty array"),
        ({"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (
            {"model": MODEL_ID, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs must be between 0 and 20",
        ),
        ({"model": MODEL_ID, "messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs requires logprobs"),
        ({"model": MODEL_ID, "messages": MESSAGES, "temperature": 5}, 400, "temperature must be between"),
        ({"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"model": MODEL_ID, "messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens must be an integer"),
        ({"model": MODEL_ID, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be"),
        ({"model": MODEL_ID, "messages": MESSAGES, "provider": {"prefer": ["x"]}}, 400, "unknown field 'prefer'"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "maximum context length"),
    ],
)
def test_bad_chat_requests(client: TestClient, body: Any, status: int, message: str) -> None:
    if isinstance(body, bytes):
        reply = client.post(CHAT, content=body, headers={**AUTH, "content-type": "application/json"})
    else:
        reply = client.post(CHAT, json=body, headers=AUTH)
    assert reply.status_code == status
    assert message in error_of(reply)["message"]


@pytest.mark.parametrize("header", [None, "Bearer ", "Basic abc", "sk-no-scheme"])
def test_missing_or_malformed_key_is_401(client: TestClient, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    for reply in (
        client.post(CHAT, json={"model": MODEL_ID, "messages": MESSAGES}, headers=headers),
        client.get("/api/v1/key", headers=headers),
        client.get("/api/v1/generation", params={"id": "gen-x"}, headers=headers),
    ):
        assert reply.status_code == 401
        assert error_of(reply)["message"] == "Missing Authentication header"


def test_filters_that_leave_nothing_are_constraint_filtered(client: TestClient) -> None:
    reply = client.post(
        CHAT,
        json={
            "model": MODEL_ID,
            "messages": MESSAGES,
            "logprobs": True,
            "provider": {"only": ["novita"], "require_parameters": True},
        },
        headers=AUTH,
    )
    assert reply.status_code == 404
    assert error_of(reply)["availability"]["code"] == "constraint_filtered"


def test_unknown_routes_and_methods_answer_json(client: TestClient) -> None:
    assert error_of(client.get("/api/v1/nothing-here"))["code"] == 404
    assert error_of(client.get(CHAT))["code"] == 405
    assert error_of(client.get(f"/api/v1/models/{MODEL_ID}x/endpoints"))["code"] == 404


def test_generation_of_another_key_or_unknown_id_is_404(client: TestClient) -> None:
    gen_id = client.post(CHAT, json={"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2}, headers=AUTH).json()["id"]
    assert client.get("/api/v1/generation", params={"id": gen_id}, headers=AUTH).status_code == 200
    other = {"Authorization": "Bearer sk-someone-else"}
    assert client.get("/api/v1/generation", params={"id": gen_id}, headers=other).status_code == 404
    assert client.get("/api/v1/generation", params={"id": "gen-unknown"}, headers=AUTH).status_code == 404


def test_key_limits_from_the_roster(inprocess: Callable[..., TestClient]) -> None:
    client = inprocess(
        {**roster_dict(provider("a")), "credits": {"default_usd": 5, "keys": [{"key": "sk-tiny", "limit_usd": 1e-9}]}}
    )
    reply = client.post(CHAT, json={"model": MODEL_ID, "messages": MESSAGES}, headers={"Authorization": "Bearer sk-tiny"})
    assert reply.status_code == 402
    assert error_of(reply)["metadata"]["limit_source"] == "openrouter_key_limit"
    assert client.post(CHAT, json={"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2}, headers=AUTH).status_code == 200


def test_reference_bad_requests(client: TestClient) -> None:
    cases = [
        ({"prompt": 5}, 400, "prompt must be"),
        ({"prompt": "x", "logprobs": 21, "echo": True}, 400, "logprobs must be an integer between 0 and 20"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),  # vLLM's words
        ({"prompt": "x", "model": "other/model"}, 404, "does not exist"),
    ]
    for body, status, message in cases:
        reply = client.post("/reference/v1/completions", json=body)
        assert reply.status_code == status, body
        assert message in reply.json()["error"]["message"]


def test_latency_mode_serves_a_synthetic_reference(client: TestClient) -> None:
    reply = client.post(
        "/reference/v1/completions", json={"prompt": "the model answers", "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    assert reply.status_code == 200
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" the", " model", " answers"]
    assert logprobs["token_logprobs"] == [None, 0.0, 0.0]
