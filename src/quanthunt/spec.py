"""Facts from OpenRouter's published OpenAPI spec that both the client and the sandbox
honour (the contract tests check them against the schemas in ``tests/contracts``), and
the checks both apply: :func:`check_quantization` (the ``Quantization`` field type) and
:func:`check_price`."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator

from quanthunt.config_files import one_line

QUANTIZATIONS = ("int4", "int8", "fp4", "mxfp4", "nvfp4", "fp6", "fp8", "mxfp8", "fp16", "bf16", "fp32", "unknown")
"""The ``Quantization`` enum: what a provider may declare."""


def check_quantization(value: str) -> str:
    """``value`` if it is in the ``Quantization`` enum, else a ``ValueError`` listing the enum."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {value!r}; OpenRouter's are {', '.join(QUANTIZATIONS)}")
    return value


Quantization = Annotated[str, AfterValidator(check_quantization)]
"""A field holding one of OpenRouter's quantizations (params and rosters alike)."""

ENDPOINT_STATUSES = (0, -1, -2, -3, -5, -10)
"""The ``EndpointStatus`` enum; 0 is healthy, lower is worse."""

PREFERENCE_KEYS = frozenset(
    {
        "allow_fallbacks", "data_collection", "enforce_distillable_text", "ignore", "max_price",
        "only", "order", "preferred_max_latency", "preferred_min_throughput", "quantizations",
        "require_parameters", "sort", "zdr",
    }
)  # fmt: skip
"""``ProviderPreferences`` properties (``additionalProperties: false``)."""

MAX_TOP_LOGPROBS = 20
"""Upper bound on ``top_logprobs``."""

LIMIT_SOURCES = ("openrouter_in_flight_budget", "openrouter_key_limit", "openrouter_credits")
"""``error.metadata.limit_source`` values of a 402 (from OpenRouter's docs)."""


def check_price(value: str | None) -> str | None:
    """``value`` unchanged if it is a price as OpenRouter publishes one (a decimal string of USD
    per token, finite and >= 0) or None; ``ValueError`` otherwise. A pydantic field validator."""
    if value is None:
        return value
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"not a decimal string of USD per token: {one_line(value, 40)!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"not a finite non-negative price: {one_line(value, 40)!r}")
    return value
