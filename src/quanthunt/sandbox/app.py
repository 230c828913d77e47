"""The sandbox gateway: OpenRouter's API under ``/api/v1`` and a vLLM-style local
reference deployment under ``/reference/v1`` (and the roster's other ``deployments`` under
``/deployments/<name>/v1``), over one engine.

Nothing here knows about quanthunt's pipeline: it is just another gateway at a base URL.
Reply shapes follow OpenRouter's published OpenAPI spec (the tests validate them against
schemas derived from it); the facts the spec omits (402 ``limit_source``, HTTP 200 with
``finish_reason: "error"``, ``X-Generation-Id``) follow OpenRouter's docs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from quanthunt.config_files import validated
from quanthunt.defaults import SANDBOX_GENERATIONS_KEPT
from quanthunt.errors import ConfigError
from quanthunt.sandbox import catalogue, thinking
from quanthunt.sandbox import faults as fault_kinds
from quanthunt.sandbox.billing import Billing, Refusal, key_digest
from quanthunt.sandbox.engine import Completion, CompletionEngine, SamplingRequest
from quanthunt.sandbox.faults import MisbehavingResponse
from quanthunt.sandbox.reference_api import reference_routes
from quanthunt.sandbox.render import error_response, logprob_items, text_deltas
from quanthunt.sandbox.requests import BadRequest, ChatParams, parse_chat, parse_json_object
from quanthunt.sandbox.roster import Provider, Roster, Truth
from quanthunt.sandbox.routing import NoEndpoint, route
from quanthunt.sandbox.server import GATEWAYS_PATH


class TokenBucket:
    """A provider's rate limit: ``rps`` refill, ``burst`` capacity."""

    def __init__(self, rps: float, burst: int) -> None:
        self.rps, self.burst = rps, float(burst)
        self.tokens, self.stamp = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0 when a request may go now, else seconds until one may."""
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rps)
            self.stamp = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rps


@dataclass
class Stats:
    """What the sandbox did, for reconciliation and load tests (``/api/v1/sandbox/stats``)."""

    requests: int = 0
    """Chat completion requests received, whatever became of them: refused (a bad request, no
    endpoint, no credit), failed at every fallback, or served."""
    in_flight: int = 0
    """Chat completion requests not answered yet."""
    peak_in_flight: int = 0
    """The most ``in_flight`` has been at once."""
    served: Counter[str] = field(default_factory=Counter)
    """Requests each endpoint tag served (the one that answered, after any fallbacks), counted
    when done; an injected fault may still have spoiled the reply."""
    faults: Counter[str] = field(default_factory=Counter)
    """Injected faults by ``<tag>:<kind>``, or ``gateway:<kind>`` for the gateway's own."""
    precisions: Counter[str] = field(default_factory=Counter)
    """Those requests by the precision that really served them."""
    admitted: Counter[str] = field(default_factory=Counter)
    """Chat requests each endpoint tag began serving, counted before any await (``served``
    counts them done), so a provider's drift after N requests falls at the same request each run."""
    drifted: dict[str, list[str]] = field(default_factory=dict)
    """Generation ids each endpoint served under a drift (the hidden truth, for tests)."""


@dataclass
class _Call:
    """One chat/completions call on its way through routing, attempts and billing."""

    key: str
    reserved: float
    params: ChatParams
    prompt_ids: list[int]
    gen_id: str = field(default_factory=lambda: "gen-" + secrets.token_urlsafe(18))
    attempts: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    settled: bool = False


@dataclass
class _Reply:
    provider: Provider
    completion: Completion
    usage: dict[str, Any]
    logprobs: bool


