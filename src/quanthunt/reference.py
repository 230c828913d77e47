"""A client for the team's local reference deployment (a vLLM or SGLang OpenAI-compatible
server, or the sandbox's ``/reference/v1``): sampling, tokenization, and teacher-forced
scoring through ``/completions`` with ``echo: true`` and ``logprobs: k``.

Real servers differ, and the client finds out which way each one goes before anything is
paid for (``Reference.check``, recorded in ``Capabilities``):

- ``/tokenize``: vLLM serves it at the server root only, SGLang at both the root and
  ``/v1``; the first that answers is used. vLLM's renders chats (``messages``); SGLang's
  takes text only, and its chat route returns the templated prompt's ids on request
  (``return_prompt_token_ids``, SGLang >= 0.5.13).
- ``max_tokens: 0`` with ``echo``: vLLM accepts it, SGLang refuses it (any generated token
  is dropped either way).
- ``return_tokens_as_token_ids``: vLLM names every token ``token_id:N`` on request, so the
  top alternatives are keyed by id; without it (SGLang) they are keyed by decoded text, and
  two ids that decode alike (byte-fallback pieces of one character) collide.
- echoed ``top_logprobs``: vLLM lists the top k plus the scored token when it is outside
  them (k or k+1 entries), SGLang only the top k. Nothing here reads rank from a list's
  length: see ``Position.outranked_by``.

Usage::

    async with Reference("http://127.0.0.1:8000/v1") as ref:
        await ref.check()                      # every route once; raises ReferenceUnusable
        prompt_ids = await ref.tokenize_chat(messages)
        scored = await ref.score(prompt_ids + completion_ids, top_logprobs=5)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from quanthunt.defaults import GATEWAY_LIMITS, GATEWAY_TIMEOUT
from quanthunt.errors import ConfigError, QuanthuntError
from quanthunt.gateway import TRANSIENT, ApiKey, GatewayError, backoff_s, parse_chat_reply
from quanthunt.replies import ChatReply
from quanthunt.urls import check_base_url

REFERENCE_KEY_ENV = "REFERENCE_API_KEY"
"""Optional bearer key for a reference server started with ``--api-key``."""
TOKEN_ID_PREFIX = "token_id:"  # noqa: S105 - a token name, not a secret
"""How vLLM names a token under ``return_tokens_as_token_ids``."""
CHECK_MESSAGES = ({"role": "user", "content": "Say hello."},)
"""The chat ``Reference.check`` sends to every route."""
END_OF_TURN_PROBE = "Hello."
"""The assistant message ``Reference.end_of_turn`` renders open and closed."""
NAME_MATCH_TOLERANCE = 1e-3
"""Two replies' logprobs of one token agree to this (vLLM batches requests, so the two
replies of ``score(..., names=True)`` may differ in the last bits)."""
PARTIAL = ""
"""The name of a token that is part of a UTF-8 sequence (vLLM's; the sandbox's too). A
server that decodes such a piece to text with U+FFFD is read as naming it this way."""


class ReferenceUnusable(ConfigError):
    """The reference deployment cannot do what verification needs (found before any paid
    request): the message names the server and the route."""


class ReferenceDown(QuanthuntError):
    """The reference stopped answering after ``check`` passed and stayed down for
    ``retry_for_s``: the run stops (exit 2) rather than count the replies it could not
    score against the providers that were paid for them."""


def canonical_name(name: str) -> str:
    """A token's decoded text, with every partial UTF-8 piece named ``PARTIAL``."""
    return PARTIAL if "\ufffd" in name else name


