"""The sandbox's roster: which "providers" it serves, what they declare and what they
really serve. A YAML file; the default ships in the package (``roster.yaml``).

The roster is the sandbox's ground truth. Clients only ever see what OpenRouter would
show them (name, tag, declared quantization, prices, ...); ``precision``, ``mixture``,
``temperature_offset``, their ``drift`` mid-run and ``faults`` stay hidden behind the HTTP API.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quanthunt.config_files import parse_yaml, read_text, validated
from quanthunt.defaults import SANDBOX_MODEL
from quanthunt.errors import ConfigError
from quanthunt.spec import ENDPOINT_STATUSES, Quantization, check_price
from quanthunt.urls import DEPLOYMENT_NAME

PRECISIONS = (
    "int4-native",
    "int4-bf16act",
    "int4-fp8kv",
    "int4-bf16act-fp8kv",
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


class PriceOverride(_Strict):
    """A conditional price, as OpenRouter's ``pricing.overrides[]``: applies when the
    request's prompt has at least ``min_prompt_tokens`` tokens."""

    min_prompt_tokens: int = Field(ge=0)
    prompt: str | None = None
    completion: str | None = None

    _check = field_validator("prompt", "completion")(check_price)


class Pricing(_Strict):
    """What a request costs at an endpoint: USD per token as decimal strings (OpenRouter's
    convention) and per request, less ``discount``; ``overrides`` reprice long prompts."""

    prompt: str
    completion: str
    request: str = "0"
    """USD per request, on top of its tokens."""
    discount: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share taken off every price, the per-request one included."""
    overrides: tuple[PriceOverride, ...] = ()
    """Tried in order: each one whose ``min_prompt_tokens`` a request reaches replaces the
    prices it sets, so a later entry wins over an earlier one."""

    _check = field_validator("prompt", "completion", "request")(check_price)

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


Probability = Annotated[float, Field(ge=0, le=1)]


class Faults(_Strict):
    """Probabilities (per request) of each fault the sandbox can inject."""

    rate_limit: Probability = 0.0
    """429 with a ``Retry-After`` header."""
    rate_limit_no_retry_after: Probability = 0.0
    server_error: Probability = 0.0
    """500"""
    bad_gateway: Probability = 0.0
    """502"""
    unavailable: Probability = 0.0
    """503"""
    timeout: Probability = 0.0
    """The reply's headers are sent, then the body is held for ``timeout_s`` (billed)."""
    connection_reset: Probability = 0.0
    """The connection is dropped after the headers (not billed)."""
    malformed_json: Probability = 0.0
    """HTTP 200 with a body that is not JSON (billed: the provider did the work)."""
    truncated_body: Probability = 0.0
    """HTTP 200 whose body stops half-way (billed)."""
    finish_error: Probability = 0.0
    """HTTP 200 with ``finish_reason: "error"`` and no output (not billed)."""
    error_200: Probability = 0.0
    """HTTP 200 whose body is a top-level ``{"error": {"code": 502, ...}}``, no choices (not billed)."""
    empty_answer: Probability = 0.0
    """A reasoning model's thinking ate ``max_tokens``: ``content: null``, ``finish_reason:
    "length"``, the tokens in ``reasoning`` (billed)."""
    retry_after_s: float = Field(default=1.0, ge=0)
    timeout_s: float = Field(default=30.0, ge=0)

    def total(self) -> float:
        return float(sum(getattr(self, name) for name in FAULT_KINDS))


FAULT_KINDS = tuple(name for name in Faults.model_fields if not name.endswith("_s"))
"""Every fault a request may draw: ``Faults``' probabilities (its fields but the durations,
``*_s``), in the order they are drawn."""


OptionalParameter = Literal["temperature", "top_p", "seed", "stop"]
"""A request parameter an endpoint may leave out of ``supported_parameters`` (logprobs go
by ``supports_logprobs``)."""
OPTIONAL_PARAMETERS: tuple[str, ...] = get_args(OptionalParameter)


def _known_precision(value: str) -> str:
    if value not in PRECISIONS:
        raise ValueError(f"unknown precision {value!r}; known: {', '.join(PRECISIONS)}")
    return value


def _valid_mixture(value: dict[str, float]) -> dict[str, float]:
    for precision, share in value.items():
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} in mixture; known: {', '.join(PRECISIONS)}")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share for {precision!r} must be within [0, 1], got {share}")
    if sum(value.values()) > 1.0 + 1e-9:
        raise ValueError("mixture shares add up to more than 1")
    return value


