"""The reference client against what real servers answer: recorded vLLM 0.32 replies
(``tests/contracts/replies/vllm``) replayed, and the sandbox in its SGLang flavour."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from fixtures.contracts import recorded, replay
from fixtures.sandbox import provider, roster_dict
from starlette.testclient import TestClient

from quanthunt.reference import PARTIAL, Capabilities, Reference, ReferenceDown, ReferenceUnusable, Scored
from quanthunt.replies import ChatReply

VLLM = recorded("vllm")


def vllm_reference() -> Reference:
    return Reference("http://127.0.0.1:8011/v1", transport=replay("vllm"))


def score_recorded(names: bool) -> tuple[Capabilities, Scored]:
    async def go() -> tuple[Capabilities, Scored]:
        async with vllm_reference() as ref:
            ids = VLLM["score-ids-max0"]["request"]["body"]["prompt"]
            return await ref.check(), await ref.score(ids, top_logprobs=5, names=names)

    return asyncio.run(go())


def test_check_finds_vllms_routes_before_anything_is_paid() -> None:
    """vLLM serves /tokenize at the server root (``/v1/tokenize`` is a 404), accepts
    ``max_tokens: 0`` under echo and names tokens by id on request."""
    caps, _ = score_recorded(names=False)
    assert caps.tokenize_url == "http://127.0.0.1:8011/tokenize"
    assert caps.score_max_tokens == 0 and caps.token_ids and caps.chat_ids_from_tokenize
    assert caps.model == "huggingfacetb/smollm2-135m-instruct"


def test_membership_in_the_top_k_is_decided_by_id_not_by_list_length() -> None:
    """Echoed positions list k or k+1 alternatives; the scored token is in the top k exactly
    when it is among the k likeliest ids, however long the list is."""
    _, scored = score_recorded(names=False)
    body = VLLM["score-ids-max0"]["body"]["choices"][0]["logprobs"]
    positions = [p for p in scored.positions if p is not None]
    assert len(positions) == len(scored.token_ids) - 1
    outside = 0
    for position, top in zip(positions, body["top_logprobs"][1:], strict=True):
        ranked = sorted(top.items(), key=lambda item: -item[1])[:5]
        truly_in = f"token_id:{position.token_id}" in dict(ranked)
        assert position.in_top(5) == truly_in
        outside += not truly_in
        assert len(position.outranked_by()) == (4 if truly_in else 5)
    assert outside > 5  # the recording has tail tokens, where a length rule goes wrong


def test_partial_utf8_pieces_are_named_as_vllm_names_them() -> None:
    """A piece of a character is ``""`` in vLLM's names; the names of the scored tokens of a
    text join back to it, and every alternative gets a name."""
    _, scored = score_recorded(names=True)
    text = VLLM["score-ids-max0"]["request"]["body"]["prompt"]
    assert len(text) == len(scored.token_ids)
    names = [p.names[p.key] for p in scored.positions if p is not None and p.names is not None]
    joined = "".join(names)
    assert joined.endswith(VLLM["tokenize-root-prompt"]["request"]["body"]["prompt"])
    assert PARTIAL in names  # the text's CJK characters span several tokens
    for p in scored.positions[1:]:
        assert p is not None and p.names is not None and set(p.names) == set(p.top)


def flaky_vllm(failures: list[int | type[httpx.TransportError]]) -> tuple[httpx.MockTransport, list[str]]:
    """The recorded vLLM, but its scoring requests after the first fail with ``failures``
    (a status, or a transport error) in turn; the paths asked, in order."""
    recorded_vllm = replay("vllm")
    asked: list[str] = []
    scoring = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal scoring
        asked.append(request.url.path)
        if request.url.path == "/v1/completions":
            scoring += 1
            if 2 <= scoring < 2 + len(failures):
                failure = failures[scoring - 2]
                if isinstance(failure, int):
                    return httpx.Response(failure, json={"error": {"message": "busy", "code": failure}})
                raise failure("stalled", request=request)
        return recorded_vllm.handle_request(request)

    return httpx.MockTransport(answer), asked


def test_after_check_a_stalled_reference_is_retried_and_each_failure_counted() -> None:
    transport, asked = flaky_vllm([503, httpx.ReadTimeout, httpx.ConnectError, 502])

    async def go() -> tuple[Scored, Reference]:
        async with Reference("http://127.0.0.1:8011/v1", transport=transport, retry_for_s=30) as ref:
            await ref.check()
            return await ref.score(VLLM["score-ids-max0"]["request"]["body"]["prompt"], top_logprobs=5), ref

    scored, ref = asyncio.run(go())
    assert scored.positions and asked.count("/v1/completions") == 1 + 5
    assert ref.retried == {"http_503": 1, "timeout": 1, "connect": 1, "http_502": 1}


def test_a_reference_down_past_its_patience_stops_the_run_and_none_is_asked_for_before_check() -> None:
    """Past ``retry_for_s`` a failure is ``ReferenceDown`` (the stage stops), not a provider's
    unscored reply; before ``check`` has passed nothing is retried (nothing is paid yet)."""
    transport, _ = flaky_vllm([503] * 1000)

    async def go() -> None:
        async with Reference("http://127.0.0.1:8011/v1", transport=transport, retry_for_s=1) as ref:
            await ref.check()
            await ref.score(VLLM["score-ids-max0"]["request"]["body"]["prompt"], top_logprobs=5)

    with pytest.raises(ReferenceDown, match=r"answered 503: busy; still failing after 1 s of retries: restart"):
        asyncio.run(go())

    def refused(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "loading"}})

    async def check() -> None:
        async with Reference("http://127.0.0.1:8011/v1", transport=httpx.MockTransport(refused), retry_for_s=60) as ref:
            await ref.check()

    started = time.monotonic()
    with pytest.raises(ReferenceUnusable):
        asyncio.run(check())
    assert time.monotonic() - started < 5


def test_a_reference_without_a_tokenize_route_is_named_before_any_paid_request() -> None:
    """A server whose tokenize route is missing (e.g. a base URL whose root is not vLLM's) is
    a clear error naming the server and both routes tried."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=VLLM["models"]["body"])
        return httpx.Response(404, json={"detail": "Not Found"})

    async def go() -> None:
        async with Reference("http://127.0.0.1:8011/v1", transport=httpx.MockTransport(answer)) as ref:
            await ref.check()

    with pytest.raises(ReferenceUnusable) as caught:
        asyncio.run(go())
    message = str(caught.value)
    assert "http://127.0.0.1:8011/v1" in message and "POST /tokenize answered 404" in message
    assert "POST /v1/tokenize answered 404" in message


def test_sglang_flavour_tokenizes_chats_through_the_chat_route_and_scores_with_one_token(
    inprocess: Callable[..., TestClient],
) -> None:
    """SGLang refuses ``max_tokens: 0``, takes only text at /tokenize, lists the top k
    without the scored token and names no ids: the client finds each out in ``check``."""

    def capabilities(flavour: str) -> tuple[Capabilities, list[int]]:
        app = inprocess(roster_dict(provider("alpha"), reference_flavour=flavour)).app

        async def go() -> tuple[Capabilities, list[int]]:
            transport = httpx.ASGITransport(app=app)
            async with Reference("http://127.0.0.1:9/reference/v1", transport=transport) as ref:
                return await ref.check(), await ref.tokenize_chat([{"role": "user", "content": "Hello there"}])

        return asyncio.run(go())

    sglang, sglang_ids = capabilities("sglang")
    vllm, vllm_ids = capabilities("vllm")
    assert (sglang.score_max_tokens, sglang.token_ids, sglang.chat_ids_from_tokenize) == (1, False, False)
    assert (vllm.score_max_tokens, vllm.token_ids, vllm.chat_ids_from_tokenize) == (0, True, True)
    assert sglang.tokenize_url.endswith("/reference/tokenize") and vllm.tokenize_url.endswith("/reference/tokenize")
    assert sglang_ids == vllm_ids


def test_the_servers_version_and_a_controls_chat_reply_are_read_as_vllm_answers_them() -> None:
    """``GET /version`` names vLLM's release (what a calibration is keyed by; ``unknown``
    where a server has no such route), and a chat completion with top logprobs parses as a
    provider's reply does: the sampled tokens with their alternatives."""

    async def go() -> tuple[str, ChatReply, str]:
        async with (
            vllm_reference() as ref,
            Reference(
                "http://127.0.0.1:9/v1", transport=httpx.MockTransport(lambda _: httpx.Response(404, text="Not Found"))
            ) as other,
        ):
            reply = await ref.chat(VLLM["chat-top5"]["request"]["body"]["messages"], max_tokens=24, temperature=1.0,
                                   seed=7, top_logprobs=5)  # fmt: skip
            return await ref.server_version(), reply, await other.server_version()

    version, reply, other = asyncio.run(go())
    assert version == "0.32.0" and other == "unknown"
    recorded_content = VLLM["chat-top5"]["body"]["choices"][0]["logprobs"]["content"]
    assert reply.logprobs is not None and len(reply.logprobs) == len(recorded_content)
    assert reply.content == VLLM["chat-top5"]["body"]["choices"][0]["message"]["content"]


def test_the_token_that_ends_a_turn_is_read_from_the_chat_template(inprocess: Callable[..., TestClient]) -> None:
    """vLLM renders an assistant message open (``continue_final_message``) and closed: the
    token after the open one is ``<|im_end|>`` (id 2, recorded). SGLang renders only
    generation prompts: the same message followed by another turn gives the same token. A
    template whose two renders part earlier is refused, naming the server."""

    async def found(transport: httpx.AsyncBaseTransport, url: str = "http://127.0.0.1:8011/v1") -> int:
        async with Reference(url, transport=transport) as ref:
            return await ref.end_of_turn()

    assert asyncio.run(found(replay("vllm"))) == 2
    ends = {}
    for flavour in ("vllm", "sglang"):
        app = inprocess(roster_dict(provider("alpha"), reference_flavour=flavour)).app
        ends[flavour] = asyncio.run(found(httpx.ASGITransport(app=app), "http://127.0.0.1:9/reference/v1"))
    assert ends["vllm"] == ends["sglang"] != 2

    recorded_reply = replay("vllm")

    def parted(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize" and b'"continue_final_message"' in request.content:
            return httpx.Response(200, json={"count": 3, "max_model_len": 2048, "tokens": [1, 7, 9]})
        return recorded_reply.handle_request(request)

    with pytest.raises(ReferenceUnusable, match=r"127\.0\.0\.1:8011.*ends the assistant's turn"):
        asyncio.run(found(httpx.MockTransport(parted)))