@dataclass(frozen=True)
class Position:
    """The reference's teacher-forced view of one position of a scored sequence.

    ``top`` maps each listed alternative to its logprob: keyed by token id when the server
    names tokens by id, else by decoded text (``canonical_name``). It holds the top k, and
    may or may not hold the scored token besides (vLLM adds it, SGLang does not)."""

    token_id: int
    logprob: float
    top: Mapping[int | str, float]
    key: int | str
    """The scored token's key in ``top`` (its id, or its canonical name)."""
    names: Mapping[int | str, str] | None = None
    """The decoded name in context of every key of ``top`` (``score(..., names=True)``)."""

    def others(self) -> list[tuple[int | str, float]]:
        """The listed alternatives other than the scored token, most likely first."""
        return sorted(((k, v) for k, v in self.top.items() if k != self.key), key=lambda item: -item[1])

    def outranked_by(self) -> list[float]:
        """Logprobs of the listed alternatives other than the scored token, highest first."""
        return [v for _, v in self.others()]

    def in_top(self, k: int) -> bool:
        """Whether the scored token is among the reference's top ``k``: fewer than ``k``
        other tokens are more likely (decided by value, whatever the list's length)."""
        return sum(1 for v in self.outranked_by() if v > self.logprob) < k


@dataclass(frozen=True)
class Scored:
    """Teacher-forced scores of a token sequence. ``positions[i]`` is None for the first
    token (nothing before it to condition on)."""

    token_ids: list[int]
    positions: list[Position | None]


@dataclass(frozen=True)
class Sampled:
    """A completion the reference sampled."""

    text: str
    reasoning: str | None
    logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class Capabilities:
    """What ``Reference.check`` found the server does."""

    model: str
    tokenize_url: str
    score_max_tokens: int
    token_ids: bool
    """The server names tokens by id on request (``return_tokens_as_token_ids``)."""
    chat_ids_from_tokenize: bool
    """The tokenize route renders chats (vLLM); else the chat route returns prompt ids (SGLang)."""


