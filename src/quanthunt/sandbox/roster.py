"""The sandbox's roster: which "providers" it serves, what they declare and what they
really serve. A YAML file; the default ships in the package (``roster.yaml``).

The roster is the sandbox's ground truth. Clients only ever see what OpenRouter would
show them (name, tag, declared quantization, prices, ...); ``precision``, ``mixture``,
``temperature_offset`` and ``faults`` stay hidden behind the HTTP API.
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quanthunt.config_files import field_path, one_line, parse_yaml, read_text
from quanthunt.errors import ConfigError
from quanthunt.spec import ENDPOINT_STATUSES, QUANTIZATIONS

PRECISIONS = (
    "int4-native",
    "int4-bf16act",
    "int8",
    "int4-g128",
    "nvfp4",
    "mxfp4",
    "substitute",
)
"""Every true precision the sandbox can serve (see ``model``); ``int4-native`` is the
reference itself."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    """NaN and infinity are refused everywhere: an infinite latency or timeout would hang the sandbox, a NaN
    temperature offset would poison sampling."""


def _usd_string(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"must be a decimal string of USD per token, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"must be a finite non-negative price, got {value!r}")
    return value


class PriceOverride(_Strict):
    """A conditional price, as OpenRouter's ``pricing.overrides[]``: applies when the
    request's prompt has at least ``min_prompt_tokens`` tokens."""

    min_prompt_tokens: int = Field(ge=0)
    prompt: str | None = None
    completion: str | None = None

    _check_prompt = field_validator("prompt", "completion")(lambda v: None if v is None else _usd_string(v))


class Pricing(_Strict):
    """USD per token as decimal strings (OpenRouter's convention), plus a discount."""

    prompt: str
    completion: str
    request: str = "0"
    discount: float = Field(default=0.0, ge=0.0, le=1.0)
    overrides: tuple[PriceOverride, ...] = ()

    _check = field_validator("prompt", "completion", "request")(_usd_string)

    def rates(self, prompt_tokens: int) -> tuple[float, float]:
        """Effective (prompt, completion) USD per token for a request, after overrides
        (later entries win per key) and the discount."""
        return _rates(self, prompt_tokens)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What a request costs in USD."""
        prompt, completion = self.rates(prompt_tokens)
        return prompt_tokens * prompt + completion_tokens * completion + float(self.request) * (1.0 - self.discount)


@functools.lru_cache(maxsize=4096)
def _rates(pricing: Pricing, prompt_tokens: int) -> tuple[float, float]:
    """Cached: routing asks for every candidate's rates on every request."""
    prompt, completion = float(pricing.prompt), float(pricing.completion)
    for override in pricing.overrides:
        if prompt_tokens >= override.min_prompt_tokens:
            prompt = float(override.prompt) if override.prompt is not None else prompt
            completion = float(override.completion) if override.completion is not None else completion
    keep = 1.0 - pricing.discount
    return prompt * keep, completion * keep


class RateLimit(_Strict):
    """A token bucket per provider: ``rps`` refill rate, ``burst`` capacity."""

    rps: float = Field(gt=0)
    burst: int = Field(ge=1)


class Faults(_Strict):
    """Probabilities (per request) of each fault the sandbox can inject."""

    rate_limit: float = Field(default=0.0, ge=0, le=1)
    """429 with a ``Retry-After`` header."""
    rate_limit_no_retry_after: float = Field(default=0.0, ge=0, le=1)
    server_error: float = Field(default=0.0, ge=0, le=1)
    """500"""
    bad_gateway: float = Field(default=0.0, ge=0, le=1)
    """502"""
    unavailable: float = Field(default=0.0, ge=0, le=1)
    """503"""
    timeout: float = Field(default=0.0, ge=0, le=1)
    """The reply's headers are sent, then the body is held for ``timeout_s`` (billed)."""
    connection_reset: float = Field(default=0.0, ge=0, le=1)
    """The connection is dropped after the headers (not billed)."""
    malformed_json: float = Field(default=0.0, ge=0, le=1)
    """HTTP 200 with a body that is not JSON (billed: the provider did the work)."""
    truncated_body: float = Field(default=0.0, ge=0, le=1)
    """HTTP 200 whose body stops half-way (billed)."""
    finish_error: float = Field(default=0.0, ge=0, le=1)
    """HTTP 200 with ``finish_reason: "error"`` and no output (not billed)."""
    retry_after_s: float = Field(default=1.0, ge=0)
    timeout_s: float = Field(default=30.0, ge=0)

    def total(self) -> float:
        return float(sum(getattr(self, name) for name in FAULT_KINDS))


FAULT_KINDS = (
    "rate_limit",
    "rate_limit_no_retry_after",
    "server_error",
    "bad_gateway",
    "unavailable",
    "timeout",
    "connection_reset",
    "malformed_json",
    "truncated_body",
    "finish_error",
)