class Sandbox:
    """State of one sandbox process: roster, engine, billing, generations, stats."""

    def __init__(self, roster: Roster, engine: CompletionEngine) -> None:
        self.roster = roster
        self.engine = engine
        self.billing = Billing(roster.credits)
        self.generations: OrderedDict[str, catalogue.GenerationRecord] = OrderedDict()
        self.rng = random.Random(roster.seed)
        self.buckets = {p.tag: TokenBucket(p.rate_limit.rps, p.rate_limit.burst) for p in roster.providers if p.rate_limit}
        self.slots = {p.tag: asyncio.Semaphore(p.max_concurrent) for p in roster.providers if p.max_concurrent}
        self.stats = Stats()
        self.started = time.time()
        self.clock = time.monotonic()  # drifts ``after_s`` count from here

    # -- helpers ---------------------------------------------------------------------

    def authorised(self, request: Request) -> str | Response:
        """The caller's key once the gateway's own faults are drawn: the key, or the response to answer."""
        if (fault := self.gateway_fault()) is not None:
            return fault
        return self.caller(request)

    def caller(self, request: Request) -> str | Response:
        """The request's bearer key, or the 401 to answer when it has none."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key:
            return key
        return error_response(401, "Missing Authentication header")

    def truth_for(self, provider: Provider) -> Truth:
        """The provider's truth, as drifted, for a request it now begins to serve (counted)."""
        earlier = self.stats.admitted[provider.tag]
        self.stats.admitted[provider.tag] += 1
        return provider.truth_at(earlier, time.monotonic() - self.clock)

    def precision_for(self, provider: Provider, truth: Truth, params: ChatParams, prompt_ids: list[int]) -> str:
        """The precision serving this request: the truth's, or a mixture share's.
        Seeded requests get a deterministic draw, so a seeded probe set repeats."""
        if not truth.mixture:
            return truth.precision
        if params.seed is not None:
            digest = hashlib.sha256(f"{self.roster.seed}:{provider.slug}:{params.seed}:{prompt_ids}".encode()).digest()
            u = int.from_bytes(digest[:8], "big") / 2**64
        else:
            u = self.rng.random()
        for precision, share in truth.mixture.items():
            u -= share
            if u < 0:
                return precision
        return truth.precision

    def remember(self, record: catalogue.GenerationRecord) -> None:
        self.generations[record.id] = record
        while len(self.generations) > SANDBOX_GENERATIONS_KEPT:
            self.generations.popitem(last=False)

    def gateway_fault(self) -> Response | None:
        """A fault of the gateway itself (``roster.gateway_faults``), or None."""
        faults = self.roster.gateway_faults
        kind = fault_kinds.draw(faults, self.rng)
        if kind is None or kind in fault_kinds.CHAT_ONLY:
            return None
        self.stats.faults[f"gateway:{kind}"] += 1
        if kind in fault_kinds.BEFORE_GENERATION:
            status = fault_kinds.ERROR_STATUS[kind]
            headers = {"Retry-After": f"{faults.retry_after_s:g}"} if kind == "rate_limit" else None
            return error_response(status, fault_kinds.ERROR_MESSAGE[status], headers=headers)
        if kind == "malformed_json":
            return Response(b'{"data": [', media_type="application/json")
        how = {"timeout": "hold", "truncated_body": "truncate", "connection_reset": "drop"}[kind]
        return MisbehavingResponse(b'{"data": {"id": "gateway"}}', how=how, headers={}, hold_s=faults.timeout_s)  # type: ignore[return-value]

    # -- OpenRouter API ----------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        if (fault := self.gateway_fault()) is not None:
            return fault
        return JSONResponse(
            {"data": [catalogue.model_entry(self.roster, int(self.started))], "total_count": 1, "links": {"next": None}}
        )

    async def list_endpoints(self, request: Request) -> Response:
        if (fault := self.gateway_fault()) is not None:
            return fault
        model_id = f"{request.path_params['author']}/{request.path_params['slug']}".lower()
        model = self.roster.model
        if model_id != model.id:
            return error_response(404, f"Model {model_id} not found")
        return JSONResponse({"data": catalogue.model_endpoints(self.roster, int(self.started))})

    async def key_info(self, request: Request) -> Response:
        key = self.authorised(request)
        if isinstance(key, Response):
            return key
        return JSONResponse({"data": catalogue.key_data(key, self.billing.account(key))})

    async def generation(self, request: Request) -> Response:
        key = self.authorised(request)
        if isinstance(key, Response):
            return key
        gen_id = request.query_params.get("id", "")
        if not gen_id:
            return error_response(400, "id is required")
        record = self.generations.get(gen_id)
        delay = self.roster.generation_lookup_delay_s
        if record is None or record.key_digest != key_digest(key) or time.time() - record.finished < delay:
            return error_response(404, f"Generation {gen_id} not found")
        return JSONResponse({"data": record.body(self.roster.model.id)})

    async def stats_route(self, request: Request) -> Response:
        key = self.caller(request)
        if isinstance(key, Response):
            return key
        account = self.billing.account(key)
        return JSONResponse(
            {
                "mode": self.engine.mode,
                "requests": self.stats.requests,
                "in_flight": self.stats.in_flight,
                "peak_in_flight": self.stats.peak_in_flight,
                "served": dict(self.stats.served),
                "faults": dict(self.stats.faults),
                "precisions": dict(self.stats.precisions),
                "drift": {  # the drift now in force per endpoint that has any (null: none yet)
                    p.tag: p.truth_at(self.stats.admitted[p.tag], time.monotonic() - self.clock).drift
                    for p in self.roster.providers
                    if p.drift
                },
                "drifted_generations": self.stats.drifted,
                "compute": getattr(self.engine, "compute_stats", dict)(),
                "key": {
                    "usage": account.usage,
                    "limit": account.limit,
                    "reserved": account.reserved,
                    "requests_billed": account.requests_billed,
                },
            }
        )

    async def add_credits(self, request: Request) -> Response:
        key = self.caller(request)
        if isinstance(key, Response):
            return key
        try:
            data = parse_json_object(await request.body())
        except BadRequest as exc:
            return error_response(400, str(exc))
        amount = data.get("add_usd")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not 0 <= amount < 1e9:
            return error_response(400, "add_usd must be a non-negative number")
        account = self.billing.add_credit(key, float(amount))
        return JSONResponse({"data": {"limit": account.limit, "limit_remaining": account.remaining, "usage": account.usage}})

    async def chat_completions(self, request: Request) -> Response:
        self.stats.requests += 1
        self.stats.in_flight += 1
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        try:
            return await self._chat(request)
        finally:
            self.stats.in_flight -= 1

    async def _chat(self, request: Request) -> Response:
        key = self.caller(request)
        if isinstance(key, Response):
            return key
        try:
            params = parse_chat(parse_json_object(await request.body()))
        except BadRequest as exc:
            return error_response(exc.status, str(exc))
        if params.model.lower() != self.roster.model.id:
            return error_response(400, f"{params.model} is not a valid model ID")
        thinking_profile = self.roster.model.reasoning
        if thinking_profile is not None and thinking_profile.mandatory and not params.thinking:
            return error_response(400, f"Reasoning is mandatory for {params.model} and cannot be disabled")
        prompt_ids = thinking.prompt_ids(self.engine, params.messages, thinking_profile, enabled=params.thinking)
        limit = min(self.roster.model.context_length, self.engine.context_length)
        if len(prompt_ids) + params.max_tokens > limit:
            return error_response(
                400,
                f"This endpoint's maximum context length is {limit} tokens. However, you requested "
                f"about {len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} of text input, "
                f"{params.max_tokens} in the output). Please reduce the length of either one.",
            )
        try:
            candidates = route(
                self.roster,
                params.preferences,
                parameters=params.parameters,
                prompt_tokens=len(prompt_ids),
                max_tokens=params.max_tokens,
                rng=self.rng,
            )
        except NoEndpoint as exc:
            if exc.constraint_filtered:
                return error_response(404, str(exc), availability={"code": "constraint_filtered"})
            return error_response(503, str(exc))
        worst = max(p.pricing.cost(len(prompt_ids), params.max_tokens) for p in candidates)
        try:
            reserved = self.billing.reserve(key, worst)
        except Refusal as refusal:
            headers = {"Retry-After": f"{refusal.retry_after_s:g}"} if refusal.retry_after_s else None
            named = refusal.limit_source == "openrouter_in_flight_budget" or self.roster.credits.limit_source_in_402
            return error_response(402, str(refusal), metadata={"limit_source": refusal.limit_source} if named else None,
                                  headers=headers)  # fmt: skip
        call = _Call(key=key, reserved=reserved, params=params, prompt_ids=prompt_ids)
        try:
            return await self._attempts(call, candidates)
        finally:
            if not call.settled:
                self.billing.release(key, reserved)

    async def _attempts(self, call: _Call, candidates: list[Provider]) -> Response:
        """Try each candidate in order until one serves (fallbacks), as OpenRouter does."""
        failure: Response | None = None
        for provider in candidates:
            wait_s = self.buckets[provider.tag].take() if provider.tag in self.buckets else 0.0
            fault = "rate_limit" if wait_s > 0 else fault_kinds.draw(provider.faults, self.rng)
            if fault:
                self.stats.faults[f"{provider.tag}:{fault}"] += 1
            if fault == "error_200":  # the provider failed after the gateway committed to 200: no fallback
                call.attempts.append(self._attempt(call, provider, 502))
                error = {"code": 502, "message": fault_kinds.ERROR_MESSAGE[502], "metadata": {"provider_name": provider.name}}
                return JSONResponse({"error": error})
            if fault in fault_kinds.BEFORE_GENERATION:
                status = fault_kinds.ERROR_STATUS[fault]
                call.attempts.append(self._attempt(call, provider, status))
                retry_after = max(wait_s, provider.faults.retry_after_s) if fault == "rate_limit" else None
                failure = error_response(
                    status,
                    fault_kinds.ERROR_MESSAGE[status],
                    metadata={"provider_name": provider.name, "raw": None},
                    headers={"Retry-After": f"{retry_after:g}"} if retry_after is not None else None,
                )
                continue
            return await self._serve(call, provider, fault)
        assert failure is not None
        return failure

    def _attempt(self, call: _Call, provider: Provider, status: int) -> dict[str, Any]:
        """One ``provider_responses[]`` entry of the generation record."""
        return {
            "id": f"{call.gen_id}-{provider.slug}",
            "endpoint_id": provider.tag,
            "model_permaslug": self.roster.model.id,
            "provider_name": provider.name,
            "status": status,
            "latency": round((time.monotonic() - call.started) * 1000, 3),
            "is_byok": False,
        }

    async def _serve(self, call: _Call, provider: Provider, fault: str | None) -> Response:
        params, prompt_ids = call.params, call.prompt_ids
        truth = self.truth_for(provider)
        if truth.drift is not None:
            self.stats.drifted.setdefault(provider.tag, []).append(call.gen_id)
        precision = self.precision_for(provider, truth, params, prompt_ids)
        sampling = SamplingRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=params.max_tokens,
            temperature=max(params.temperature + truth.temperature_offset, 0.0),
            top_p=params.top_p,
            seed=params.seed if params.seed is not None else self.rng.getrandbits(63),
            top_logprobs=params.top_logprobs if provider.supports_logprobs else 0,
            stop=params.stop,
            processed_logprobs=provider.logprobs_mode == "processed_logprobs",
        )
        if fault == "finish_error":
            completion = Completion(text="", tokens=[], finish_reason="error", prompt_tokens=len(prompt_ids))
        else:
            async with self.slots.get(provider.tag) or contextlib.nullcontext():  # a loaded provider: wait for a slot
                completion = await thinking.complete(
                    self.engine, precision, sampling, self.roster.model.reasoning, enabled=params.thinking,
                    pace=(provider.latency_ms / 1000, provider.throughput_tps),
                )  # fmt: skip
        if fault == "empty_answer":  # every token went to reasoning
            completion = dataclasses.replace(completion, text="", reasoning=completion.text, finish_reason="length",
                                             reasoning_tokens=len(completion.tokens))  # fmt: skip
        completion_tokens = len(completion.tokens)
        billed = fault != "connection_reset" and completion_tokens > 0
        cost = provider.pricing.cost(len(prompt_ids), completion_tokens) if billed else 0.0
        self.billing.settle(call.key, call.reserved, cost)
        call.settled = True
        self.stats.served[provider.tag] += 1
        self.stats.precisions[precision] += 1
        status = 200 if fault in (None, "timeout", "malformed_json", "truncated_body", "empty_answer") else 502
        call.attempts.append(self._attempt(call, provider, status))
        reply = _Reply(
            provider=provider,
            completion=completion,
            usage={
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
                "cost": cost,
                "is_byok": False,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": completion.reasoning_tokens},
            },
            logprobs=params.logprobs and provider.supports_logprobs and fault != "empty_answer",
        )
        self.remember(self._generation_record(call, reply))
        headers = {"X-Generation-Id": call.gen_id}
        if params.stream:
            return self._stream(call, reply, headers, fault)
        raw = orjson.dumps(self._result(call, reply))
        if fault == "malformed_json":
            return Response(raw[: len(raw) // 3] + b"<!-- upstream error -->", media_type="application/json", headers=headers)
        if fault == "timeout":
            return MisbehavingResponse(raw, how="hold", headers=headers, hold_s=provider.faults.timeout_s)  # type: ignore[return-value]
        if fault == "truncated_body":
            return MisbehavingResponse(raw, how="truncate", headers=headers)  # type: ignore[return-value]
        if fault == "connection_reset":
            return MisbehavingResponse(raw, how="drop", headers=headers)  # type: ignore[return-value]
        return Response(raw, media_type="application/json", headers=headers)

    def _generation_record(self, call: _Call, reply: _Reply) -> catalogue.GenerationRecord:
        return catalogue.GenerationRecord(
            id=call.gen_id,
            key_digest=key_digest(call.key),
            finished=time.time(),
            elapsed_ms=round((time.monotonic() - call.started) * 1000, 3),
            provider_name=reply.provider.name,
            cost=reply.usage["cost"],
            prompt_tokens=reply.usage["prompt_tokens"],
            completion_tokens=reply.usage["completion_tokens"],
            finish_reason=reply.completion.finish_reason,
            streamed=call.params.stream,
            attempts=call.attempts,
        )

    def _result(self, call: _Call, reply: _Reply) -> dict[str, Any]:
        """The ``ChatResult`` body, with OpenRouter's top-level ``provider``."""
        completion = reply.completion
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": completion.finish_reason,
            "native_finish_reason": completion.finish_reason,
            "message": {
                "role": "assistant",
                "content": completion.text or (None if completion.reasoning is not None else ""),
                "refusal": None,
                "reasoning": completion.reasoning,
            },
            "logprobs": {
                "content": logprob_items(
                    completion.tokens, as_ids=call.params.return_token_ids, top_logprobs=call.params.top_logprobs
                ),
                "refusal": None,
            }
            if reply.logprobs
            else None,
        }
        if completion.finish_reason == "error":
            choice["error"] = {
                "code": 502,
                "message": "Provider returned error",
                "metadata": {"provider_name": reply.provider.name},
            }
        return {
            "id": call.gen_id,
            "provider": reply.provider.reply_name,
            "model": self.roster.model.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "system_fingerprint": None,
            "choices": [choice],
            "usage": reply.usage,
        }

    def _stream(self, call: _Call, reply: _Reply, headers: dict[str, str], fault: str | None) -> Response:
        """Server-sent events: one chunk per token, then finish_reason and usage, then [DONE]."""
        completion, as_ids = reply.completion, call.params.return_token_ids
        base = {
            "id": call.gen_id,
            "provider": reply.provider.reply_name,
            "model": self.roster.model.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
        }

        items = logprob_items(completion.tokens, as_ids=as_ids, top_logprobs=call.params.top_logprobs)
        # Reasoning tokens stream as ``reasoning`` deltas (the end of the thinking block as
        # empty ones), the answer's as ``content``.
        split = completion.reasoning_tokens
        thought = dataclasses.replace(completion, text=completion.reasoning or "", tokens=completion.tokens[:split])
        answer = dataclasses.replace(completion, tokens=completion.tokens[split:])
        deltas = [("reasoning", p) for p in text_deltas(thought)][:split] + [("content", p) for p in text_deltas(answer)]

        async def events() -> AsyncIterator[str]:
            for item, (field_name, piece) in zip(items, deltas, strict=False):
                choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", field_name: piece}, "finish_reason": None}
                if reply.logprobs:
                    choice["logprobs"] = {"content": [item], "refusal": None}
                yield f"data: {orjson.dumps({**base, 'choices': [choice]}).decode()}\n\n"
            if fault == "malformed_json":
                yield 'data: {"id": "' + call.gen_id + '", "choices": [\n\n'
            final: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": completion.finish_reason}]}
            if completion.finish_reason == "error":
                final["error"] = {"code": 502, "message": "Provider returned error"}
            if call.params.include_usage_in_stream:
                final["usage"] = reply.usage
            yield f"data: {orjson.dumps(final).decode()}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "mode": self.engine.mode, "model": self.roster.model.id})


class SandboxApp:
    """The ASGI app: chat completions (the hot path under load) go straight to the
    handler; every other route goes through Starlette's routing and error handling."""

    def __init__(self, sandbox: Sandbox, routed: Starlette) -> None:
        self.sandbox = sandbox
        self.routed = routed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"].removeprefix(scope.get("root_path", "")) == "/api/v1/chat/completions"  # below a gateway's prefix
        ):
            try:
                response = await self.sandbox.chat_completions(Request(scope, receive))
            except Exception as exc:  # a bug must still answer JSON, as the routed app does
                response = await _crashed(Request(scope), exc)
            await response(scope, receive, send)
            return
        await self.routed(scope, receive, send)


