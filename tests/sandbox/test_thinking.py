"""The reasoning profile: the thinking template's prompt, and reasoning, the forced end of
the thinking block and the answer sharing one ``max_tokens`` budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fixtures.sandbox import AUTH, MODEL_ID, provider, roster_dict
from starlette.testclient import TestClient

from quanthunt.sandbox import thinking
from quanthunt.sandbox.engine import Completion, LatencyEngine, SamplingRequest
from quanthunt.sandbox.roster import Thinking

PROFILE = Thinking(think_tokens=6, open="<think> ", close=" </think> ")
MESSAGES = [{"role": "user", "content": "hello there"}]


def complete(max_tokens: int, *, enabled: bool = True) -> Completion:
    engine = LatencyEngine(reply_tokens=32)
    prompt = thinking.prompt_ids(engine, MESSAGES, PROFILE, enabled=enabled)
    request = SamplingRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, seed=3, top_logprobs=2)
    return asyncio.run(thinking.complete(engine, "int4-native", request, PROFILE, enabled=enabled))


def test_the_template_opens_the_block_or_renders_it_empty() -> None:
    engine = LatencyEngine()
    base = engine.encode_chat(MESSAGES)
    assert thinking.prompt_ids(engine, MESSAGES, PROFILE, enabled=True) == base + engine.encode_text("<think> ")
    assert thinking.prompt_ids(engine, MESSAGES, PROFILE, enabled=False) == base + engine.encode_text("<think> </think> ")
    assert thinking.prompt_ids(engine, MESSAGES, None, enabled=True) == base


def test_reasoning_then_the_forced_close_then_the_answer_within_the_budget() -> None:
    done = complete(20)
    close = LatencyEngine().encode_text(" </think> ")
    assert len(done.tokens) == 20 and done.finish_reason == "length"
    assert done.reasoning == "".join(t.token.text for t in done.tokens[:6])
    assert [t.token.id for t in done.tokens[6 : 6 + len(close)]] == close
    assert done.text == "".join(t.token.text for t in done.tokens[6 + len(close) :])
    assert all(t.top for t in done.tokens[6 : 6 + len(close)])  # the forced close was scored, not made up


def test_a_budget_the_reasoning_eats_leaves_no_answer() -> None:
    done = complete(4)
    assert (done.text, done.finish_reason, len(done.tokens)) == ("", "length", 4)
    assert done.reasoning


def test_thinking_off_answers_at_once() -> None:
    done = complete(10, enabled=False)
    assert done.reasoning is None and len(done.tokens) == 10 and done.text


def test_gateway_and_reference_render_the_same_prompt_either_way(inprocess: Callable[..., TestClient]) -> None:
    """What the gateway's provider conditioned on (``usage.prompt_tokens``) is what the
    reference's tokenize route renders with the matching template switch."""
    client = inprocess(roster_dict(provider("alpha"), model={"reasoning": {"think_tokens": 3}}))
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 8}
    for reasoning, kwargs in ((None, None), ({"effort": "none"}, {"thinking": False})):
        sent = body | ({"reasoning": reasoning} if reasoning else {})
        reply = client.post("/api/v1/chat/completions", json=sent, headers=AUTH).json()
        tokenize = {"model": MODEL_ID, "messages": MESSAGES} | ({"chat_template_kwargs": kwargs} if kwargs else {})
        rendered = client.post("/reference/tokenize", json=tokenize).json()
        assert reply["usage"]["prompt_tokens"] == rendered["count"]
        assert (reply["choices"][0]["message"]["reasoning"] is None) == (reasoning is not None)


def test_mandatory_reasoning_cannot_be_turned_off(inprocess: Callable[..., TestClient]) -> None:
    client = inprocess(roster_dict(provider("alpha"), model={"reasoning": {"mandatory": True}}))
    models = client.get("/api/v1/models", headers=AUTH).json()["data"][0]
    assert models["reasoning"]["mandatory"] is True
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 8, "reasoning": {"effort": "none"}}
    reply = client.post("/api/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status_code == 400 and "mandatory" in reply.json()["error"]["message"]
