"""OpenRouter's provider routing, as its docs describe the ``provider`` object.

Filters (``only``, ``ignore``, ``quantizations``, ``data_collection``,
``require_parameters``, ``max_price``, context length) narrow the roster; ``order`` or
``sort`` rank what is left, otherwise endpoints are load-balanced with weights
proportional to the inverse square of their price (OpenRouter's default). With
``allow_fallbacks: false`` only the first endpoint is tried. Filters that leave nothing
give 404 ``constraint_filtered``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from quanthunt.sandbox.roster import Provider, Roster
from quanthunt.spec import PREFERENCE_KEYS, QUANTIZATIONS

SORTS = ("price", "throughput", "latency")
PARAMETERS_NEEDING_SUPPORT = ("logprobs", "top_logprobs", "seed", "stop", "temperature", "top_p")


class BadPreferences(ValueError):
    """The ``provider`` object is invalid; the message names the field."""


class NoEndpoint(Exception):
    """Nothing left to route to."""

    def __init__(self, message: str, *, constraint_filtered: bool) -> None:
        super().__init__(message)
        self.constraint_filtered = constraint_filtered


@dataclass(frozen=True)
class Preferences:
    """A parsed ``provider`` object."""

    order: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    quantizations: tuple[str, ...] = ()
    allow_fallbacks: bool = True
    require_parameters: bool = False
    data_collection: str = "allow"
    sort: str | None = None
    max_price: dict[str, float] = field(default_factory=dict)


def _str_list(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadPreferences(f"provider.{name} must be a list of strings")
    return tuple(value)


def _bool(value: Any, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadPreferences(f"provider.{name} must be a boolean")
    return value


def parse_preferences(raw: Any) -> Preferences:
    """Validate a request's ``provider`` object as strictly as the spec does."""
    if raw is None:
        return Preferences()
    if not isinstance(raw, dict):
        raise BadPreferences("provider must be an object")
    unknown = sorted(set(raw) - PREFERENCE_KEYS)
    if unknown:
        raise BadPreferences(f"provider: unknown field {unknown[0]!r} (ProviderPreferences allows no additional properties)")
    quantizations = _str_list(raw.get("quantizations"), "quantizations")
    for q in quantizations:
        if q not in QUANTIZATIONS:
            raise BadPreferences(f"provider.quantizations: {q!r} is not one of {', '.join(QUANTIZATIONS)}")
    data_collection = raw.get("data_collection") or "allow"
    if data_collection not in ("allow", "deny"):
        raise BadPreferences("provider.data_collection must be 'allow' or 'deny'")
    sort = raw.get("sort")
    if isinstance(sort, dict):
        sort = sort.get("by")
    if sort is not None and sort not in SORTS:
        raise BadPreferences(f"provider.sort must be one of {', '.join(SORTS)}")
    max_price: dict[str, float] = {}
    raw_price = raw.get("max_price")
    if raw_price is not None:
        if not isinstance(raw_price, dict):
            raise BadPreferences("provider.max_price must be an object")
        for key, value in raw_price.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise BadPreferences(f"provider.max_price.{key} must be a number of USD per million tokens") from None
            if not math.isfinite(number) or number < 0:
                raise BadPreferences(f"provider.max_price.{key} must be a finite non-negative number")
            max_price[key] = number
    return Preferences(
        order=_str_list(raw.get("order"), "order"),
        only=_str_list(raw.get("only"), "only"),
        ignore=_str_list(raw.get("ignore"), "ignore"),
        quantizations=quantizations,
        allow_fallbacks=_bool(raw.get("allow_fallbacks"), "allow_fallbacks", True),
        require_parameters=_bool(raw.get("require_parameters"), "require_parameters", False),
        data_collection=data_collection,
        sort=sort,
        max_price=max_price,
    )


def _matches(provider: Provider, refs: tuple[str, ...]) -> bool:
    names = {provider.name.lower(), provider.slug, provider.tag.lower()}
    return any(ref.strip().lower() in names for ref in refs)


def _within_price(provider: Provider, max_price: dict[str, float], prompt_tokens: int) -> bool:
    prompt_rate, completion_rate = provider.pricing.rates(prompt_tokens)
    if "prompt" in max_price and prompt_rate * 1e6 > max_price["prompt"] + 1e-12:
        return False
    return not ("completion" in max_price and completion_rate * 1e6 > max_price["completion"] + 1e-12)


def route(
    roster: Roster,
    prefs: Preferences,
    *,
    parameters: set[str],
    prompt_tokens: int,
    max_tokens: int,
    rng: random.Random,
) -> list[Provider]:
    """The endpoints to try, in order. Raises ``NoEndpoint`` when none qualifies."""
    candidates = [p for p in roster.providers if p.routable]
    if not candidates:
        raise NoEndpoint("No endpoints available for this model", constraint_filtered=False)
    if prefs.only:
        candidates = [p for p in candidates if _matches(p, prefs.only)]
    if prefs.ignore:
        candidates = [p for p in candidates if not _matches(p, prefs.ignore)]
    if prefs.quantizations:
        candidates = [p for p in candidates if p.quantization in prefs.quantizations]
    if prefs.data_collection == "deny":
        candidates = [p for p in candidates if not p.collects_data]
    if prefs.require_parameters:
        needed = parameters & set(PARAMETERS_NEEDING_SUPPORT)
        candidates = [p for p in candidates if needed <= set(p.supported_parameters)]
    if prefs.max_price:
        candidates = [p for p in candidates if _within_price(p, prefs.max_price, prompt_tokens)]
    candidates = [p for p in candidates if p.context_length >= prompt_tokens + max_tokens]
    if not candidates:
        raise NoEndpoint(
            "No endpoints found that match your provider preferences and request parameters",
            constraint_filtered=True,
        )
    if prefs.order:
        ranked: list[Provider] = []
        for ref in prefs.order:
            ranked += [p for p in candidates if _matches(p, (ref,)) and p not in ranked]
        ordered = ranked + [p for p in candidates if p not in ranked] if prefs.allow_fallbacks else ranked
        if not ordered:
            raise NoEndpoint("None of the providers in provider.order serves this request", constraint_filtered=True)
    elif prefs.sort == "price":
        ordered = sorted(candidates, key=lambda p: sum(p.pricing.rates(prompt_tokens)))
    elif prefs.sort == "throughput":
        ordered = sorted(candidates, key=lambda p: -p.throughput_tps)
    elif prefs.sort == "latency":
        ordered = sorted(candidates, key=lambda p: p.latency_ms)
    else:
        ordered = _load_balanced(candidates, prompt_tokens, rng)
    return ordered if prefs.allow_fallbacks else ordered[:1]


def _load_balanced(candidates: list[Provider], prompt_tokens: int, rng: random.Random) -> list[Provider]:
    """Weighted shuffle, weight = 1 / price² (cheaper endpoints get most traffic)."""
    if len(candidates) == 1:
        return list(candidates)
    pool = list(candidates)
    ordered: list[Provider] = []
    while pool:
        weights = [1.0 / max(sum(p.pricing.rates(prompt_tokens)), 1e-12) ** 2 for p in pool]
        choice = rng.choices(range(len(pool)), weights=weights)[0]
        ordered.append(pool.pop(choice))
    return ordered
