"""The generation hot path's gateway client, :class:`AiohttpChat`.

Only the transport is its own (aiohttp, and its exceptions mapped to the same
``GatewayError`` kinds as httpx's); the headers, the mapping of error replies and the
parsing into a :class:`quanthunt.replies.ChatReply` are :mod:`quanthunt.gateway`'s. aiohttp
and orjson are imported when a client is used, not when this module is.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from quanthunt.defaults import GATEWAY_CONNECT_TIMEOUT_S, GATEWAY_READ_TIMEOUT_S
from quanthunt.gateway import (
    ApiKey,
    GatewayError,
    error_from,
    failure_reason,
    gateway_headers,
    gateway_url,
    parse_chat_reply,
    read_timeout_s,
)
from quanthunt.replies import ChatReply


class AiohttpChat:
    """The generation hot path: chat completions over aiohttp, thousands in flight.

    Same requests, replies and errors as ``Gateway.chat`` (httpx's own connection pool
    costs ~18 ms of CPU per request at 2,000 in flight; aiohttp ~0.5 ms). ``on_headers``
    receives the ``X-Generation-Id`` as soon as the headers arrive, before the body, so a
    request that dies mid-body can still be reconciled through ``/generation``.

    Usage: ``async with AiohttpChat(url, api_key=key) as chat: reply = await chat.chat(body)``
    """

    def __init__(self, base_url: str, *, api_key: ApiKey, timeout_s: float = GATEWAY_READ_TIMEOUT_S,
                 connect_timeout_s: float = GATEWAY_CONNECT_TIMEOUT_S) -> None:  # fmt: skip
        self.base_url, self.host = gateway_url(base_url)
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._session: Any = None

    async def __aenter__(self) -> AiohttpChat:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=self._timeout_s, sock_connect=self._connect_timeout_s),
            headers={**gateway_headers(self._api_key), "Content-Type": "application/json"},
        )
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply:
        """One chat completion; it may take ``read_timeout_s(timeout_s, max_tokens)``."""
        import aiohttp
        import orjson

        where = f"{self.host} POST /chat/completions"
        generation_id: str | None = None
        timeout = aiohttp.ClientTimeout(
            total=read_timeout_s(self._timeout_s, int(body.get("max_tokens") or 0)), sock_connect=self._connect_timeout_s
        )
        try:
            async with self._session.post(f"{self.base_url}/chat/completions", data=orjson.dumps(body),
                                          timeout=timeout) as reply:  # fmt: skip
                generation_id = reply.headers.get("X-Generation-Id")
                if generation_id and on_headers is not None:
                    on_headers(generation_id)
                raw = await reply.read()
                status, reason, headers = reply.status, reply.reason or "", reply.headers
        except TimeoutError:
            raise GatewayError(f"{where}: timed out", kind="timeout", generation_id=generation_id) from None
        except aiohttp.ClientConnectorError as exc:
            raise GatewayError(f"cannot reach {self.host}: {failure_reason(exc)}", kind="connect") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
            raise GatewayError(
                f"{where}: connection dropped ({failure_reason(exc)})", kind="disconnect", generation_id=generation_id
            ) from None
        except aiohttp.ClientError as exc:
            raise GatewayError(f"{where}: {exc.__class__.__name__}", kind="transport", generation_id=generation_id) from None
        if status >= 400:
            raise error_from(status, reason, raw, headers, where)
        return parse_chat_reply(raw, generation_id, where)