@dataclass(frozen=True, slots=True)
class Truth:
    """What an endpoint really serves to one request (``Provider.truth_at``)."""

    precision: str
    mixture: Mapping[str, float]
    temperature_offset: float
    drift: int | None = None
    """The index of the last drift applied (None: the provider's own truth)."""


class Drift(_Strict):
    """A change of deployment mid-run (re-quantized, moved hardware, part of the traffic
    routed elsewhere): from its moment on, the fields it sets replace the provider's truth.

    The moment is ``after_requests`` (the endpoint's chat requests served before it: with 30,
    requests 1-30 keep the old truth and the 31st gets the new) or ``after_s`` (seconds since
    the sandbox started), never both."""

    after_requests: int | None = Field(default=None, ge=1)
    after_s: float | None = Field(default=None, gt=0)
    precision: str | None = None
    mixture: dict[str, float] | None = None
    temperature_offset: float | None = None

    _check_precision = field_validator("precision")(lambda v: None if v is None else _known_precision(v))
    _check_mixture = field_validator("mixture")(lambda v: None if v is None else _valid_mixture(v))

    @model_validator(mode="after")
    def _one_moment_and_a_change(self) -> Drift:
        if (self.after_requests is None) == (self.after_s is None):
            got = "both" if self.after_requests is not None else "neither"
            raise ValueError(f"a drift needs exactly one of after_requests or after_s, got {got}")
        if self.precision is None and self.mixture is None and self.temperature_offset is None:
            raise ValueError("a drift must change at least one of precision, mixture or temperature_offset")
        return self

    @property
    def moment(self) -> tuple[str, float]:
        """``("after_requests", n)`` or ``("after_s", seconds)``."""
        if self.after_requests is not None:
            return "after_requests", self.after_requests
        assert self.after_s is not None
        return "after_s", self.after_s

    def due(self, requests: int, elapsed_s: float) -> bool:
        """Whether it applies to a request after ``requests`` earlier ones, ``elapsed_s`` in."""
        if self.after_requests is not None:
            return requests >= self.after_requests
        return self.after_s is not None and elapsed_s >= self.after_s


