"""Bad gateway replies hunted with hypothesis (through ``httpx.MockTransport``): every reply
is a typed result or a one-line ``GatewayError`` naming the failure, never carrying the API
key; ``test_bug_*`` pin the bugs found, one each."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import pytest
from fixtures.bad_inputs import API_KEY, BASE_URL, FAST, LINE_BREAKS, MEDIUM, THOROUGH, assert_gateway_error, json_values
from hypothesis import given
from hypothesis import strategies as st

from quanthunt import gateway as gateway_module
from quanthunt.errors import ConfigError
from quanthunt.gateway import ApiKey, Gateway, GatewayError, error_from, parse_chat_reply
from quanthunt.replies import ChatReply, Endpoint, Generation, KeyStatus
from quanthunt.spec import LIMIT_SOURCES

# -- 4. gateway replies ------------------------------------------------------------------------------------------------

SAFE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=LINE_BREAKS), max_size=30)
REPLY_VALUES = json_values(keys=SAFE_TEXT, text=SAFE_TEXT)
HUGE = "x" * 200_000
STATUSES = st.sampled_from([200, 400, 401, 402, 404, 429, 500, 502, 503]) | st.integers(200, 599)
RETRY_AFTER = [
    "", " ", "0", "1", "2.5", "-1", "abc", "nan", "inf", "-inf", "1e400", "  7  ", "١٢", "1" * 400,
    "Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2099 07:28:00 GMT", "Mon, 32 Foo 2024 99:99:99 GMT",
    "Fri, 31 Dec 9999 23:59:59", "Sun, 06 Nov 1994 08:49:37 +2400", "Tue, 01 Jan 0001 00:00:00 GMT",
]  # fmt: skip
"""Odd ``Retry-After`` values, except the two kinds the xfail tests pin (huge numbers and overflowing dates)."""


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return value | REPLY_VALUES


error_objects = st.fixed_dictionaries(
    {},
    optional={
        "code": maybe(STATUSES),
        "message": maybe(SAFE_TEXT | st.just(HUGE)),
        "metadata": maybe(st.fixed_dictionaries({}, optional={"limit_source": maybe(st.sampled_from(LIMIT_SOURCES))})),
        "availability": maybe(st.fixed_dictionaries({}, optional={"code": maybe(st.just("constraint_filtered"))})),
    },
)
logprob_entries = st.fixed_dictionaries(
    {"token": maybe(SAFE_TEXT), "logprob": maybe(st.floats(max_value=0))},
    optional={
        "bytes": maybe(st.lists(st.integers(0, 255), max_size=3)),
        "top_logprobs": maybe(st.lists(REPLY_VALUES, max_size=2)),
    },
)
choices = st.fixed_dictionaries(
    {},
    optional={
        "message": maybe(st.fixed_dictionaries({}, optional={"content": maybe(SAFE_TEXT), "reasoning": maybe(SAFE_TEXT)})),
        "finish_reason": maybe(st.sampled_from(["stop", "length", "error", None])),
        "logprobs": maybe(st.fixed_dictionaries({"content": maybe(st.lists(logprob_entries, max_size=2))})),
        "error": maybe(error_objects),
    },
)
usages = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": maybe(st.integers(0, 10**6)),
        "completion_tokens": maybe(st.integers(0, 10**6)),
        "cost": REPLY_VALUES,
    },
)
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "id": maybe(SAFE_TEXT),
        "model": maybe(SAFE_TEXT),
        "provider": maybe(SAFE_TEXT),
        "choices": maybe(st.lists(choices, max_size=2)),
        "usage": maybe(usages),
        "error": maybe(error_objects),
    },
)
endpoint_entries = st.fixed_dictionaries(
    {
        "provider_name": maybe(SAFE_TEXT),
        "tag": maybe(SAFE_TEXT),
        "context_length": maybe(st.integers(0, 10**6)),
        "pricing": maybe(st.fixed_dictionaries({"prompt": maybe(st.just("0.000001")), "completion": maybe(st.just("0.000002"))})),
    },
    optional={
        "quantization": REPLY_VALUES,
        "status": REPLY_VALUES,
        "supported_parameters": REPLY_VALUES,
        "uptime_last_30m": REPLY_VALUES,
    },
)
data_bodies = st.fixed_dictionaries(
    {},
    optional={
        "data": maybe(
            st.fixed_dictionaries(
                {}, optional={"id": maybe(SAFE_TEXT), "endpoints": maybe(st.lists(endpoint_entries, max_size=2))}
            )
            | st.fixed_dictionaries(
                {"id": maybe(SAFE_TEXT)}, optional={"total_cost": REPLY_VALUES, "provider_name": REPLY_VALUES}
            )
            | st.fixed_dictionaries({}, optional={"limit": REPLY_VALUES, "limit_remaining": REPLY_VALUES, "usage": REPLY_VALUES})
        ),
        "error": maybe(error_objects),
    },
)
json_bodies = st.one_of(chat_bodies, data_bodies, st.fixed_dictionaries({"error": maybe(error_objects)}), REPLY_VALUES)
bodies = st.one_of(
    st.binary(max_size=300),
    json_bodies.map(lambda value: json.dumps(value).encode()),
    json_bodies.map(lambda value: json.dumps(value).encode()[: len(json.dumps(value)) // 2]),
    st.sampled_from([b"", b"null", b"{}", b"[]", json.dumps(HUGE).encode(), b'{"choices": []}', b"\xef\xbb\xbf{}"]),
)
header_values = st.binary(max_size=40).map(lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7F))
headers = st.fixed_dictionaries(
    {},
    optional={
        "retry-after": st.sampled_from(RETRY_AFTER).map(str.encode) | header_values,
        "x-generation-id": header_values,
        "content-type": st.sampled_from(
            [b"application/json", b"text/html; charset=latin-1", b"application/json; charset=utf-16"]
        ),
        "content-encoding": st.sampled_from([b"gzip", b"deflate", b"br", b"zstd", b"identity", b"bogus"]),
    },
)
TRANSPORT_ERRORS = [
    httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout, httpx.ReadError,
    httpx.WriteError, httpx.RemoteProtocolError, httpx.LocalProtocolError, httpx.ProxyError, httpx.UnsupportedProtocol,
    httpx.DecodingError, httpx.TooManyRedirects, httpx.CloseError,
]  # fmt: skip
CALLS: dict[str, Callable[[Gateway], Any]] = {
    "chat": lambda gw: gw.chat({"model": "a/b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
    "endpoints": lambda gw: gw.endpoints("a/b"),
    "generation": lambda gw: gw.generation("gen-1"),
    "key": lambda gw: gw.key(),
}
RESULT_TYPES: dict[str, Callable[[Any], bool]] = {
    "chat": lambda r: isinstance(r, ChatReply) and isinstance(r.content, str) and isinstance(r.id, str),
    "endpoints": lambda r: isinstance(r, list) and all(isinstance(e, Endpoint) for e in r),
    "generation": lambda r: isinstance(r, Generation) and isinstance(r.id, str),
    "key": lambda r: isinstance(r, KeyStatus),
}


MAX_RETRY_SLEEP_S = 60.0
"""The longest pause between two attempts of one gateway read that is not a hang."""


def call_gateway(call: str, handler: Callable[[httpx.Request], httpx.Response]) -> Any:
    """``call`` against a gateway whose every reply ``handler`` makes; a hang fails as TimeoutError.

    The gateway's retry sleeps are recorded instead of slept, and each must be finite and short."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        assert 0 <= seconds <= MAX_RETRY_SLEEP_S, f"the gateway would sleep {seconds} s before retrying"
        assert len(slept) < 20, f"the gateway retried {len(slept)} times"

    async def go() -> Any:
        async with Gateway(BASE_URL, api_key=ApiKey(API_KEY), transport=httpx.MockTransport(handler)) as gateway:
            return await asyncio.wait_for(CALLS[call](gateway), timeout=10)

    with mock.patch.object(gateway_module, "asyncio", SimpleNamespace(sleep=sleep)):
        return asyncio.run(go())


