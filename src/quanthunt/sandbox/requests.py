"""Parsing and validating chat/completions request bodies (OpenRouter's ``ChatRequest``).

Every problem becomes a ``BadRequest`` whose message names the field, returned as a
400 with OpenRouter's error body; nothing here raises anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from quanthunt.sandbox.routing import BadPreferences, Preferences, parse_preferences
from quanthunt.spec import MAX_TOP_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 256


class BadRequest(ValueError):
    """A request the sandbox refuses with HTTP 400 (or ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequest("Malformed JSON in request body") from None
    if not isinstance(data, dict):
        raise BadRequest("Request body must be a JSON object")
    return data


def _number(data: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number")
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low} and {high}, got {value}")
    return float(value)


def _integer(data: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise BadRequest(f"{name} must be {bound}, got {value}")
    return value


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: only text parts are supported by this model")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts")


def parse_messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty array")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        messages.append({"role": "system" if role == "developer" else str(role), "content": _content(message, i)})
    return messages


def parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and len(raw) <= 4 and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise BadRequest("stop must be a string or an array of at most 4 strings")


@dataclass
class ChatParams:
    """A validated chat/completions request."""

    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage_in_stream: bool
    preferences: Preferences
    parameters: set[str] = field(default_factory=set)
    """Sampling parameters the request set (what ``require_parameters`` checks)."""
    return_token_ids: bool = False
    thinking: bool = True
    """A reasoning model thinks unless the request turns it off (``reasoning: {effort:
    "none"}``, ``{enabled: false}`` or ``reasoning_effort: "none"``)."""


def parse_thinking(data: dict[str, Any]) -> bool:
    """Whether the request leaves thinking on (OpenRouter's ``reasoning`` object)."""
    reasoning = data.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise BadRequest("reasoning must be an object")
    reasoning = reasoning or {}
    enabled = reasoning.get("enabled", True)
    if not isinstance(enabled, bool):
        raise BadRequest("reasoning.enabled must be a boolean")
    return enabled and "none" not in (reasoning.get("effort"), data.get("reasoning_effort"))


def parse_chat(data: dict[str, Any], *, allow_provider: bool = True) -> ChatParams:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required")
    messages = parse_messages(data.get("messages"))
    max_tokens = _integer(data, "max_tokens", low=1)
    if max_tokens is None:
        max_tokens = _integer(data, "max_completion_tokens", low=1)
    logprobs = data.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be a boolean")
    top_logprobs = _integer(data, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise BadRequest("top_logprobs requires logprobs: true")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    stream_options = data.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object")
    provider = data.get("provider")
    if provider is not None and not allow_provider:
        raise BadRequest("provider routing is not supported by this server")
    try:
        preferences = parse_preferences(provider)
    except BadPreferences as exc:
        raise BadRequest(str(exc)) from None
    seed = _integer(data, "seed", low=-(2**63))
    parameters = {
        name
        for name in ("temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs", "max_tokens")
        if data.get(name) is not None and data.get(name) is not False
    }
    return ChatParams(
        model=model,
        messages=messages,
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0) or 1.0,
        seed=seed,
        stop=parse_stop(data.get("stop")),
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs or 0,
        stream=stream,
        include_usage_in_stream=bool(stream_options.get("include_usage", True)),
        preferences=preferences,
        parameters=parameters,
        return_token_ids=bool(data.get("return_tokens_as_token_ids", False)),
        thinking=parse_thinking(data),
    )
