"""A typed async client for OpenRouter's HTTP API (and anything that speaks it: the
sandbox, a local gateway).

It builds requests exactly as the OpenAPI spec describes them (the contract tests
validate every body it builds), parses replies into the typed objects of
:mod:`quanthunt.replies`, and turns every failure into a ``GatewayError`` that says what
happened without ever carrying the key. The transport is a seam: pass
``httpx.ASGITransport(app)`` to mount a gateway in-process. The generation hot path sends
its chat completions through :class:`quanthunt.aiohttp_chat.AiohttpChat` instead, with this
module's headers, error mapping and reply parsing.

Usage::

    async with Gateway("https://openrouter.ai/api/v1", api_key=resolve_api_key(url)) as gw:
        endpoints = await gw.endpoints("moonshotai/kimi-k2.5")
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import functools
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from quanthunt import __version__
from quanthunt.config_files import one_line
from quanthunt.defaults import (
    GATEWAY_GENERATION_LAG_S,
    GATEWAY_GET_ATTEMPTS,
    GATEWAY_GET_BACKOFF_S,
    GATEWAY_LIMITS,
    GATEWAY_SLOWEST_TOKENS_PER_S,
    GATEWAY_TIMEOUT,
    SANDBOX_API_KEY,
)
from quanthunt.errors import ConfigError, QuanthuntError
from quanthunt.redaction import redact
from quanthunt.replies import ChatReply, ChatResult, Endpoint, EndpointList, Generation, KeyStatus, ModelReasoning
from quanthunt.spec import LIMIT_SOURCES
from quanthunt.urls import check_base_url, is_loopback

API_KEY_ENV = "OPENROUTER_API_KEY"
MAX_ERROR_CHARS = 600
"""Longest error message a ``GatewayError`` carries (server text is cut)."""
MAX_RETRY_AFTER_S = 300.0
"""Longest pause a ``Retry-After`` can ask for."""


# -- base URLs and keys ---------------------------------------------------------------


class ApiKey:
    """An API key that does not show itself in reprs, logs or tracebacks."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "ApiKey(***)"

    __str__ = __repr__


def resolve_api_key(base_url: str, env: Mapping[str, str] = os.environ) -> ApiKey:
    """``OPENROUTER_API_KEY`` when set; the fixed sandbox key for a loopback gateway."""
    value = env.get(API_KEY_ENV, "").strip()
    if value:
        return ApiKey(value)
    if is_loopback(urlsplit(base_url).hostname or ""):
        return ApiKey(SANDBOX_API_KEY)
    raise ConfigError(f"{API_KEY_ENV} is not set: export it to use {urlsplit(base_url).hostname}")


# -- errors -----------------------------------------------------------------------------

TRANSIENT = frozenset(
    {"timeout", "connect", "disconnect", "transport", "http_408", "http_429", "http_500", "http_502", "http_503", "http_504",
     "http_524", "http_529"}
)  # fmt: skip
"""Failure kinds worth retrying for an idempotent request."""


class GatewayError(QuanthuntError):
    """A request the gateway refused or could not serve.

    ``status`` is the HTTP status (0 when no reply arrived); ``kind`` names the failure
    for retry policies and error counts: ``http_<status>`` (also for an HTTP 200 whose
    body is a top-level ``error`` with that code), ``limit_source`` values (a 402 without
    one is ``openrouter_credits``), ``constraint_filtered``, ``provider_error`` (an HTTP
    200 error body without an HTTP code), ``timeout`` (sent, no reply in time: possibly
    billed), ``connect`` (never sent: refused, or connecting timed out), ``disconnect``,
    ``malformed``, ``unexpected_reply``, ``finish_error``, ``empty_answer`` (a reply with
    no content: the generation engine's, paid for and retried).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        kind: str = "",
        retry_after_s: float | None = None,
        generation_id: str | None = None,
    ) -> None:
        super().__init__(one_line(redact(message), MAX_ERROR_CHARS))
        self.status = status
        self.kind = kind or f"http_{status}"
        self.retry_after_s = retry_after_s
        self.generation_id = generation_id


def backoff_s(error: GatewayError, attempt: int) -> float:
    """The pause before retry ``attempt + 1``: Retry-After when given, else exponential, at most 10 s."""
    return min(error.retry_after_s if error.retry_after_s is not None else 0.2 * 2**attempt, 10.0)


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """Parse ``Retry-After``: delta-seconds or an HTTP date, capped at
    ``MAX_RETRY_AFTER_S`` (one reply must not pause a run for days). None when absent or
    invalid."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = email.utils.parsedate_to_datetime(value)
            seconds = moment.timestamp() - (now if now is not None else time.time())
        except (TypeError, ValueError, OverflowError, IndexError):
            return None
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _error_kind(status: int, data: Any) -> tuple[str | None, str]:
    """(message, kind) of OpenRouter's ``{"error": {...}}`` body answering with ``status``.

    A 402 is out of money (``openrouter_credits``) unless its ``limit_source`` says which
    limit (the spec's own 402 example carries none; only ``openrouter_in_flight_budget``
    is worth waiting for); a 404 ``constraint_filtered`` means the routing filters left
    nothing."""
    kind = "openrouter_credits" if status == 402 else f"http_{status}"
    error: Any = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None, kind
    metadata: Any = error.get("metadata") if isinstance(error.get("metadata"), dict) else {}
    availability: Any = error.get("availability") if isinstance(error.get("availability"), dict) else {}
    if status == 402 and metadata.get("limit_source") in LIMIT_SOURCES:  # a known value only: kinds name metrics
        kind = metadata["limit_source"]
    if availability.get("code") == "constraint_filtered":
        kind = "constraint_filtered"
    return str(error.get("message") or "")[:500] or None, kind


