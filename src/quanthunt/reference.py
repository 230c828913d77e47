"""A client for the team's local reference deployment (vLLM / SGLang OpenAI-compatible
server, or the sandbox's ``/reference/v1``): sampling, tokenization, and teacher-forced
scoring through ``/completions`` with ``echo: true`` and ``logprobs: k``.

Usage::

    async with Reference("http://127.0.0.1:8000/v1") as ref:
        prompt_ids = await ref.tokenize_chat(messages)
        scored = await ref.score(prompt_ids + completion_ids, top_logprobs=5)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx

from quanthunt.defaults import GATEWAY_LIMITS, GATEWAY_TIMEOUT
from quanthunt.errors import ConfigError
from quanthunt.gateway import ApiKey, GatewayError, check_base_url

REFERENCE_KEY_ENV = "REFERENCE_API_KEY"
"""Optional bearer key for a reference server started with ``--api-key``."""


@dataclass(frozen=True)
class Scored:
    """Teacher-forced scores of a token sequence: per position the token's text, its
    logprob given everything before it (None for the first), and the top alternatives."""

    tokens: list[str]
    logprobs: list[float | None]
    top: list[dict[str, float] | None]


@dataclass(frozen=True)
class Sampled:
    """A completion the reference sampled, with token ids when the server gives them."""

    text: str
    token_ids: list[int] | None
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class Reference:
    """The local reference deployment at ``base_url`` (``.../v1``)."""

    base_url: str
    model: str | None = None
    score_max_tokens: int = 0
    """``max_tokens`` of scoring requests: 0 where the server accepts it (the sandbox, recent
    vLLM), 1 for servers that insist on generating; the extra token is dropped either way."""
    transport: httpx.AsyncBaseTransport | None = None
    timeout: httpx.Timeout = field(default_factory=lambda: GATEWAY_TIMEOUT)

    def __post_init__(self) -> None:
        try:
            self.base_url = check_base_url(self.base_url)
        except ValueError as exc:
            raise ConfigError(f"reference base URL {exc}") from None
        self.host = urlsplit(self.base_url).netloc
        headers = {"User-Agent": "quanthunt"}
        if key := os.environ.get(REFERENCE_KEY_ENV, "").strip():
            headers["Authorization"] = f"Bearer {ApiKey(key).reveal()}"
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=self.transport, timeout=self.timeout, limits=GATEWAY_LIMITS
        )

    async def __aenter__(self) -> Reference:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._client.aclose()

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        where = f"reference {self.host} POST {path}"
        try:
            reply = await self._client.post(path, json=dict(body))
        except httpx.TimeoutException:
            raise GatewayError(f"{where}: timed out", kind="timeout") from None
        except httpx.ConnectError:
            raise GatewayError(f"cannot reach the reference deployment at {self.host}", kind="connect") from None
        except httpx.HTTPError as exc:
            raise GatewayError(f"{where}: {exc.__class__.__name__}", kind="disconnect") from None
        try:
            data = reply.json()
        except ValueError:
            raise GatewayError(f"{where} answered {reply.status_code} with a body that is not JSON", status=reply.status_code,
                               kind="malformed") from None  # fmt: skip
        if reply.status_code >= 400 or not isinstance(data, dict):
            message = data.get("error", {}).get("message", reply.reason_phrase) if isinstance(data, dict) else reply.reason_phrase
            raise GatewayError(f"{where} answered {reply.status_code}: {str(message)[:300]}", status=reply.status_code)
        return data

    async def model_id(self) -> str:
        """The served model's name (``model`` if configured, else the first one listed)."""
        if self.model:
            return self.model
        try:
            reply = await self._client.get("/models")
            self.model = str(reply.json()["data"][0]["id"])
        except httpx.ConnectError:
            raise GatewayError(f"cannot reach the reference deployment at {self.host}", kind="connect") from None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            raise GatewayError(f"reference {self.host} GET /models: no model listed", kind="unexpected_reply") from None
        return self.model

    async def tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of the chat-templated prompt, ready for the assistant's reply."""
        data = await self._post(
            "/tokenize", {"model": await self.model_id(), "messages": [dict(m) for m in messages], "add_generation_prompt": True}
        )
        return [int(t) for t in data["tokens"]]

    async def tokenize_text(self, text: str) -> list[int]:
        data = await self._post("/tokenize", {"model": await self.model_id(), "prompt": text, "add_special_tokens": False})
        return [int(t) for t in data["tokens"]]

    async def score(self, ids: Sequence[int], *, top_logprobs: int) -> Scored:
        """Teacher-forced logprobs of ``ids`` (any generated token is dropped)."""
        body = {"model": await self.model_id(), "prompt": list(ids), "echo": True, "logprobs": top_logprobs,
                "max_tokens": self.score_max_tokens, "temperature": 0}  # fmt: skip
        data = await self._post("/completions", body)
        try:
            logprobs = data["choices"][0]["logprobs"]
            tokens, values, top = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise GatewayError(
                f"reference {self.host}: /completions reply has no echoed logprobs", kind="unexpected_reply"
            ) from None
        n = len(ids)
        if len(tokens) < n:
            raise GatewayError(
                f"reference {self.host}: echoed {len(tokens)} tokens for a {n}-token prompt", kind="unexpected_reply"
            )
        return Scored(tokens=list(tokens[:n]), logprobs=list(values[:n]), top=list(top[:n]))

    async def sample(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int, temperature: float, seed: int) -> Sampled:
        body = {"model": await self.model_id(), "messages": [dict(m) for m in messages], "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed, "logprobs": True}  # fmt: skip
        data = await self._post("/chat/completions", body)
        try:
            choice = data["choices"][0]
            content = choice["logprobs"]["content"] if choice.get("logprobs") else []
            return Sampled(
                text=choice["message"]["content"] or "",
                token_ids=None,
                logprobs=[float(t["logprob"]) for t in content],
                finish_reason=choice.get("finish_reason"),
            )
        except (KeyError, IndexError, TypeError):
            raise GatewayError(f"reference {self.host}: unexpected chat reply", kind="unexpected_reply") from None
