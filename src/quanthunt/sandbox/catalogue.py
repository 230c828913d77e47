"""What the sandbox's read-only OpenRouter routes answer, rendered from the roster and the
sandbox's records: the model list, a model's endpoints, the key, a generation.

Shapes follow OpenRouter's published OpenAPI spec (``Model``, ``PublicEndpoint``,
``KeyResponse``, ``GenerationResponse``; the contract tests validate them against schemas
derived from it). Pure: the routes in ``quanthunt.sandbox.app`` add faults and auth.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from quanthunt.sandbox.billing import Account, key_label
from quanthunt.sandbox.roster import ModelInfo, Provider, Roster

ARCHITECTURE = {
    "modality": "text->text",
    "input_modalities": ["text"],
    "output_modalities": ["text"],
    "tokenizer": "Other",
    "instruct_type": "chatml",
}


def endpoint(model: ModelInfo, provider: Provider) -> dict[str, Any]:
    """A ``PublicEndpoint`` as ``/models/{author}/{slug}/endpoints`` lists it."""
    pricing: dict[str, Any] = {
        "prompt": provider.pricing.prompt,
        "completion": provider.pricing.completion,
        "request": provider.pricing.request,
        "image": "0",
    }
    if provider.pricing.discount:
        pricing["discount"] = provider.pricing.discount
    if provider.pricing.overrides:
        pricing["overrides"] = [o.model_dump(exclude_none=True) for o in provider.pricing.overrides]
    latency_s = provider.latency_ms / 1000
    tps = provider.throughput_tps
    return {
        "name": f"{provider.name} | {model.id}",
        "model_id": model.id,
        "model_name": model.name,
        "context_length": provider.context_length,
        "pricing": pricing,
        "provider_name": provider.name,
        "tag": provider.tag,
        "quantization": provider.quantization,
        "max_completion_tokens": provider.max_completion_tokens,
        "max_prompt_tokens": provider.context_length,
        "supported_parameters": provider.supported_parameters,
        "status": provider.status,
        "uptime_last_30m": provider.uptime_last_30m,
        "uptime_last_5m": provider.uptime_last_30m,
        "uptime_last_1d": provider.uptime_last_30m,
        "supports_implicit_caching": False,
        "latency_last_30m": {"p50": latency_s, "p75": latency_s * 1.2, "p90": latency_s * 1.5, "p99": latency_s * 2.5},
        "throughput_last_30m": {"p50": tps, "p75": tps * 0.9, "p90": tps * 0.75, "p99": tps * 0.5},
    }


def model_entry(roster: Roster, created: int) -> dict[str, Any]:
    """The model as ``/models`` lists it, priced at its cheapest endpoint."""
    model = roster.model
    cheapest = min(roster.providers, key=lambda p: float(p.pricing.completion))
    author, slug = model.id.split("/", 1)
    entry = {
        "id": model.id,
        "canonical_slug": model.id,
        "name": model.name,
        "created": created,
        "description": model.description,
        "pricing": {
            "prompt": cheapest.pricing.prompt,
            "completion": cheapest.pricing.completion,
            "request": "0",
            "image": "0",
        },
        "context_length": model.context_length,
        "architecture": ARCHITECTURE,
        "top_provider": {
            "context_length": model.context_length,
            "max_completion_tokens": cheapest.max_completion_tokens,
            "is_moderated": False,
        },
        "per_request_limits": None,
        "supported_parameters": sorted({p for prov in roster.providers for p in prov.supported_parameters}),
        "default_parameters": {"temperature": None, "top_p": None, "frequency_penalty": None},
        "supported_voices": None,
        "links": {"details": f"/api/v1/models/{author}/{slug}/endpoints"},
    }
    if model.reasoning is not None:  # ModelReasoning: thinking is on unless turned off, where allowed
        entry["reasoning"] = {"mandatory": model.reasoning.mandatory, "default_enabled": True,
                              "default_effort": "medium", "supported_efforts": ["high", "medium", "low", "none"]}  # fmt: skip
    return entry


def model_endpoints(roster: Roster, created: int) -> dict[str, Any]:
    """The model and every endpoint, as ``/models/{author}/{slug}/endpoints`` lists them."""
    model = roster.model
    return {
        "id": model.id,
        "name": model.name,
        "created": created,
        "description": model.description,
        "architecture": ARCHITECTURE,
        "endpoints": [endpoint(model, p) for p in roster.providers],
    }


def key_data(key: str, account: Account) -> dict[str, Any]:
    """``KeyResponse.data`` for the calling key's account."""
    return {
        "label": key_label(key),
        "limit": account.limit,
        "limit_remaining": account.remaining,
        "limit_reset": None,
        "usage": account.usage,
        "usage_daily": account.usage,
        "usage_weekly": account.usage,
        "usage_monthly": account.usage,
        "byok_usage": 0.0,
        "byok_usage_daily": 0.0,
        "byok_usage_weekly": 0.0,
        "byok_usage_monthly": 0.0,
        "include_byok_in_limit": False,
        "is_free_tier": False,
        "is_management_key": False,
        "is_provisioning_key": False,
        "creator_user_id": None,
        "rate_limit": {"requests": -1, "interval": "10s", "note": "This field is deprecated and safe to ignore."},
    }


@dataclass(slots=True)
class GenerationRecord:
    """What the sandbox keeps of a served request; ``body`` renders ``GenerationResponse.data``."""

    id: str
    key_digest: str
    finished: float
    elapsed_ms: float
    provider_name: str
    cost: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    streamed: bool
    attempts: list[dict[str, Any]]

    def body(self, model_id: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "upstream_id": f"chatcmpl-{self.id[4:]}",
            "total_cost": self.cost,
            "cache_discount": None,
            "upstream_inference_cost": None,
            "created_at": datetime.fromtimestamp(self.finished, UTC).isoformat(),
            "model": model_id,
            "app_id": None,
            "streamed": self.streamed,
            "cancelled": False,
            "provider_name": self.provider_name,
            "latency": self.elapsed_ms,
            "moderation_latency": None,
            "generation_time": self.elapsed_ms,
            "finish_reason": self.finish_reason,
            "native_finish_reason": self.finish_reason,
            "service_tier": None,
            "tokens_prompt": self.prompt_tokens,
            "tokens_completion": self.completion_tokens,
            "native_tokens_prompt": self.prompt_tokens,
            "native_tokens_completion": self.completion_tokens,
            "native_tokens_completion_images": None,
            "native_tokens_reasoning": 0,
            "native_tokens_cached": 0,
            "num_media_prompt": None,
            "num_input_audio_prompt": None,
            "num_media_completion": None,
            "num_search_results": None,
            "num_fetches": None,
            "web_search_engine": None,
            "origin": "",
            "usage": self.cost,
            "is_byok": False,
            "external_user": None,
            "api_type": "completions",
            "preset_id": None,
            "router": None,
            "provider_responses": self.attempts,
            "user_agent": None,
            "http_referer": None,
            "data_region": "global",
            "workspace_id": None,
        }
