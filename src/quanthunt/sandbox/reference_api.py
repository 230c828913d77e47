"""The team's local reference deployment, as a real vLLM or SGLang server shows it (the
roster's ``reference_flavour``; the server root is ``/reference``, its API ``/reference/v1``;
each of the roster's other ``deployments`` is served the same way under ``/deployments/<name>``).

- ``POST /v1/chat/completions``: sampling with logprobs (no routing, no cost);
- ``POST /v1/completions``: ``echo: true`` with ``logprobs: k`` returns the teacher-forced
  logprob of every prompt token, which is how a verifier scores a provider's completion at
  the reference; ``prompt`` may be text or a list of token ids;
- ``POST /tokenize`` / ``detokenize``; ``GET /v1/models``;
- ``POST /v1/chat/completions/render`` (vLLM only): the ``GenerateRequest`` a chat request
  becomes, its ``token_ids`` the chat template's (as ``/tokenize`` with ``messages``,
  ``add_generation_prompt`` and the thinking switch alike). A real vLLM 0.32 serves it only
  when started with ``--enable-scale-out`` (else 403); the sandbox imitates one that was.

Where the two servers differ (each checked against recorded vLLM 0.32 replies in
``tests/contracts/replies/`` or read from SGLang's source):

| | ``vllm`` | ``sglang`` |
|---|---|---|
| tokenize, detokenize | server root only | root and ``/v1``; text only, no ``messages`` |
| chat prompt ids | ``/tokenize`` with ``messages`` | chat ``return_prompt_token_ids`` |
| chat render | ``/v1/chat/completions/render`` | no (404) |
| echo ``max_tokens: 0`` | accepted | 400 |
| echoed ``top_logprobs`` | top k, plus the scored token first when outside them | top k only |
| token names | in context, ``""`` for a partial UTF-8 piece; ``token_id:N`` on request | in context; no ids |
| same-named alternatives | the last listed wins | the first listed wins |
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quanthunt import __version__
from quanthunt.errors import SandboxError
from quanthunt.sandbox import thinking
from quanthunt.sandbox.engine import REFERENCE_PRECISION, CompletionEngine, OutToken, SamplingRequest, TokenInfo
from quanthunt.sandbox.render import ContextNames, logprob_items
from quanthunt.sandbox.requests import BadRequest, parse_chat, parse_json_object, parse_messages, parse_stop
from quanthunt.sandbox.roster import Outage, Roster
from quanthunt.spec import MAX_TOP_LOGPROBS


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error shape: {"error": {"message", "type", "code"}}
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


_SAMPLING_DEFAULTS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
}
"""The numeric ``SamplingParams`` a vLLM chat request always sets (in vLLM's order)."""

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


CONTINUE_WITH_GENERATION_PROMPT = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want "
    "the model to continue the final message, and add_generation_prompt when you want to add a header that will "
    "prompt it to start a new assistant message instead."
)
"""vLLM 0.32's 400 for both (tests/contracts/replies/vllm/tokenize-root-messages-open-and-generation-prompt.json)."""