def check_call(call: str, handler: Callable[[httpx.Request], httpx.Response]) -> Any:
    try:
        result = call_gateway(call, handler)
    except GatewayError as exc:
        return assert_gateway_error(exc)
    assert RESULT_TYPES[call](result), result
    return result


@THOROUGH
@given(call=st.sampled_from(list(CALLS)), status=STATUSES, body=bodies, extra=headers)
def test_gateway_replies_are_typed_or_gateway_errors(call: str, status: int, body: bytes, extra: dict[str, bytes]) -> None:
    outcome = check_call(call, lambda request: httpx.Response(status, content=body, headers=list(extra.items())))
    if status >= 400:  # an error reply stays an error with its status, unless its body could not even be decoded
        assert isinstance(outcome, GatewayError) and (outcome.status == status or outcome.kind == "transport"), outcome


@FAST
@given(call=st.sampled_from(list(CALLS)), error=st.sampled_from(TRANSPORT_ERRORS), text=st.text(max_size=40))
def test_transport_failures_are_gateway_errors(call: str, error: type[httpx.RequestError], text: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error(f"failed: {text}\nsecond line with {request.headers['authorization']}", request=request)

    with pytest.raises(GatewayError) as info:
        call_gateway(call, handler)
    assert assert_gateway_error(info.value).status == 0


@MEDIUM
@given(raw=st.binary(max_size=300) | bodies, generation_id=st.none() | SAFE_TEXT)
def test_parse_chat_reply_on_any_bytes(raw: bytes, generation_id: str | None) -> None:
    try:
        reply = parse_chat_reply(raw, generation_id, "gateway.example POST /chat/completions")
    except GatewayError as exc:
        kind = assert_gateway_error(exc).kind
        in_200 = kind in ("provider_error", "constraint_filtered", *LIMIT_SOURCES) or re.fullmatch(r"http_[45]\d\d", kind)
        assert kind in ("malformed", "unexpected_reply", "finish_error") or (in_200 and exc.status == 200), kind
    else:
        assert RESULT_TYPES["chat"](reply)
        assert reply.finish_reason != "error"


@FAST
@given(status=st.integers(400, 599), reason=SAFE_TEXT, body=bodies, extra=headers)
def test_error_from_always_builds_a_gateway_error(status: int, reason: str, body: bytes, extra: dict[str, bytes]) -> None:
    decoded = {name: value.decode("latin-1") for name, value in extra.items()}
    error = error_from(status, reason, body, decoded, "gateway.example GET /key")
    assert assert_gateway_error(error).status == status


# Known gateway bugs (src/quanthunt/gateway.py is not this suite's to fix): each input below breaks the invariant.

CHAT_OK = {"id": "gen-1", "model": "a/b", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}


def chat_with(**changes: Any) -> bytes:
    return json.dumps({**CHAT_OK, **changes}).encode()


def reply(status: int, body: bytes, headers: dict[str, str] | None = None) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, content=body, headers=headers)


