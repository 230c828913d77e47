"""OpenRouter's provider routing rules over a roster."""

from __future__ import annotations

import random

import pytest
from fixtures.sandbox import provider, roster_dict

from quanthunt.sandbox.roster import Roster
from quanthunt.sandbox.routing import BadPreferences, NoEndpoint, Preferences, parse_preferences, route

ROSTER = Roster.model_validate(
    roster_dict(
        provider(
            "cheap",
            quantization="nvfp4",
            tag="cheap/nvfp4",
            pricing={"prompt": "0.0000001", "completion": "0.0000002"},
            latency_ms=300,
        ),
        provider("mid", pricing={"prompt": "0.000001", "completion": "0.000002"}, throughput_tps=500_000, latency_ms=200),
        provider("pricey", quantization="fp8", pricing={"prompt": "0.00001", "completion": "0.00002"}, latency_ms=5),
        provider("nolog", supports_logprobs=False, collects_data=True, latency_ms=400),
        provider("down", status=-5),
    )
)


def go(prefs: dict[str, object] | None = None, *, parameters: set[str] | None = None, max_tokens: int = 10) -> list[str]:
    chosen = route(
        ROSTER,
        parse_preferences(prefs),
        parameters=parameters or set(),
        prompt_tokens=10,
        max_tokens=max_tokens,
        rng=random.Random(0),
    )
    return [p.slug for p in chosen]


def test_only_accepts_name_slug_or_tag_and_skips_down_endpoints() -> None:
    assert go({"only": ["Cheap"]}) == ["cheap"]
    assert go({"only": ["cheap/nvfp4", "mid"], "sort": "price"}) == ["cheap", "mid"]
    with pytest.raises(NoEndpoint) as info:
        go({"only": ["down"]})
    assert info.value.constraint_filtered


def test_ignore_quantizations_and_data_collection() -> None:
    assert "cheap" not in go({"ignore": ["cheap"]})
    assert sorted(go({"quantizations": ["int4"]})) == ["mid", "nolog"]
    assert "nolog" not in go({"data_collection": "deny"})


def test_require_parameters_filters_on_logprobs() -> None:
    assert "nolog" in go(parameters={"logprobs"})
    assert "nolog" not in go({"require_parameters": True}, parameters={"logprobs"})


def test_max_price_is_per_million_tokens() -> None:
    assert sorted(go({"max_price": {"completion": 2}})) == ["cheap", "mid", "nolog"]
    assert go({"max_price": {"prompt": "0.5"}}) == ["cheap"]


def test_order_then_fallbacks_unless_disabled() -> None:
    order = go({"order": ["pricey", "mid"]})
    assert order[:2] == ["pricey", "mid"] and len(order) == 4
    assert go({"order": ["pricey", "mid"], "allow_fallbacks": False}) == ["pricey"]


def test_sorts() -> None:
    assert go({"sort": "price"})[0] == "cheap"
    assert go({"sort": {"by": "throughput"}})[0] == "mid"
    assert go({"sort": "latency"})[0] == "pricey"


def test_default_load_balancing_prefers_cheap_endpoints() -> None:
    rng = random.Random(1)
    firsts = [
        route(ROSTER, Preferences(), parameters=set(), prompt_tokens=10, max_tokens=10, rng=rng)[0].slug for _ in range(200)
    ]
    assert firsts.count("cheap") > 150  # weight 1/price^2: ten times cheaper, a hundred times likelier


def test_context_length_filters() -> None:
    with pytest.raises(NoEndpoint):
        go(max_tokens=10_000)


@pytest.mark.parametrize(
    ("prefs", "message"),
    [
        ({"onlyy": ["a"]}, "unknown field 'onlyy'"),
        ({"only": "a"}, "provider.only must be a list of strings"),
        ({"quantizations": ["int3"]}, "provider.quantizations: 'int3'"),
        ({"allow_fallbacks": "no"}, "provider.allow_fallbacks must be a boolean"),
        ({"sort": "cheapest"}, "provider.sort must be one of"),
        ({"max_price": {"prompt": "free"}}, "provider.max_price.prompt"),
        ({"data_collection": "maybe"}, "provider.data_collection"),
        ([], "provider must be an object"),
    ],
)
def test_bad_preferences_name_the_field(prefs: object, message: str) -> None:
    with pytest.raises(BadPreferences, match=message):
        parse_preferences(prefs)


def test_an_endpoint_without_a_parameter_is_routed_around_when_it_is_required() -> None:
    roster = Roster.model_validate(roster_dict(provider("noseed", unsupported_parameters=["seed"]), provider("full")))
    (noseed, full) = roster.providers
    assert "seed" not in noseed.supported_parameters and "seed" in full.supported_parameters
    strict = parse_preferences({"require_parameters": True})
    for _ in range(5):
        chosen = route(roster, strict, parameters={"seed"}, prompt_tokens=10, max_tokens=10, rng=random.Random(0))
        assert [p.slug for p in chosen] == ["full"]
    only = parse_preferences({"only": ["noseed"], "require_parameters": True})
    with pytest.raises(NoEndpoint):  # the gateway answers 404 constraint_filtered
        route(roster, only, parameters={"seed"}, prompt_tokens=10, max_tokens=10, rng=random.Random(0))