def _lax_bool(value: Any, name: str) -> bool:
    """A boolean as vLLM's pydantic models read one: also 0/1 and "yes", "off", ..."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise BadRequest(f"{name}: Input should be a valid boolean")


def reference_routes(
    roster: Roster,
    engine: CompletionEngine,
    *,
    precision: str = REFERENCE_PRECISION,
    root: str = "/reference",
    outage: Outage | None = None,
) -> list[Route]:
    """Routes of a deployment of the model over ``engine`` at ``precision``, under ``root``:
    the reference by default (with the roster's ``reference_outage`` when given it), or one
    of the roster's other ``deployments``."""

    model_id = roster.model.id
    sglang = roster.reference_flavour == "sglang"

    def check_model(data: dict[str, Any]) -> None:
        model = data.get("model", model_id)
        if not isinstance(model, str) or model.lower() != model_id:
            raise BadRequest(f"The model `{model}` does not exist.", status=404)

    def thinking_enabled(data: dict[str, Any]) -> bool:
        """The reasoning profile's switch, as a chat template reads it (default: on)."""
        kwargs = data.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        profile = roster.model.reasoning
        return profile is None or bool(kwargs.get(profile.template_kwarg, True))

    def add_generation_prompt(data: dict[str, Any]) -> bool:
        return _lax_bool(data.get("add_generation_prompt", True), "add_generation_prompt")

    def chat_prompt_ids(data: dict[str, Any]) -> list[int]:
        """The chat template's ids for ``messages`` (vLLM's ``/tokenize`` with messages and
        its chat render): ready for the assistant (the reasoning profile's thinking block
        opened or rendered empty, per ``chat_template_kwargs``) or, with
        ``add_generation_prompt: false``, the conversation alone."""
        messages = parse_messages(data.get("messages"))
        enabled = thinking_enabled(data)
        continued = _lax_bool(data.get("continue_final_message", False), "continue_final_message")
        if add_generation_prompt(data):
            if continued:
                raise BadRequest(CONTINUE_WITH_GENERATION_PROMPT)
            return thinking.prompt_ids(engine, messages, roster.model.reasoning, enabled=enabled)
        return engine.encode_chat(messages, add_generation_prompt=False, continue_final_message=continued)

    def seed_of(data: dict[str, Any]) -> int:
        seed = data.get("seed")
        if seed is None:
            return secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise BadRequest("seed must be an integer")
        return seed

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_id,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "quanthunt-sandbox",
                        "max_model_len": min(roster.model.context_length, engine.context_length),
                    }
                ],
            }
        )

    async def chat(request: Request) -> Response:
        try:
            data = parse_json_object(await request.body())
            check_model(data)
            params = parse_chat(data, allow_provider=False)
            enabled = thinking_enabled(data)
            prompt_ids = thinking.prompt_ids(engine, params.messages, roster.model.reasoning, enabled=enabled)
            sampling = SamplingRequest(
                prompt_ids=tuple(prompt_ids),
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=seed_of(data),
                top_logprobs=params.top_logprobs,
                stop=params.stop,
            )
            completion = await thinking.complete(engine, precision, sampling, roster.model.reasoning, enabled=enabled)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except SandboxError as exc:
            return _error(503, str(exc))
        n = len(completion.tokens)
        extra = {"prompt_token_ids": prompt_ids} if sglang and data.get("return_prompt_token_ids") else {}
        return JSONResponse(
            extra
            | {
                "id": "chatcmpl-" + secrets.token_hex(12),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_id,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": completion.text, "reasoning": completion.reasoning},
                        "logprobs": {
                            "content": logprob_items(
                                completion.tokens, as_ids=params.return_token_ids, top_logprobs=params.top_logprobs
                            )
                        }
                        if params.logprobs
                        else None,
                        "finish_reason": completion.finish_reason,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n},
            }
        )

    completions_seen = 0

    def in_outage() -> bool:
        """Whether this ``/completions`` request falls in ``outage``."""
        nonlocal completions_seen
        completions_seen += 1
        if outage is None or completions_seen <= outage.after:
            return False
        return outage.requests is None or completions_seen <= outage.after + outage.requests

    async def completions(request: Request) -> Response:
        if in_outage():
            return _error(503, "the reference is restarting (the roster's reference_outage)")
        try:
            data = parse_json_object(await request.body())
            check_model(data)
            prompt = data.get("prompt")
            if isinstance(prompt, str):
                ids = engine.encode_text(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
                ids = [int(i) for i in prompt]
            else:
                raise BadRequest("prompt must be a string or a non-empty list of token ids")
            echo = data.get("echo", False)
            if not isinstance(echo, bool):
                raise BadRequest("echo must be a boolean")
            k = data.get("logprobs")
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise BadRequest(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}")
            max_tokens = data.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise BadRequest("max_tokens must be a non-negative integer")
            if max_tokens == 0 and (sglang or not echo):
                # vLLM scores a prompt with max_tokens 0 under echo; SGLang's validate_max_tokens_positive refuses it.
                raise BadRequest("max_tokens must be positive" if sglang else f"max_tokens must be at least 1, got {max_tokens}.")
            temperature = data.get("temperature", 1.0)
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
                raise BadRequest("temperature must be a number between 0 and 2")
            as_ids = not sglang and bool(data.get("return_tokens_as_token_ids", False))
            ignore_eos = data.get("ignore_eos", False)
            if not isinstance(ignore_eos, bool):
                raise BadRequest("ignore_eos must be a boolean")
            completion_tokens: list[OutToken] = []
            text, finish = "", "length"
            if max_tokens > 0:
                sampling = SamplingRequest(
                    prompt_ids=tuple(ids),
                    max_tokens=max_tokens,
                    temperature=float(temperature),
                    top_p=float(data.get("top_p", 1.0) or 1.0),
                    seed=seed_of(data),
                    top_logprobs=k or 0,
                    stop=parse_stop(data.get("stop")),
                    ignore_eos=ignore_eos,
                )
                done = await engine.complete(precision, sampling)
                completion_tokens, text, finish = done.tokens, done.text, done.finish_reason
            prompt_scores: list[OutToken | None] = []
            if echo:
                scored = k is not None
                prompt_scores = await engine.score(ids, top_logprobs=k or 0, precision=precision) if scored else [None] * len(ids)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except SandboxError as exc:
            return _error(503, str(exc))

        logprobs: dict[str, Any] | None = None
        if k is not None:
            infos: list[TokenInfo] = [engine.token_info(i) for i in ids] if echo else []
            entries: list[OutToken | None] = [*prompt_scores, *completion_tokens] if echo else list(completion_tokens)
            infos += [t.token for t in completion_tokens]
            logprobs = echoed_logprobs(infos, entries, as_ids=as_ids, sglang=sglang)
        prompt_text = engine.decode(ids) if echo else ""
        return JSONResponse(
            {
                "id": "cmpl-" + secrets.token_hex(12),
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_id,
                "choices": [{"index": 0, "text": prompt_text + text, "logprobs": logprobs, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(completion_tokens),
                    "total_tokens": len(ids) + len(completion_tokens),
                },
            }
        )

    async def tokenize(request: Request) -> Response:
        try:
            data = parse_json_object(await request.body())
            check_model(data)
            if "messages" in data and not sglang:
                ids = chat_prompt_ids(data)
            elif isinstance(data.get("prompt"), str):
                ids = engine.encode_text(data["prompt"])
            else:
                raise BadRequest("prompt: Field required" if sglang else "give either prompt (a string) or messages")
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": min(roster.model.context_length, engine.context_length),
                "tokens": ids,
                "token_strs": [engine.token_info(i).text for i in ids],
            }
        )

    async def render_chat(request: Request) -> Response:
        """vLLM's ``/v1/chat/completions/render``: the ``GenerateRequest`` a chat request
        becomes (its templated prompt ids and sampling parameters), nothing generated."""
        try:
            data = parse_json_object(await request.body())
            check_model(data)
            ids = chat_prompt_ids(data)
            sampling = render_sampling(data, len(ids))
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        sent_id = data.get("request_id")
        request_id = request.headers.get("x-request-id") or (sent_id if isinstance(sent_id, str) else secrets.token_hex(8))
        # A reasoning parser's view (vLLM's server with one, as the reasoning profile is):
        # the template's kwargs, and whether the prompt ends with the thinking block closed.
        profile, add = roster.model.reasoning, add_generation_prompt(data)
        template_kwargs = {
            **(data.get("chat_template_kwargs") or {}),
            "add_generation_prompt": add,
            "continue_final_message": False,
        }
        return JSONResponse(
            {
                "request_id": f"chatcmpl-{request_id}",
                "token_ids": ids,
                "token_offsets": None,
                "features": None,
                "content_parts": None,
                "sampling_params": sampling,
                "model": data.get("model"),  # as sent: null when the request named none
                "reasoning_ended": None if profile is None else add and not thinking_enabled(data),
                "reasoning_parser_kwargs": None if profile is None else {"chat_template_kwargs": template_kwargs},
                "return_token_ids": None,
                "output_mode": "tokens",
                "stream": bool(data.get("stream", False)),
                "stream_options": None,
                "cache_salt": None,
                "priority": 0,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
            }
        )

    def render_sampling(data: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        """``SamplingParams`` as vLLM serializes them for a chat request (defaults left out,
        as msgspec does, but for the ones its chat request sets explicitly)."""
        max_len = min(roster.model.context_length, engine.context_length)
        if prompt_tokens > max_len:
            raise BadRequest(f"Input length ({prompt_tokens}) exceeds model's maximum context length ({max_len}).")
        asked = data.get("max_completion_tokens", data.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise BadRequest("max_tokens must be a positive integer")
        if asked is not None and asked > max_len:
            raise BadRequest(f"max_tokens={asked} cannot be greater than max_model_len={max_len}.")
        numbers = {}
        for name, default in _SAMPLING_DEFAULTS.items():
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise BadRequest(f"{name} must be a number")
            numbers[name] = float(default if value is None else value)
        if numbers["temperature"] < 1e-5:  # greedy: vLLM resets top_p and min_p to their defaults, left out
            del numbers["top_p"], numbers["min_p"]
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer")
        top = data.get("top_logprobs")
        return (
            numbers
            | ({"seed": seed} if seed is not None else {})
            | {
                "stop": list(parse_stop(data.get("stop"))),
                "stop_token_ids": [],
                "max_tokens": min(max_len - prompt_tokens, asked if asked is not None else max_len),
            }
            | ({"logprobs": top if isinstance(top, int) else 0} if data.get("logprobs") else {})
            | {"output_kind": 2, "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False}
        )

    async def detokenize(request: Request) -> Response:
        try:
            data = parse_json_object(await request.body())
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
                raise BadRequest("tokens must be a list of token ids")
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({"prompt": engine.decode(tokens)})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def version(request: Request) -> Response:  # vLLM's GET /version; SGLang has none there
        return JSONResponse({"version": f"quanthunt-sandbox {__version__} ({precision})"})

    return [
        Route(f"{root}/health", health),
        *([] if sglang else [Route(f"{root}/version", version)]),
        Route(f"{root}/v1/models", models),
        Route(f"{root}/v1/chat/completions", chat, methods=["POST"]),
        Route(f"{root}/v1/completions", completions, methods=["POST"]),
        *([] if sglang else [Route(f"{root}/v1/chat/completions/render", render_chat, methods=["POST"])]),
        Route(f"{root}/tokenize", tokenize, methods=["POST"]),
        Route(f"{root}/detokenize", detokenize, methods=["POST"]),
        *(
            [
                Route(f"{root}/v1/tokenize", tokenize, methods=["POST"]),
                Route(f"{root}/v1/detokenize", detokenize, methods=["POST"]),
            ]
            if sglang
            else []
        ),
    ]


def echoed_logprobs(infos: list[TokenInfo], entries: list[OutToken | None], *, as_ids: bool, sglang: bool) -> dict[str, Any]:
    """The ``logprobs`` object of a ``/completions`` reply: tokens named in context
    (``ContextNames``) or ``token_id:N``; per position the top alternatives as a dict, which
    vLLM starts with the scored token (so it holds k or k+1 entries, a later same-named
    entry replacing an earlier one) and SGLang fills with the top k only (the first of
    same-named entries kept). vLLM's ``text_offset`` counts the names' lengths; SGLang's is -1."""
    names = ContextNames()
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    cursor = 0
    for info, entry in zip(infos, entries, strict=True):
        context = [(t, lp, names.name(t)) for t, lp in entry.top] if entry is not None else []
        name = f"token_id:{info.id}" if as_ids else names.advance(info)
        tokens.append(name)
        offsets.append(-1 if sglang else cursor)
        cursor += len(name)
        values.append(None if entry is None else entry.logprob)
        if entry is None:
            tops.append(None)
            continue
        top: dict[str, float] = {} if sglang else {name: entry.logprob}
        for t, lp, n in context:
            key = f"token_id:{t.id}" if as_ids else n
            if sglang:
                top.setdefault(key, lp)
            else:
                top[key] = lp
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
