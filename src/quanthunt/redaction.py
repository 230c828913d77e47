"""Secrets never reach disk, logs, MLflow, DVC files or error text: everything quanthunt
writes or prints about a run passes through ``redact`` first.

A secret is the value of ``OPENROUTER_API_KEY`` and of any environment variable whose
name says it holds one (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``), plus
anything shaped like an OpenRouter key or a bearer credential.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "[REDACTED]"
_SECRET_NAMES = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
"""Environment variables whose values are secrets."""
_SECRET_FIELDS = re.compile(r"(^|[_-])(api[_-]?key|key|token|secret|password|authorization|credentials?)$", re.IGNORECASE)
"""Data fields whose values are secrets (``api_key``, ``hf_token``; not ``max_tokens``)."""
_PATTERNS = (
    re.compile(r"sk-or-v1-[A-Za-z0-9_-]{8,}"),
    re.compile(r"sk-or-[A-Za-z0-9_-]{8,}"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
)
_MIN_SECRET_LENGTH = 8
"""Shorter values are too likely to occur innocently (and too weak to be real keys)."""


def secret_values(env: Mapping[str, str] = os.environ) -> list[str]:
    values = {v for k, v in env.items() if _SECRET_NAMES.search(k) and len(v) >= _MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(text: str, env: Mapping[str, str] = os.environ) -> str:
    """``text`` with every secret value and secret-shaped string masked."""
    for value in secret_values(env):
        text = text.replace(value, MASK)
    text = _PATTERNS[0].sub(MASK, text)
    text = _PATTERNS[1].sub(MASK, text)
    return _PATTERNS[2].sub(lambda m: m.group(1) + MASK, text)


def redact_data(data: Any, env: Mapping[str, str] = os.environ) -> Any:
    """Redact every string inside nested dicts/lists; keys named like secrets lose their value."""
    if isinstance(data, str):
        return redact(data, env)
    if isinstance(data, Mapping):
        return {
            k: MASK if isinstance(k, str) and _SECRET_FIELDS.search(k) and v else redact_data(v, env) for k, v in data.items()
        }
    if isinstance(data, list | tuple):
        return [redact_data(v, env) for v in data]
    return data