@dataclass
class Reference:
    """The local reference deployment at ``base_url`` (``.../v1``).

    ``retry_for_s``: once ``check`` has passed, how long a request that failed for a
    transient reason (a timeout, a refused connection, 408/429/5xx) is retried before
    ``ReferenceDown``. Before it, failures are reported at once (nothing is paid yet, and a
    server that was never started should not keep the user waiting). Each retried failure
    is counted in ``retried`` by kind."""

    base_url: str
    model: str | None = None
    transport: httpx.AsyncBaseTransport | None = None
    timeout: httpx.Timeout = field(default_factory=lambda: GATEWAY_TIMEOUT)
    retry_for_s: float = 0.0
    retried: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        try:
            self.base_url = check_base_url(self.base_url)
        except ValueError as exc:
            raise ConfigError(f"reference base URL {exc}") from None
        parts = urlsplit(self.base_url)
        self.host = parts.netloc
        self.root_url = self.base_url.removesuffix("/v1")
        """The server root: vLLM serves ``/tokenize`` here, not under ``/v1``."""
        headers = {"User-Agent": "quanthunt"}
        if key := os.environ.get(REFERENCE_KEY_ENV, "").strip():
            headers["Authorization"] = f"Bearer {ApiKey(key).reveal()}"
        self._client = httpx.AsyncClient(headers=headers, transport=self.transport, timeout=self.timeout, limits=GATEWAY_LIMITS)
        self._capabilities: Capabilities | None = None
        self._end_of_turn: int | None = None
        self._finding_end_of_turn = asyncio.Lock()

    async def __aenter__(self) -> Reference:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._client.aclose()

    def _route(self, url: str) -> str:
        return url.removeprefix(f"{urlsplit(url).scheme}://{self.host}") or "/"

    async def _send(self, method: str, url: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        where = f"reference {self.host} {method} {self._route(url)}"
        try:
            reply = await self._client.request(method, url, json=dict(body) if body is not None else None)
        except httpx.TimeoutException:
            raise GatewayError(f"{where}: timed out", kind="timeout") from None
        except httpx.ConnectError:
            raise GatewayError(f"cannot reach the reference deployment at {self.host}", kind="connect") from None
        except httpx.HTTPError as exc:
            raise GatewayError(f"{where}: {exc.__class__.__name__}", kind="disconnect") from None
        try:
            data = reply.json()
        except ValueError:
            if reply.status_code >= 400:
                raise GatewayError(f"{where} answered {reply.status_code}", status=reply.status_code) from None
            raise GatewayError(f"{where} answered {reply.status_code} with a body that is not JSON", status=reply.status_code,
                               kind="malformed") from None  # fmt: skip
        return reply.status_code, data

    async def _post(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST, retrying transient failures for ``retry_for_s`` once ``check`` has passed."""
        deadline: float | None = None
        attempt = 0
        while True:
            try:
                return await self._post_once(url, body)
            except GatewayError as exc:
                if self._capabilities is None or self.retry_for_s <= 0 or exc.kind not in TRANSIENT:
                    raise
                now = time.monotonic()
                deadline = now + self.retry_for_s if deadline is None else deadline
                if now >= deadline:
                    raise ReferenceDown(
                        f"{exc}; still failing after {self.retry_for_s:g} s of retries: restart the reference "
                        f"deployment at {self.base_url} and run again"
                    ) from None
                self.retried[exc.kind] += 1
                attempt += 1
                await asyncio.sleep(min(backoff_s(exc, attempt), deadline - now))

    async def _post_once(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        status, data = await self._send("POST", url, body)
        if status >= 400 or not isinstance(data, dict):
            raise GatewayError(
                f"reference {self.host} POST {self._route(url)} answered {status}: {_message(data)}", status=status
            )
        return data

    # -- finding out what the server does -----------------------------------------------------

    async def check(self) -> Capabilities:
        """Call every route verification needs once, before any paid request, and record how
        this server answers. Raises ``ReferenceUnusable`` naming the server and route."""
        if self._capabilities is not None:
            return self._capabilities
        try:
            model = await self.model_id()
            tokenize_url, data = await self._first_route("tokenize", {"model": model, "prompt": "Say hello.",
                                                                      "add_special_tokens": False})  # fmt: skip
            if not isinstance(data.get("tokens"), list):
                raise ReferenceUnusable(f"reference {self.base_url}: POST {self._route(tokenize_url)} returned no tokens")
            draft = Capabilities(model, tokenize_url, 0, False, await self._tokenizes_chats(tokenize_url))
            ids = await self._tokenize_chat(draft, list(CHECK_MESSAGES))
            if len(ids) < 2:
                raise ReferenceUnusable(f"reference {self.base_url}: a chat prompt tokenized to {len(ids)} tokens")
            score_max_tokens, token_ids = await self._scoring_mode(model, ids)
            await self._post(f"{self.base_url}/chat/completions", {"model": model, "max_tokens": 1, "temperature": 0,
                             "messages": list(CHECK_MESSAGES), "logprobs": True})  # fmt: skip
        except GatewayError as exc:
            reason = str(exc) if exc.kind == "connect" else f"the reference deployment cannot serve verification: {exc}"
            raise ReferenceUnusable(reason) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ReferenceUnusable(f"reference {self.base_url}: unexpected reply ({exc.__class__.__name__}: {exc})") from None
        self._capabilities = dataclasses.replace(draft, score_max_tokens=score_max_tokens, token_ids=token_ids)
        return self._capabilities

    async def _tokenizes_chats(self, tokenize_url: str) -> bool:
        """Whether the tokenize route renders chats (vLLM: ``messages``); SGLang's takes only
        text, and the chat route returns the prompt's ids instead (``return_prompt_token_ids``)."""
        body = {"model": self.model, "add_generation_prompt": True, "messages": list(CHECK_MESSAGES)}
        status, data = await self._send("POST", tokenize_url, body)
        return status == 200 and isinstance(data, dict) and isinstance(data.get("tokens"), list)

    async def _first_route(self, name: str, body: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The first of ``<root>/<name>`` (vLLM) and ``<base>/<name>`` that answers 200, and its reply."""
        tried = []
        for url in dict.fromkeys((f"{self.root_url}/{name}", f"{self.base_url}/{name}")):
            status, data = await self._send("POST", url, body)
            if status == 200 and isinstance(data, dict):
                return url, data
            tried.append(f"POST {self._route(url)} answered {status}: {_message(data)}")
        raise ReferenceUnusable(f"reference {self.base_url} has no {name} route ({'; '.join(tried)})")

    async def _scoring_mode(self, model: str, ids: list[int]) -> tuple[int, bool]:
        """``max_tokens`` for scoring (0, else 1 where the server insists on generating, as
        SGLang does) and whether tokens come back named by id (vLLM, on request)."""
        body = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "temperature": 0}
        answers = []
        for max_tokens, by_id in ((0, True), (1, True), (0, False), (1, False)):
            status, data = await self._send("POST", f"{self.base_url}/completions",
                                            body | {"max_tokens": max_tokens} | _ids_flag(by_id))  # fmt: skip
            if status == 200 and isinstance(data, dict):
                tokens = _echoed(data, len(ids), self.host)[0]
                return max_tokens, by_id and all(t.startswith(TOKEN_ID_PREFIX) for t in tokens)
            answers.append(f"{status}: {_message(data)}")
        raise ReferenceUnusable(
            f"reference {self.base_url} cannot score: POST /v1/completions with echo answered {'; '.join(dict.fromkeys(answers))}"
        )

    async def server_version(self) -> str:
        """What the server says it is at ``GET /version`` (vLLM: ``{"version": "0.32.0"}``),
        or ``unknown`` where it has no such route (SGLang's is elsewhere)."""
        try:
            status, data = await self._send("GET", f"{self.root_url}/version")
        except GatewayError as exc:
            if exc.status == 404:
                return "unknown"
            raise
        version = data.get("version") if isinstance(data, dict) else None
        return str(version) if status < 400 and version else "unknown"

    async def model_id(self) -> str:
        """The served model's name (``model`` if configured, else the first one listed)."""
        if not self.model:
            self.model = (await self.served_models())[0]
        return self.model

    async def served_models(self) -> list[str]:
        """Every model name ``GET /models`` lists (at least one, or ``GatewayError``)."""
        status, data = await self._send("GET", f"{self.base_url}/models")
        try:
            names = [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError):
            names = []
        if not names:
            raise GatewayError(f"reference {self.host} GET /models answered {status}: no model listed", kind="unexpected_reply")
        return names

    # -- the routes verification uses --------------------------------------------------------

    async def tokenize_chat(self, messages: Sequence[Mapping[str, str]], *, template_kwargs: Mapping[str, Any] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:  # fmt: skip
        """Token ids of the chat-templated prompt, ready for the assistant's reply.
        ``template_kwargs`` reach the chat template (e.g. ``{"thinking": False}``)."""
        return await self._tokenize_chat(await self.check(), messages, template_kwargs, add_generation_prompt)

    async def end_of_turn(self, *, template_kwargs: Mapping[str, Any] | None = None) -> int:
        """The token that ends the assistant's turn (SmolLM2's and Kimi's ``<|im_end|>``):
        what a reply that finished with ``stop`` sampled last, and what the rank statistic
        scores there. Read from the chat template: the first token after an assistant
        message rendered open (vLLM's ``continue_final_message``) in the same conversation
        rendered closed; where the server renders only generation prompts (SGLang), after
        the same message in a conversation that goes on. Raises ``ReferenceUnusable`` where
        the two renders do not agree up to it."""
        async with self._finding_end_of_turn:
            if self._end_of_turn is None:
                self._end_of_turn = await self._find_end_of_turn(template_kwargs)
        return self._end_of_turn

    async def _find_end_of_turn(self, template_kwargs: Mapping[str, Any] | None) -> int:
        caps = await self.check()
        said = [*CHECK_MESSAGES, {"role": "assistant", "content": END_OF_TURN_PROBE}]
        if caps.chat_ids_from_tokenize:
            opened = await self._tokenize_chat(caps, said, template_kwargs, add_generation_prompt=False,
                                               continue_final_message=True)  # fmt: skip
            closed = await self._tokenize_chat(caps, said, template_kwargs, add_generation_prompt=False)
        else:
            opened = await self._tokenize_chat(caps, CHECK_MESSAGES, template_kwargs)
            opened += await self.tokenize_text(END_OF_TURN_PROBE)
            closed = await self._tokenize_chat(caps, [*said, *CHECK_MESSAGES], template_kwargs)
        if len(closed) <= len(opened) or closed[: len(opened)] != opened:
            raise ReferenceUnusable(
                f"reference {self.base_url}: cannot find the token that ends the assistant's turn (an assistant "
                f"message rendered closed does not start with it rendered open: {opened[-4:]} vs "
                f"{closed[len(opened) - 4 : len(opened) + 1]}); the rank statistic scores it where a reply stopped"
            )
        return closed[len(opened)]

    async def _tokenize_chat(
        self,
        caps: Capabilities,
        messages: Sequence[Mapping[str, str]],
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        body: dict[str, Any] = {"model": caps.model, "messages": [dict(m) for m in messages]}
        if template_kwargs:
            body["chat_template_kwargs"] = dict(template_kwargs)
        if caps.chat_ids_from_tokenize:
            body["add_generation_prompt"] = add_generation_prompt
            if continue_final_message:
                body["continue_final_message"] = True
            data = await self._post(caps.tokenize_url, body)
            return [int(t) for t in data["tokens"]]
        if not add_generation_prompt:
            raise ReferenceUnusable(f"reference {self.base_url} cannot render a chat without the generation prompt")
        data = await self._post(f"{self.base_url}/chat/completions",
                                body | {"max_tokens": 1, "temperature": 0, "return_prompt_token_ids": True})  # fmt: skip
        found = data.get("prompt_token_ids")
        if found is None and isinstance(data.get("choices"), list) and data["choices"]:
            found = data["choices"][0].get("prompt_token_ids")
        if not isinstance(found, list):
            raise ReferenceUnusable(
                f"reference {self.base_url}: POST {self._route(caps.tokenize_url)} takes no messages and "
                "POST /v1/chat/completions returned no prompt_token_ids: quanthunt cannot apply this server's chat template"
            )
        return [int(t) for t in found]

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` as the server's tokenizer decodes them, special tokens kept."""
        caps = await self.check()
        url = caps.tokenize_url.removesuffix("tokenize") + "detokenize"
        data = await self._post(url, {"model": caps.model, "tokens": list(ids)})
        text = data.get("prompt", data.get("text"))  # vLLM names it prompt, SGLang text
        if not isinstance(text, str):
            raise GatewayError(f"reference {self.host} POST {self._route(url)} returned no text", kind="unexpected_reply")
        return text

    async def tokenize_text(self, text: str) -> list[int]:
        caps = await self.check()
        data = await self._post(caps.tokenize_url, {"model": caps.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in data["tokens"]]

    async def score(self, ids: Sequence[int], *, top_logprobs: int, names: bool = False) -> Scored:
        """Teacher-forced logprobs of ``ids`` (any generated token is dropped), alternatives
        keyed by id where the server can. ``names=True`` also gives every position's
        alternatives' decoded text in context (``Position.names``), as a provider's chat
        logprobs name them: a second request where the first named tokens by id."""
        caps = await self.check()
        body = {"model": caps.model, "prompt": list(ids), "echo": True, "logprobs": top_logprobs,
                "max_tokens": caps.score_max_tokens, "temperature": 0}  # fmt: skip
        first = await self._post(f"{self.base_url}/completions", body | _ids_flag(caps.token_ids))
        tokens, values, tops = _echoed(first, len(ids), self.host)
        text_tokens, text_tops = tokens, tops
        if names and caps.token_ids:
            text_tokens, _, text_tops = _echoed(await self._post(f"{self.base_url}/completions", body), len(ids), self.host)
        positions: list[Position | None] = []
        for i, (token_id, value, top) in enumerate(zip(ids, values, tops, strict=True)):
            if value is None or top is None:
                positions.append(None)
                continue
            keyed: dict[int | str, float] = {_key(k, caps.token_ids): float(v) for k, v in top.items()}
            key: int | str = token_id if caps.token_ids else _key(tokens[i], False)
            naming: dict[int | str, str] | None = None
            if names:
                named_top = {canonical_name(k): float(v) for k, v in (text_tops[i] or {}).items()}
                naming = {k: _name_of(k, v, named_top) for k, v in keyed.items()} | {key: canonical_name(text_tokens[i])}
            positions.append(Position(token_id, float(value), keyed, key, naming))
        return Scored(list(ids), positions)

    async def sample(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sampled:
        caps = await self.check()
        body: dict[str, Any] = {"model": caps.model, "messages": [dict(m) for m in messages], "max_tokens": max_tokens,
                                "temperature": temperature, "seed": seed, "logprobs": True}  # fmt: skip
        if template_kwargs:
            body["chat_template_kwargs"] = dict(template_kwargs)
        data = await self._post(f"{self.base_url}/chat/completions", body)
        try:
            choice = data["choices"][0]
            message = choice["message"]
            content = choice["logprobs"]["content"] if choice.get("logprobs") else []
            return Sampled(
                text=message.get("content") or "",
                reasoning=message.get("reasoning_content") or message.get("reasoning"),
                logprobs=[float(t["logprob"]) for t in content],
                finish_reason=choice.get("finish_reason"),
            )
        except (KeyError, IndexError, TypeError, AttributeError):
            raise GatewayError(f"reference {self.host}: unexpected chat reply", kind="unexpected_reply") from None

    async def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        top_logprobs: int,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatReply:
        """A sampled chat completion with its logprobs and top alternatives, parsed as a
        provider's reply is (``gateway.parse_chat_reply``): ``calibrate`` measures a control
        deployment exactly as verify measures a provider. Needs only ``/models`` and the chat
        route, not ``check``: a control is never scored at."""
        body: dict[str, Any] = {"model": await self.model_id(), "messages": [dict(m) for m in messages],
                                "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "logprobs": True,
                                "top_logprobs": top_logprobs}  # fmt: skip
        if template_kwargs:
            body["chat_template_kwargs"] = dict(template_kwargs)
        data = await self._post(f"{self.base_url}/chat/completions", body)
        return parse_chat_reply(json.dumps(data).encode(), None, f"{self.host} POST /chat/completions")


def _message(data: Any) -> str:
    """The error text of a vLLM (``{"error": {"message"}}``), SGLang or Starlette
    (``{"detail"}``) error body."""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
        if data.get("detail"):
            return str(data["detail"])[:300]
        if data.get("message"):
            return str(data["message"])[:300]
    return str(data)[:300]


def merge_by_name(alternatives: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Alternatives (name, logprob) merged by ``canonical_name``, their probabilities summed:
    the pieces of one character that a server names alike become one outcome."""
    merged: dict[str, float] = {}
    for name, logprob in alternatives:
        key = canonical_name(name)
        merged[key] = float(np.logaddexp(merged[key], logprob)) if key in merged else logprob
    return merged


def _name_of(key: int | str, logprob: float, named_top: Mapping[str, float]) -> str:
    """The decoded name of an alternative keyed by id: the name listed with the same logprob
    in the by-text reply (``NAME_MATCH_TOLERANCE``), else a partial piece whose name
    collided with another's there."""
    if isinstance(key, str):
        return key
    closest = min(named_top.items(), key=lambda item: abs(item[1] - logprob), default=None)
    return closest[0] if closest is not None and abs(closest[1] - logprob) <= NAME_MATCH_TOLERANCE else PARTIAL


def _ids_flag(by_id: bool) -> dict[str, bool]:
    return {"return_tokens_as_token_ids": True} if by_id else {}


def _key(name: str, by_id: bool) -> int | str:
    if by_id:
        return int(name.removeprefix(TOKEN_ID_PREFIX))
    return canonical_name(name)


def _echoed(data: Mapping[str, Any], n: int, host: str) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
    """The first ``n`` echoed tokens, their logprobs and top alternatives."""
    try:
        logprobs = data["choices"][0]["logprobs"]
        tokens, values, top = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise GatewayError(f"reference {host}: /completions reply has no echoed logprobs", kind="unexpected_reply") from None
    if len(tokens) < n or len(values) < n or len(top) < n:
        raise GatewayError(f"reference {host}: echoed {len(tokens)} tokens for a {n}-token prompt", kind="unexpected_reply")
    for value in values[1:n]:
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise GatewayError(f"reference {host}: echoed logprob {value!r} is not a number", kind="unexpected_reply")
    return [str(t) for t in tokens[:n]], list(values[:n]), list(top[:n])