@pytest.mark.parametrize(("call", "status"), [("chat", 500), ("key", 429), ("key", 200), ("endpoints", 200), ("generation", 200)])
def test_bug_deeply_nested_json_reply(call: str, status: int) -> None:
    check_call(call, reply(status, b"[" * 100_000))


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (500, json.dumps({"error": {"message": "upstream failed\nTraceback (most recent call last):"}}).encode()),
        (200, chat_with(choices=[{"message": {}, "finish_reason": "error", "error": {"message": "boom\r\nat line 2"}}])),
    ],
)
def test_bug_multi_line_gateway_error(status: int, body: bytes) -> None:
    check_call("chat", reply(status, body))


@pytest.mark.parametrize(
    "value", ["Mon, 01 Jan 2024 00:00:00 +99999999999999999999", "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"]
)
def test_bug_retry_after_date_overflow(value: str) -> None:
    check_call("chat", reply(429, b"{}", {"Retry-After": value}))


@pytest.mark.parametrize("value", ["1e300", "Fri, 31 Dec 9999 23:59:59 GMT"])
def test_bug_retry_after_is_not_capped(value: str) -> None:
    error = check_call("chat", reply(429, b"{}", {"Retry-After": value}))
    assert error.retry_after_s is not None and error.retry_after_s <= 24 * 3600


