"""The team's local reference deployment, as vLLM's OpenAI-compatible server shows it.

- ``POST /reference/v1/chat/completions``: sampling with logprobs (no routing, no cost);
- ``POST /reference/v1/completions``: ``echo: true`` with ``logprobs: k`` and
  ``max_tokens: 0`` (or 1) returns the teacher-forced logprob of every prompt token, which
  is how a verifier scores a provider's completion at the reference; ``prompt`` may be
  text or a list of token ids;
- ``POST /reference/v1/tokenize`` / ``detokenize``; ``GET /reference/v1/models``.

``return_tokens_as_token_ids: true`` (a vLLM option) names tokens ``token_id:<id>``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quanthunt.errors import SandboxError
from quanthunt.sandbox.engine import Engine, OutToken, SamplingRequest, TokenInfo
from quanthunt.sandbox.render import logprob_item
from quanthunt.sandbox.requests import BadRequest, parse_chat, parse_json_object, parse_messages, parse_stop
from quanthunt.sandbox.roster import Roster
from quanthunt.spec import MAX_TOP_LOGPROBS

REFERENCE_PRECISION = "int4-native"


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error shape: {"error": {"message", "type", "code"}}
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def reference_routes(roster: Roster, engine: Engine) -> list[Route]:
    """Routes of the reference deployment over ``engine`` at the reference precision."""

    model_id = roster.model.id

    def token_name(info: TokenInfo, as_ids: bool) -> str:
        return f"token_id:{info.id}" if as_ids else info.text

    def check_model(data: dict[str, Any]) -> None:
        model = data.get("model", model_id)
        if not isinstance(model, str) or model.lower() != model_id:
            raise BadRequest(f"The model `{model}` does not exist.", status=404)

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
            prompt_ids = engine.encode_chat(params.messages)
            sampling = SamplingRequest(
                prompt_ids=tuple(prompt_ids),
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=seed_of(data),
                top_logprobs=params.top_logprobs,
                stop=params.stop,
            )
            completion = await engine.complete(REFERENCE_PRECISION, sampling)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except SandboxError as exc:
            return _error(503, str(exc))
        n = len(completion.tokens)
        return JSONResponse(
            {
                "id": "chatcmpl-" + secrets.token_hex(12),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_id,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": completion.text},
                        "logprobs": {"content": [logprob_item(t, as_ids=params.return_token_ids) for t in completion.tokens]}
                        if params.logprobs
                        else None,
                        "finish_reason": completion.finish_reason,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n},
            }
        )

    async def completions(request: Request) -> Response:
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
            if max_tokens == 0 and not echo:
                raise BadRequest("max_tokens: 0 is only meaningful with echo: true")
            temperature = data.get("temperature", 1.0)
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
                raise BadRequest("temperature must be a number between 0 and 2")
            as_ids = bool(data.get("return_tokens_as_token_ids", False))
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
                )
                done = await engine.complete(REFERENCE_PRECISION, sampling)
                completion_tokens, text, finish = done.tokens, done.text, done.finish_reason
            prompt_scores: list[OutToken | None] = []
            if echo:
                prompt_scores = await engine.score(ids, top_logprobs=k or 0) if k is not None else [None] * len(ids)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except SandboxError as exc:
            return _error(503, str(exc))

        logprobs: dict[str, Any] | None = None
        if k is not None:
            infos: list[TokenInfo] = [engine.token_info(i) for i in ids] if echo else []
            entries: list[OutToken | None] = [*prompt_scores, *completion_tokens] if echo else list(completion_tokens)
            infos += [t.token for t in completion_tokens]
            offsets, cursor = [], 0
            for info in infos:
                offsets.append(cursor)
                cursor += len(info.text)
            top_dicts: list[dict[str, float] | None] = []
            for info, entry in zip(infos, entries, strict=True):
                if entry is None:
                    top_dicts.append(None)
                    continue
                top = {token_name(t, as_ids): lp for t, lp in entry.top}
                top.setdefault(token_name(info, as_ids), entry.logprob)
                top_dicts.append(top)
            logprobs = {
                "tokens": [token_name(i, as_ids) for i in infos],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": top_dicts,
                "text_offset": offsets,
            }
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
            if "messages" in data:
                add = data.get("add_generation_prompt", True)
                ids = engine.encode_chat(parse_messages(data["messages"]), add_generation_prompt=bool(add))
            elif isinstance(data.get("prompt"), str):
                ids = engine.encode_text(data["prompt"])
            else:
                raise BadRequest("give either prompt (a string) or messages")
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

    return [
        Route("/reference/health", health),
        Route("/reference/v1/models", models),
        Route("/reference/v1/chat/completions", chat, methods=["POST"]),
        Route("/reference/v1/completions", completions, methods=["POST"]),
        Route("/reference/v1/tokenize", tokenize, methods=["POST"]),
        Route("/reference/v1/detokenize", detokenize, methods=["POST"]),
    ]