class Provider(_Strict):
    """One provider of the roster's model."""

    name: str = Field(min_length=1)
    """``provider_name`` as OpenRouter spells it (e.g. ``DeepInfra``)."""
    slug: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    tag: str = Field(min_length=1)
    """Endpoint tag, e.g. ``deepinfra/fp4``; routing accepts the name, slug or tag."""
    quantization: str
    """What the provider *declares* (OpenRouter's enum, ``unknown`` included)."""
    precision: str
    """What it really serves (hidden from clients)."""
    mixture: dict[str, float] = Field(default_factory=dict)
    """``{precision: share}``: that share of requests is served at another precision."""
    temperature_offset: float = 0.0
    """A misconfigured sampler: added to every request's temperature."""
    pricing: Pricing
    status: int = 0
    uptime_last_30m: float | None = Field(default=99.9, ge=0, le=100)
    context_length: int = Field(default=8192, ge=16)
    max_completion_tokens: int | None = Field(default=4096, ge=1)
    supports_logprobs: bool = True
    collects_data: bool = False
    """Whether the provider may train on prompts (``provider.data_collection: deny`` skips it)."""
    latency_ms: float = Field(default=300.0, ge=0)
    """Time to first token (latency mode sleeps it; both modes report it)."""
    throughput_tps: float = Field(default=60.0, gt=0)
    """Output tokens per second (latency mode streams at this rate)."""
    rate_limit: RateLimit | None = None
    faults: Faults = Faults()

    @field_validator("name", "tag")
    @classmethod
    def _no_padding(cls, value: str) -> str:
        if value != value.strip():
            raise ValueError(f"must not start or end with whitespace (routing strips it), got {value!r}")
        return value

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        if value not in PRECISIONS:
            raise ValueError(f"unknown precision {value!r}; known: {', '.join(PRECISIONS)}")
        return value

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str) -> str:
        if value not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {value!r}; OpenRouter's are {', '.join(QUANTIZATIONS)}")
        return value

    @field_validator("status")
    @classmethod
    def _known_status(cls, value: int) -> int:
        if value not in ENDPOINT_STATUSES:
            raise ValueError(f"status must be one of {ENDPOINT_STATUSES} (OpenRouter's EndpointStatus), got {value}")
        return value

    @field_validator("mixture")
    @classmethod
    def _valid_mixture(cls, value: dict[str, float]) -> dict[str, float]:
        for precision, share in value.items():
            if precision not in PRECISIONS:
                raise ValueError(f"unknown precision {precision!r} in mixture; known: {', '.join(PRECISIONS)}")
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"share for {precision!r} must be within [0, 1], got {share}")
        if sum(value.values()) > 1.0 + 1e-9:
            raise ValueError("mixture shares add up to more than 1")
        return value

    @property
    def routable(self) -> bool:
        return self.status > -3

    @property
    def supported_parameters(self) -> list[str]:
        params = ["temperature", "top_p", "max_tokens", "seed", "stop"]
        if self.supports_logprobs:
            params += ["logprobs", "top_logprobs"]
        return params


class ModelInfo(_Strict):
    """The one model every roster provider serves."""

    id: str = Field(default="huggingfacetb/smollm2-135m-instruct", pattern=r"^[a-z0-9._-]+/[a-z0-9._:-]+$")
    name: str = "SmolLM2 135M Instruct (quanthunt sandbox)"
    description: str = "SmolLM2-135M-Instruct served by the quanthunt sandbox at several real precisions."
    context_length: int = Field(default=8192, ge=16)


class KeyLimit(_Strict):
    """A sandbox API key with its own credit limit."""

    key: str = Field(min_length=1)
    limit_usd: float = Field(ge=0, allow_inf_nan=False)


class Credits(_Strict):
    """Per-key balance: any key starts with ``default_usd``; ``keys`` set their own."""

    default_usd: float = Field(default=100.0, ge=0, allow_inf_nan=False)
    keys: tuple[KeyLimit, ...] = ()


class Roster(_Strict):
    """A sandbox roster file."""

    model: ModelInfo = ModelInfo()
    providers: tuple[Provider, ...] = Field(min_length=1)
    credits: Credits = Credits()
    seed: int = 0
    """Seeds fault injection and load balancing, so a run's faults repeat."""
    gateway_faults: Faults = Faults()
    """Faults of the gateway itself, on every route but chat completions (model and
    endpoint lists, generation lookups, key status); ``finish_error`` does not apply."""
    generation_lookup_delay_s: float = Field(default=0.0, ge=0)
    """``/generation?id=`` answers 404 for this long after a reply (OpenRouter: ~1 s)."""

    @field_validator("providers")
    @classmethod
    def _unique(cls, providers: tuple[Provider, ...]) -> tuple[Provider, ...]:
        for attr in ("name", "slug", "tag"):
            values = [getattr(p, attr) for p in providers]
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(f"provider {attr}s must be unique; repeated: {', '.join(dupes)}")
        owners: dict[str, str] = {}  # routing reference (as ``find`` compares it) -> the slug of the provider it names
        for p in providers:
            for ref in {p.name.lower(), p.slug, p.tag.lower()}:
                other = owners.setdefault(ref, p.slug)
                if other != p.slug:
                    raise ValueError(f"routing reference {ref!r} (name, slug or tag, any case) names both {other} and {p.slug}")
        return providers

    def find(self, ref: str) -> Provider | None:
        """The provider a routing reference (name, slug or tag, any case) names."""
        wanted = ref.strip().lower()
        for provider in self.providers:
            if wanted in (provider.name.lower(), provider.slug, provider.tag.lower()):
                return provider
        return None


DEFAULT_ROSTER = "roster.yaml"


def parse_roster(text: str, *, source: str) -> Roster:
    """Parse roster YAML; errors name the file and the field."""
    data = parse_yaml(text, source=source, what="roster")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a roster is a mapping with a 'providers' list")
    try:
        return Roster.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{source}: {field_path(first['loc'])}: {one_line(first['msg'], 300)}") from None


def default_roster_path() -> Path:
    """The roster shipped inside the package, as a file path."""
    return Path(str(resources.files("quanthunt.sandbox").joinpath(DEFAULT_ROSTER)))


def load_roster(path: Path | None = None) -> Roster:
    """Load a roster file, or the default shipped in the package when ``path`` is None."""
    if path is None:
        text = resources.files("quanthunt.sandbox").joinpath(DEFAULT_ROSTER).read_text(encoding="utf-8")
        return parse_roster(text, source=f"quanthunt/sandbox/{DEFAULT_ROSTER}")
    return parse_roster(read_text(path, what="roster"), source=str(path))