def create_app(roster: Roster, engine: CompletionEngine) -> SandboxApp:
    """The sandbox as an ASGI app (serve it with uvicorn, or mount it in-process with
    ``httpx.ASGITransport``)."""
    sandbox = Sandbox(roster, engine)
    routes = [
        Route("/health", sandbox.health),
        Route("/api/v1/models", sandbox.list_models),
        Route("/api/v1/models/{author}/{slug}/endpoints", sandbox.list_endpoints),
        Route("/api/v1/chat/completions", sandbox.chat_completions, methods=["POST"]),
        Route("/api/v1/generation", sandbox.generation),
        Route("/api/v1/key", sandbox.key_info),
        Route("/api/v1/sandbox/stats", sandbox.stats_route),
        Route("/api/v1/sandbox/credits", sandbox.add_credits, methods=["POST"]),
        *reference_routes(roster, engine, outage=roster.reference_outage),
        *(
            route
            for name, precision in roster.deployments.items()
            for route in reference_routes(roster, engine, precision=precision, root=f"/deployments/{name}")
        ),
    ]
    routed = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed, Exception: _crashed})
    return SandboxApp(sandbox, routed)


class SandboxServer:
    """What ``quanthunt sandbox serve`` serves: the gateway of its own roster at ``/``, and
    gateways that clients open under ``/gateways/<id>`` with a roster of their own
    (``POST /gateways`` with ``{"roster": {...}}``; ``DELETE /gateways/<id>`` closes one).
    Each opened gateway starts as a new sandbox process would (its accounts, fault draws,
    drift clock and counters, generations), and all of them share the one engine: the model
    loaded once, each precision built once, the memo. That is what a run's stages share
    (``quanthunt.connection``): starting a model sandbox takes ~4 s and each precision is
    built again in a new process (1-4 s)."""

    def __init__(self, roster: Roster, engine: CompletionEngine) -> None:
        self.engine = engine
        self.served = create_app(roster, engine)
        self.opened: dict[str, SandboxApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == GATEWAYS_PATH or path.startswith(GATEWAYS_PATH + "/")):
            await self.served(scope, receive, send)
            return
        gateway, _, rest = path[len(GATEWAYS_PATH) :].strip("/").partition("/")
        if not gateway and scope["method"] == "POST":
            response = await self._open(Request(scope, receive))
        elif not gateway:
            response = error_response(405, f"{path}: POST opens a gateway")
        elif gateway not in self.opened:
            response = error_response(404, f"no gateway {gateway} (closed, or opened in another sandbox process)")
        elif not rest and scope["method"] == "DELETE":
            del self.opened[gateway]
            response = Response(status_code=204)
        else:  # the gateway's own routes, below its prefix as below a Starlette Mount
            prefix = scope.get("root_path", "") + f"{GATEWAYS_PATH}/{gateway}"
            await self.opened[gateway](dict(scope, root_path=prefix), receive, send)
            return
        await response(scope, receive, send)

    async def _open(self, request: Request) -> Response:
        try:
            roster = validated(Roster, orjson.loads(await request.body())["roster"], source="roster")
        except (orjson.JSONDecodeError, TypeError, KeyError):
            return error_response(400, 'the body must be JSON: {"roster": {...}}')
        except ConfigError as exc:
            return error_response(400, str(exc))
        gateway = secrets.token_hex(8)
        self.opened[gateway] = create_app(roster, self.engine)
        return JSONResponse({"id": gateway, "path": f"{GATEWAYS_PATH}/{gateway}", "mode": self.engine.mode}, status_code=201)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"No route {request.method} {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"Method {request.method} not allowed on {request.url.path}")


async def _crashed(request: Request, exc: Exception) -> Response:
    return error_response(500, f"Internal Server Error ({exc.__class__.__name__})")