def error_from(status: int, reason: str, body: bytes, headers: Mapping[str, str], where: str) -> GatewayError:
    """A ``GatewayError`` from an error reply: OpenRouter's ``{"error": {...}}`` body, the
    402 ``limit_source``, the 404 ``constraint_filtered`` code and ``Retry-After``."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    message, kind = _error_kind(status, data)
    lowered = {k.lower(): v for k, v in headers.items()}
    return GatewayError(
        f"{where} answered {status}: {message or reason or 'error'}",
        status=status,
        kind=kind,
        retry_after_s=retry_after_seconds(lowered.get("retry-after")),
        generation_id=lowered.get("x-generation-id"),
    )


def error_in_200(raw: bytes, generation_id: str | None, where: str) -> GatewayError | None:
    """An HTTP 200 whose body is a top-level ``{"error": {"code", "message"}}`` and no
    choices (a provider that failed after the gateway committed to 200): the error its
    code names (``code: 429`` is ``http_429``, retried as a 429 is), ``provider_error``
    when the code is not an HTTP status. None for any other body."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict) or data.get("choices"):
        return None
    code = data["error"].get("code")
    http_like = isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599
    message, kind = _error_kind(code if http_like else 200, data)
    return GatewayError(
        f"{where} answered 200 with an error ({code if http_like else 'no HTTP code'}): {message or 'no message'}",
        status=200,
        kind=kind if http_like else "provider_error",
        generation_id=generation_id,
    )


def _error_from(reply: httpx.Response, where: str) -> GatewayError:
    return error_from(reply.status_code, reply.reason_phrase, reply.content, reply.headers, where)


# -- replies ----------------------------------------------------------------------------


def parse_chat_reply(raw: bytes, generation_id: str | None, where: str) -> ChatReply:
    """Parse a 200 chat completion body; malformed bodies and error finishes raise."""
    try:
        result = ChatResult.model_validate_json(raw)
    except ValidationError as exc:
        if (error := error_in_200(raw, generation_id, where)) is not None:
            raise error from None
        first = exc.errors()[0]
        field_name = ".".join(str(p) for p in first["loc"]) or "(body)"
        kind = "malformed" if first["type"] == "json_invalid" else "unexpected_reply"
        raise GatewayError(f"{where}: unexpected reply ({field_name}: {first['msg']})", status=200, kind=kind,
                           generation_id=generation_id) from None  # fmt: skip
    choice = result.choices[0]
    generation_id = generation_id or result.id
    if choice.finish_reason == "error":
        message = str((choice.error or {}).get("message", "provider error"))[:300]
        raise GatewayError(f"{where}: provider failed ({message})", status=200, kind="finish_error", generation_id=generation_id)
    return ChatReply(
        id=result.id,
        generation_id=generation_id,
        provider=result.provider,
        model=result.model,
        content=choice.message.content or "",
        reasoning=choice.message.reasoning or choice.message.reasoning_content,
        finish_reason=choice.finish_reason,
        logprobs=choice.logprobs.content if choice.logprobs else None,
        usage=result.usage,
        error=choice.error,
    )


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """OpenRouter's ``provider`` object. Unset fields are left out of the request."""

    only: tuple[str, ...] | None = None
    order: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    allow_fallbacks: bool | None = None
    require_parameters: bool | None = None
    quantizations: tuple[str, ...] | None = None
    data_collection: str | None = None
    sort: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v is not None}

    @functools.cached_property
    def json(self) -> dict[str, Any]:
        """``to_json()``, computed once (the generation hot path sends it with every request)."""
        return self.to_json()

    @classmethod
    def pinned(cls, tag: str) -> Routing:
        """Exactly one endpoint, no fallbacks, and only if it honours every parameter."""
        return cls().pin(tag)

    def pin(self, tag: str, *, siblings: Sequence[str] = ()) -> Routing:
        """These preferences pinned to the endpoint ``tag``. A base slug (``deepinfra``)
        also names the provider's variant endpoints (``deepinfra/turbo``): those among
        ``siblings`` (the other tags the gateway lists) are ignored, so the pin cannot
        land on one of them."""
        variants = tuple(s for s in siblings if "/" not in tag and s.lower().startswith(f"{tag.lower()}/"))
        return dataclasses.replace(self, only=(tag,), ignore=variants or None, allow_fallbacks=False, require_parameters=True)


