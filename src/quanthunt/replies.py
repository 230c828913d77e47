"""The typed replies of an OpenRouter-compatible gateway: what :mod:`quanthunt.gateway`
parses its response bodies into.

Each model checks what quanthunt relies on and ignores every other field: counts are
non-negative 64-bit integers, money is finite and non-negative, prices are decimal strings of
USD per token (:func:`quanthunt.spec.check_price`), logprobs are finite and at most 0 up to
rounding. The models are frozen. A body that does not fit them never comes back half-read:
the gateway client turns the validation error into a ``GatewayError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanthunt.spec import check_price


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


Count = Annotated[int, Field(ge=0, lt=2**63)]
Money = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class PricingOverride(_Reply):
    """A conditional price (``pricing.overrides[]``): the survey notes its condition and
    prices the endpoint at its default prices."""

    min_prompt_tokens: Count | None = None
    """Applies to requests whose prompt has at least this many tokens (None: on some other condition)."""
    prompt: str | None = None
    """USD per prompt token while it applies (None: the default price)."""
    completion: str | None = None
    """USD per completion token while it applies (None: the default price)."""

    _check = field_validator("prompt", "completion")(check_price)


class Pricing(_Reply):
    """An endpoint's prices (``pricing``): decimal strings of USD per token, before ``discount``."""

    prompt: str
    completion: str
    request: str | None = None
    """USD per request, where the endpoint charges one (the survey's prices leave it out)."""
    discount: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    """Share taken off every price."""
    overrides: list[PricingOverride] = Field(default_factory=list)

    _check = field_validator("prompt", "completion", "request")(check_price)


class Percentiles(_Reply):
    p50: float | None = None


class Endpoint(_Reply):
    """One provider's endpoint for a model (``PublicEndpoint``)."""

    provider_name: str
    tag: str
    name: str = ""
    quantization: str | None = None
    context_length: int
    max_completion_tokens: int | None = None
    pricing: Pricing
    status: int | None = None
    uptime_last_30m: float | None = None
    supported_parameters: list[str] = Field(default_factory=list)
    latency_last_30m: Percentiles | None = None
    throughput_last_30m: Percentiles | None = None

    @property
    def declared_quantization(self) -> str:
        return self.quantization or "unknown"

    @property
    def supports_logprobs(self) -> bool:
        """Both ``logprobs`` and ``top_logprobs``: verification sends the two together, and
        ``require_parameters`` refuses an endpoint missing either."""
        return {"logprobs", "top_logprobs"} <= set(self.supported_parameters)

    def usd_per_million(self) -> tuple[float, float]:
        """(prompt, completion) USD per million tokens after the discount, at default conditions."""
        keep = 1.0 - self.pricing.discount
        return float(self.pricing.prompt) * 1e6 * keep, float(self.pricing.completion) * 1e6 * keep


class ModelReasoning(_Reply):
    """A model's reasoning settings as ``/models`` lists them (``ModelReasoning``)."""

    mandatory: bool
    """Thinking cannot be turned off (effort ``none`` is refused)."""
    default_enabled: bool | None = None


class EndpointList(_Reply):
    """The ``data`` object of ``GET /models/{author}/{slug}/endpoints``."""

    id: str
    endpoints: list[Endpoint]


class TopLogprob(_Reply):
    token: str
    logprob: float = Field(allow_inf_nan=False, le=1e-3)
    """At most 0 up to rounding."""
    bytes: list[int] | None = None


class TokenLogprob(_Reply):
    token: str
    logprob: float = Field(allow_inf_nan=False, le=1e-3)
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class _Logprobs(_Reply):
    content: list[TokenLogprob] | None = None


class _Message(_Reply):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class _Choice(_Reply):
    message: _Message
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    error: dict[str, Any] | None = None


class Usage(_Reply):
    prompt_tokens: Count
    completion_tokens: Count
    cost: Money | None = None


class ChatResult(_Reply):
    """A chat completion body (``ChatResponse``) as it arrives; ``gateway.parse_chat_reply``
    makes it a :class:`ChatReply`."""

    id: str
    model: str
    provider: str | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: Usage | None = None


@dataclass(frozen=True)
class ChatReply:
    """A chat completion as quanthunt needs it."""

    id: str
    generation_id: str | None
    provider: str | None
    model: str
    content: str
    reasoning: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    usage: Usage | None
    error: dict[str, Any] | None = None


class KeyStatus(_Reply):
    limit: float | None = None
    limit_remaining: float | None = None
    usage: float = 0.0


class Generation(_Reply):
    """``/generation?id=``: what the gateway recorded (and charged) for one request."""

    id: str
    provider_name: str | None = None
    total_cost: Money = 0.0
    tokens_prompt: Count | None = None
    tokens_completion: Count | None = None
    finish_reason: str | None = None
    provider_responses: list[dict[str, Any]] | None = None


def same_provider(named: str | None, provider_name: str, tag: str) -> bool:
    """Whether a reply's ``provider`` field names the endpoint's provider: OpenRouter
    spells it as the display name (``DeepInfra``) or the slug (``deepinfra``), in any case."""
    wanted = (named or "").strip().lower()
    return bool(wanted) and wanted in (provider_name.lower(), tag.split("/", maxsplit=1)[0].lower())