def test_bug_echoed_key_reaches_the_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": f"invalid credentials: {request.headers['authorization']}"}})

    check_call("chat", handler)


@pytest.mark.parametrize("source", ["mystery", "out of credits!", "x" * 300])
def test_bug_kind_comes_from_the_server(source: str) -> None:
    error = check_call(
        "chat", reply(402, json.dumps({"error": {"message": "no", "metadata": {"limit_source": source}}}).encode())
    )
    assert re.fullmatch(r"[a-z0-9_]{1,40}", error.kind) and (error.kind in LIMIT_SOURCES or error.kind == "http_402"), error.kind


@pytest.mark.parametrize(
    ("call", "body"),
    [
        ("chat", chat_with(usage={"prompt_tokens": 1, "completion_tokens": 1, "cost": math.nan})),
        ("chat", chat_with(usage={"prompt_tokens": 1, "completion_tokens": 1, "cost": -5.0})),
        ("chat", chat_with(usage={"prompt_tokens": -1, "completion_tokens": 10**30})),
        (
            "chat",
            chat_with(choices=[{"message": {"content": "hi"}, "logprobs": {"content": [{"token": "a", "logprob": math.nan}]}}]),
        ),
        ("generation", json.dumps({"data": {"id": "gen-1", "total_cost": math.inf}}).encode()),
        ("generation", json.dumps({"data": {"id": "gen-1", "total_cost": -1.0}}).encode()),
    ],
)
def test_bug_damaged_numbers_in_typed_replies(call: str, body: bytes) -> None:
    result = check_call(call, reply(200, body))
    if isinstance(result, GatewayError):  # refused as an unexpected reply: fine, nothing damaged got through
        assert result.kind == "unexpected_reply"
        return
    numbers: list[float | None] = [] if call == "chat" else [result.total_cost]
    if call == "chat" and result.usage is not None:
        numbers += [result.usage.cost, result.usage.prompt_tokens, result.usage.completion_tokens]
    if call == "chat" and result.logprobs:
        numbers += [-t.logprob for t in result.logprobs]  # a logprob is at most 0
    assert all(n is None or (math.isfinite(n) and 0 <= n < 2**63) for n in numbers), numbers


@pytest.mark.parametrize("price", ["abc", "", "nan", "-1"])
def test_bug_endpoint_prices_are_not_checked(price: str) -> None:
    endpoint = {
        "provider_name": "P",
        "tag": "p/int4",
        "context_length": 8192,
        "pricing": {"prompt": price, "completion": "0.000002"},
    }
    result = check_call("endpoints", reply(200, json.dumps({"data": {"id": "a/b", "endpoints": [endpoint]}}).encode()))
    assert isinstance(result, GatewayError)  # refused at the boundary, naming the field
    assert result.kind == "unexpected_reply" and "pricing.prompt" in str(result)


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc/v1", "https://example.com/\x00"])
def test_bug_gateway_with_an_unusable_url(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        Gateway(url, api_key=ApiKey(API_KEY))
    message = str(info.value)
    assert message.startswith("gateway base URL is not a usable URL") and message.splitlines() == [message]