def read_timeout_s(base_s: float, max_tokens: int) -> float:
    """How long to wait for a non-streamed reply: ``base_s`` (queueing, time to the first
    token) plus ``max_tokens`` at ``GATEWAY_SLOWEST_TOKENS_PER_S``.

    A reply arrives whole, after the provider wrote its last token, so a fixed timeout
    would abandon a slow long answer that the gateway still bills, and the retry would
    buy it a second time. Sizing the wait from ``max_tokens`` keeps the hot path
    non-streamed (one JSON parse per reply; streaming would parse one event per token)
    while a provider slower than the floor still counts as failed."""
    return base_s + max_tokens / GATEWAY_SLOWEST_TOKENS_PER_S


def chat_body(
    *,
    model: str,
    messages: Sequence[Mapping[str, str]],
    max_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    routing: Routing | None = None,
    reasoning: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``ChatRequest`` body; only what is set is sent."""
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages], "max_tokens": max_tokens}
    optional = {"temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop) if stop else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    if logprobs:
        body["logprobs"] = True
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
    if routing is not None:
        body["provider"] = routing.json
    if reasoning is not None:
        body["reasoning"] = dict(reasoning)
    return body


# -- the client -------------------------------------------------------------------------


def gateway_url(base_url: str) -> tuple[str, str]:
    """The checked base URL and its host (what error messages name)."""
    try:
        url = check_base_url(base_url)
    except ValueError as exc:
        raise ConfigError(f"gateway base URL {exc}") from None
    return url, urlsplit(url).netloc


def gateway_headers(api_key: ApiKey) -> dict[str, str]:
    """What every request to the gateway carries, from either client (:class:`Gateway`, ``AiohttpChat``)."""
    return {"Authorization": f"Bearer {api_key.reveal()}", "User-Agent": f"quanthunt/{__version__}", "X-Title": "quanthunt"}


def failure_reason(exc: Exception) -> str:
    """A short reason for a transport failure, without URLs' query strings or headers."""
    text = str(exc).strip() or exc.__class__.__name__
    return text.splitlines()[0][:200]


@dataclass
class Gateway:
    """An OpenRouter-compatible gateway at ``base_url`` (``.../api/v1``)."""

    base_url: str
    api_key: ApiKey
    transport: httpx.AsyncBaseTransport | None = None
    timeout: httpx.Timeout = field(default_factory=lambda: GATEWAY_TIMEOUT)
    limits: httpx.Limits = field(default_factory=lambda: GATEWAY_LIMITS)

    def __post_init__(self) -> None:
        self.base_url, self.host = gateway_url(self.base_url)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=gateway_headers(self.api_key),
            transport=self.transport,
            timeout=self.timeout,
            limits=self.limits,
            follow_redirects=False,
        )

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; reads (GET) are retried on transient failures with backoff."""
        attempts = GATEWAY_GET_ATTEMPTS if method == "GET" else 1
        for attempt in range(1, attempts + 1):
            try:
                return await self._once(method, path, **kwargs)
            except GatewayError as exc:
                if attempt == attempts or exc.kind not in TRANSIENT:
                    raise
                delay = exc.retry_after_s if exc.retry_after_s is not None else GATEWAY_GET_BACKOFF_S * 2 ** (attempt - 1)
                await asyncio.sleep(min(delay, 10.0))
        raise AssertionError("unreachable")

    async def _read_json(self, method: str, path: str, **kwargs: Any) -> Any:
        """GET a JSON body, retrying a malformed or truncated one like a failed request."""
        for attempt in range(1, GATEWAY_GET_ATTEMPTS + 1):
            reply = await self._request(method, path, **kwargs)
            try:
                return reply.json()
            except (ValueError, RecursionError):
                if attempt == GATEWAY_GET_ATTEMPTS:
                    raise GatewayError(f"{self.host} {method} {path}: reply is not JSON", kind="malformed") from None
                await asyncio.sleep(GATEWAY_GET_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        where = f"{self.host} {method} {path}"
        try:
            reply = await self._client.request(method, path, **kwargs)
        except httpx.ConnectTimeout:  # never sent, so never billed: not a ``timeout`` (which may have been)
            raise GatewayError(f"cannot reach {self.host}: connecting timed out", kind="connect") from None
        except httpx.TimeoutException:
            raise GatewayError(f"{where}: timed out", kind="timeout") from None
        except httpx.ConnectError as exc:
            raise GatewayError(f"cannot reach {self.host}: {failure_reason(exc)}", kind="connect") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise GatewayError(f"{where}: connection dropped ({failure_reason(exc)})", kind="disconnect") from None
        except httpx.HTTPError as exc:
            raise GatewayError(f"{where}: {exc.__class__.__name__}", kind="transport") from None
        if reply.status_code >= 400:
            raise _error_from(reply, where)
        return reply

    async def endpoints(self, model: str) -> list[Endpoint]:
        """Every provider endpoint the gateway lists for ``model`` (``author/slug``)."""
        path = f"/models/{model}/endpoints"
        body = await self._read_json("GET", path)
        try:
            data = body["data"]
        except (KeyError, TypeError):
            raise GatewayError(f"{self.host} GET {path}: unexpected reply (no data object)", kind="malformed") from None
        try:
            return EndpointList.model_validate(data).endpoints
        except ValidationError as exc:
            first = exc.errors()[0]
            raise GatewayError(
                f"{self.host} GET {path}: unexpected reply (data.{'.'.join(map(str, first['loc']))}: {first['msg']})",
                kind="unexpected_reply",
            ) from None

    async def model_reasoning(self, model: str) -> ModelReasoning | None:
        """``model``'s reasoning settings from ``GET /models``; None for a model that does
        not reason (or that the list does not hold: its endpoints call says so)."""
        body = await self._read_json("GET", "/models")
        entries = body.get("data") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise GatewayError(f"{self.host} GET /models: unexpected reply (no data list)", kind="malformed")
        for entry in entries:
            if isinstance(entry, dict) and str(entry.get("id", "")).lower() == model.lower() and entry.get("reasoning"):
                try:
                    return ModelReasoning.model_validate(entry["reasoning"])
                except ValidationError:
                    raise GatewayError(f"{self.host} GET /models: unexpected reasoning object for {model}",
                                       kind="unexpected_reply") from None  # fmt: skip
        return None

    async def chat(self, body: Mapping[str, Any]) -> ChatReply:
        """POST ``/chat/completions`` (non-streamed; the read timeout grows with
        ``max_tokens``, see ``read_timeout_s``). A 200 whose choice finished with ``error``
        raises ``GatewayError(kind="finish_error")``."""
        timeout = self.timeout
        if timeout.read is not None:
            timeout = httpx.Timeout(
                connect=timeout.connect, read=read_timeout_s(timeout.read, int(body.get("max_tokens") or 0)),
                write=timeout.write, pool=timeout.pool,
            )  # fmt: skip
        reply = await self._request("POST", "/chat/completions", json=body, timeout=timeout)
        return parse_chat_reply(reply.content, reply.headers.get("x-generation-id"), f"{self.host} POST /chat/completions")

    async def generation(self, generation_id: str, *, lag_s: float = GATEWAY_GENERATION_LAG_S) -> Generation:
        """``/generation?id=``. The record appears a moment after the reply: a 404 is asked
        again, with backoff, until the pauses add up to ``lag_s``."""
        waited, delay = 0.0, GATEWAY_GET_BACKOFF_S
        while True:
            try:
                body = await self._read_json("GET", "/generation", params={"id": generation_id})
                break
            except GatewayError as exc:
                if exc.kind != "http_404" or waited >= lag_s:
                    raise
                pause = min(delay, lag_s - waited)
                await asyncio.sleep(pause)
                waited, delay = waited + pause, delay * 2
        try:
            return Generation.model_validate(body["data"])
        except (KeyError, TypeError, ValidationError):
            raise GatewayError(f"{self.host} GET /generation: unexpected reply", kind="unexpected_reply") from None

    async def key(self) -> KeyStatus:
        body = await self._read_json("GET", "/key")
        try:
            return KeyStatus.model_validate(body["data"])
        except (KeyError, TypeError, ValidationError):
            raise GatewayError(f"{self.host} GET /key: unexpected reply", kind="unexpected_reply") from None


async def check_gateway(gateway: Gateway, url: str) -> None:
    """One cheap read before any money moves (verify's probes, generate's records): an
    unreachable gateway is a fast, clear exit 2 that leaves every earlier output as it was."""
    try:
        await gateway.key()
    except GatewayError as error:
        if error.kind in ("connect", "timeout"):
            raise ConfigError(f"api.base_url: cannot reach the gateway at {url} ({error})") from None
        raise