class Provider(_Strict):
    """One endpoint of the roster's model. A provider with several endpoints is several
    entries with the same ``name`` and ``slug`` and their own ``tag``s."""

    name: str = Field(min_length=1)
    """``provider_name`` as OpenRouter spells it (e.g. ``DeepInfra``)."""
    slug: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    tag: str = Field(min_length=1)
    """Endpoint tag, e.g. ``deepinfra/fp4`` (or the bare slug for a provider's default
    endpoint); routing accepts the name or slug (every endpoint of the provider) or the tag."""
    reply_provider_as: Literal["name", "slug"] = "name"
    """How a reply's top-level ``provider`` spells it: display name or slug (OpenRouter does both)."""
    unsupported_parameters: tuple[OptionalParameter, ...] = ()
    """Parameters missing from the endpoint's ``supported_parameters`` (``require_parameters``
    then routes around it)."""
    quantization: Quantization
    """What the provider *declares* (OpenRouter's enum, ``unknown`` included)."""
    precision: str
    """What it really serves (hidden from clients)."""
    mixture: dict[str, float] = Field(default_factory=dict)
    """``{precision: share}``: that share of requests is served at another precision."""
    temperature_offset: float = 0.0
    """A misconfigured sampler: added to every request's temperature."""
    drift: tuple[Drift, ...] = ()
    """Changes of ``precision``, ``mixture`` or ``temperature_offset`` mid-run (hidden from
    clients); those whose moment has come apply in list order."""
    pricing: Pricing
    status: int = 0
    uptime_last_30m: float | None = Field(default=99.9, ge=0, le=100)
    context_length: int = Field(default=8192, ge=16)
    max_completion_tokens: int | None = Field(default=4096, ge=1)
    supports_logprobs: bool = True
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """What its logprobs are of, as vLLM's ``--logprobs-mode`` names it: the model's raw
    distribution, or the one sampled from, after temperature and top-p (``processed_logprobs``)."""
    collects_data: bool = False
    """Whether the provider may train on prompts (``provider.data_collection: deny`` skips it)."""
    latency_ms: float = Field(default=300.0, ge=0)
    """Time to first token (latency mode sleeps it; both modes report it)."""
    throughput_tps: float = Field(default=60.0, gt=0)
    """Output tokens per second (latency mode streams at this rate)."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """Requests it generates at once; the rest wait their turn in arrival order while their
    clients' clocks run (a loaded provider: the slow gateway). A request whose client gave
    up waiting is still generated and billed, as a real provider does. None: no limit."""
    rate_limit: RateLimit | None = None
    faults: Faults = Faults()

    @field_validator("name", "tag")
    @classmethod
    def _no_padding(cls, value: str) -> str:
        if value != value.strip():
            raise ValueError(f"must not start or end with whitespace (routing strips it), got {value!r}")
        return value

    _check_precision = field_validator("precision")(_known_precision)
    _check_mixture = field_validator("mixture")(_valid_mixture)

    @field_validator("status")
    @classmethod
    def _known_status(cls, value: int) -> int:
        if value not in ENDPOINT_STATUSES:
            raise ValueError(f"status must be one of {ENDPOINT_STATUSES} (OpenRouter's EndpointStatus), got {value}")
        return value

    @field_validator("drift")
    @classmethod
    def _drifts_in_order(cls, drifts: tuple[Drift, ...]) -> tuple[Drift, ...]:
        last: dict[str, tuple[int, float]] = {}  # kind -> (index, moment) of the previous drift of that kind
        for i, drift in enumerate(drifts):
            kind, moment = drift.moment
            if kind in last and moment <= last[kind][1]:
                j, before = last[kind]
                raise ValueError(f"drift {i}'s {kind} ({moment:g}) must be later than drift {j}'s ({before:g})")
            last[kind] = (i, moment)
        return drifts

    def truth_at(self, requests: int, elapsed_s: float) -> Truth:
        """What it really serves to a chat request that comes after ``requests`` earlier ones
        to this endpoint and ``elapsed_s`` seconds after the sandbox started: its own truth,
        with every drift whose moment has come applied in list order (a field a drift leaves
        unset keeps its previous value)."""
        precision, mixture, offset, index = self.precision, self.mixture, self.temperature_offset, None
        for i, drift in enumerate(self.drift):
            if drift.due(requests, elapsed_s):
                precision = drift.precision if drift.precision is not None else precision
                mixture = drift.mixture if drift.mixture is not None else mixture
                offset = drift.temperature_offset if drift.temperature_offset is not None else offset
                index = i
        return Truth(precision=precision, mixture=mixture, temperature_offset=offset, drift=index)

    @property
    def routable(self) -> bool:
        return self.status > -3

    @property
    def reply_name(self) -> str:
        """The top-level ``provider`` of its replies."""
        return self.name if self.reply_provider_as == "name" else self.slug

    @property
    def supported_parameters(self) -> list[str]:
        params = ["max_tokens", *(p for p in OPTIONAL_PARAMETERS if p not in self.unsupported_parameters)]
        if self.supports_logprobs:
            params += ["logprobs", "top_logprobs"]
        return params


class Thinking(_Strict):
    """The reasoning profile: the model thinks before it answers, as Kimi K2.5 does.

    The chat template opens a thinking block after the generation prompt (``open``); the
    model samples ``think_tokens`` tokens of reasoning (fewer if it would stop), then the
    block's end (``close``) is forced and the answer follows; ``max_tokens`` counts them all,
    so a small budget leaves the answer empty (``finish_reason: length``). With thinking off
    (OpenRouter ``reasoning: {effort: "none"}`` or ``{enabled: false}``; at the reference
    ``chat_template_kwargs: {<template_kwarg>: false}``) the template renders an empty block
    and the model answers at once. Replies carry the reasoning apart from the answer
    (``message.reasoning``), with logprobs over every token, as vLLM returns them."""

    think_tokens: int = Field(default=16, ge=1)
    open: str = Field(default="<think>\n", min_length=1)
    close: str = Field(default="</think>\n", min_length=1)
    template_kwarg: str = Field(default="thinking", min_length=1)
    mandatory: bool = False
    """Thinking cannot be turned off (OpenRouter refuses ``effort: "none"``)."""


class ModelInfo(_Strict):
    """The one model every roster provider serves."""

    id: str = Field(default=SANDBOX_MODEL, pattern=r"^[a-z0-9._-]+/[a-z0-9._:-]+$")
    name: str = "SmolLM2 135M Instruct (quanthunt sandbox)"
    description: str = "SmolLM2-135M-Instruct served by the quanthunt sandbox at several real precisions."
    context_length: int = Field(default=8192, ge=16)
    reasoning: Thinking | None = None
    """The reasoning profile (off unless set)."""


class KeyLimit(_Strict):
    """A sandbox API key with its own credit limit."""

    key: str = Field(min_length=1)
    limit_usd: float = Field(ge=0, allow_inf_nan=False)


class Credits(_Strict):
    """Per-key balance: any key starts with ``default_usd``; ``keys`` set their own."""

    default_usd: float = Field(default=100.0, ge=0, allow_inf_nan=False)
    keys: tuple[KeyLimit, ...] = ()
    limit_source_in_402: bool = True
    """False: an out-of-money 402 carries no ``error.metadata`` (as the spec's own example);
    the in-flight-budget 402 always names its ``limit_source``."""


class Outage(_Strict):
    """A stretch of the reference's ``/completions`` requests answered 503, as a reference
    that stalls or restarts mid-audit does (a real vLLM on a loaded 2-core machine held a
    dozen scoring requests for minutes while the sandbox computed beside it)."""

    after: int = Field(ge=0)
    """Requests answered before the outage starts (``Reference.check`` sends up to four)."""
    requests: int | None = Field(default=None, ge=1)
    """Requests answered 503 before it ends; null: the reference never comes back."""


class Roster(_Strict):
    """A sandbox roster file."""

    model: ModelInfo = ModelInfo()
    providers: tuple[Provider, ...] = Field(min_length=1)
    credits: Credits = Credits()
    seed: int = 0
    """Seeds fault injection and load balancing, so a run's faults repeat."""
    gateway_faults: Faults = Faults()
    """Faults of the gateway itself, on every route but chat completions (model and
    endpoint lists, generation lookups, key status); ``finish_error``, ``error_200`` and
    ``empty_answer`` do not apply."""
    generation_lookup_delay_s: float = Field(default=0.0, ge=0)
    """``/generation?id=`` answers 404 for this long after a reply (OpenRouter: ~1 s)."""
    reference_flavour: Literal["vllm", "sglang"] = "vllm"
    """How ``/reference`` answers, as that server does (``sandbox/reference_api.py``)."""
    reference_outage: Outage | None = None
    """An outage of the reference mid-run (none by default)."""
    deployments: dict[str, str] = {}
    """Other deployments of the model the team runs beside its reference, by name: each
    precision served as ``/reference`` is, under ``/deployments/<name>`` (e.g. ``{bf16-box:
    int4-bf16act, coarse: nvfp4}``: a second reference on other hardware, a coarse build)."""

    @field_validator("deployments")
    @classmethod
    def _deployments(cls, deployments: dict[str, str]) -> dict[str, str]:
        for name, precision in deployments.items():
            if not DEPLOYMENT_NAME.fullmatch(name):
                raise ValueError(f"deployment name {name!r} must be lower-case letters, digits and dashes (a URL segment)")
            if precision not in PRECISIONS:
                raise ValueError(f"deployment {name}: unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
        return deployments

    @field_validator("providers")
    @classmethod
    def _unique(cls, providers: tuple[Provider, ...]) -> tuple[Provider, ...]:
        tags = [p.tag.lower() for p in providers]
        dupes = sorted({t for t in tags if tags.count(t) > 1})
        if dupes:
            raise ValueError(f"endpoint tags must be unique (any case); repeated: {', '.join(dupes)}")
        names: dict[str, str] = {}  # slug -> the provider's name: one provider, one spelling
        owners: dict[str, str] = {}  # routing reference (as ``find`` compares it) -> the slug of the provider it names
        for p in providers:
            if names.setdefault(p.slug, p.name) != p.name:
                raise ValueError(f"provider slug {p.slug} is named both {names[p.slug]!r} and {p.name!r}")
            for ref in {p.name.lower(), p.slug, p.tag.lower()}:
                other = owners.setdefault(ref, p.slug)
                if other != p.slug:
                    raise ValueError(f"routing reference {ref!r} (name, slug or tag, any case) names both {other} and {p.slug}")
        return providers

    def find(self, ref: str) -> tuple[Provider, ...]:
        """The endpoints a routing reference (any case) names: all of a provider's for its
        name or slug, one for a tag (a bare-slug tag names the provider)."""
        wanted = ref.strip().lower()
        return tuple(p for p in self.providers if wanted in (p.name.lower(), p.slug, p.tag.lower()))


DEFAULT_ROSTER = "roster.yaml"


def parse_roster(text: str, *, source: str) -> Roster:
    """Parse roster YAML; errors name the file and the field."""
    data = parse_yaml(text, source=source, what="roster")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a roster is a mapping with a 'providers' list")
    return validated(Roster, data, source=source)


def default_roster_path() -> Path:
    """The roster shipped inside the package, as a file path."""
    return Path(str(resources.files("quanthunt.sandbox").joinpath(DEFAULT_ROSTER)))


def load_roster(path: Path | None = None) -> Roster:
    """Load a roster file, or the default shipped in the package when ``path`` is None."""
    if path is None:
        text = resources.files("quanthunt.sandbox").joinpath(DEFAULT_ROSTER).read_text(encoding="utf-8")
        return parse_roster(text, source=f"quanthunt/sandbox/{DEFAULT_ROSTER}")
    return parse_roster(read_text(path, what="roster"), source=str(path))
