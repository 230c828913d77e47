"""Roster files: the default one, prices, and errors that name the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from quanthunt.errors import ConfigError
from quanthunt.sandbox.model import _BUILDERS
from quanthunt.sandbox.roster import PRECISIONS, Pricing, Provider, Truth, load_roster, parse_roster


def test_every_precision_has_a_builder() -> None:
    assert set(_BUILDERS) == set(PRECISIONS)


def test_default_roster_tells_the_seed_story() -> None:
    roster = load_roster()
    truth = {p.tag: (p.quantization, p.precision, p.supports_logprobs) for p in roster.providers}
    assert truth["moonshotai/int4"] == ("int4", "int4-native", True)
    assert truth["fireworks/int4"] == ("int4", "int4-bf16act", True)
    assert truth["together/nvfp4"] == ("nvfp4", "nvfp4", True)
    assert truth["deepinfra/fp4"] == ("fp4", "mxfp4", True)
    assert truth["deepinfra/bf16"] == ("bf16", "int4-bf16act", True)  # one provider, two endpoints
    unknown = {tag: precision for tag, (declared, precision, _) in truth.items() if declared == "unknown"}
    assert sorted(unknown.values()) == ["int4-native", "nvfp4"]
    assert [tag for tag, (*_, logprobs) in truth.items() if not logprobs] == ["novita/int4"]
    assert roster.generation_lookup_delay_s == pytest.approx(1.0)  # OpenRouter's /generation lags ~1 s
    assert any(p.precision == "substitute" for p in roster.providers)
    # the team's other deployments: the reference on other hardware, with an fp8 KV cache, a coarse build
    assert roster.deployments == {"bf16-box": "int4-bf16act", "fp8-kv": "int4-fp8kv", "coarse": "nvfp4"}


def test_pricing_applies_discount_and_overrides() -> None:
    pricing = Pricing.model_validate(
        {
            "prompt": "0.000001",
            "completion": "0.000002",
            "discount": 0.25,
            "overrides": [{"min_prompt_tokens": 1000, "completion": "0.000004"}],
        }
    )
    assert pricing.rates(10) == pytest.approx((0.75e-6, 1.5e-6))
    assert pricing.rates(1000) == pytest.approx((0.75e-6, 3e-6))
    assert pricing.cost(1000, 100) == pytest.approx(1000 * 0.75e-6 + 100 * 3e-6)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("providers: [", "line 1"),
        ("- just a list", "a roster is a mapping"),
        ("providers: []", "providers: Tuple should have at least 1 item"),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int3, precision: int4-native,"
            " pricing: {prompt: '0', completion: '0'}}",
            "providers.0.quantization",
        ),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int4, precision: fp2,"
            " pricing: {prompt: '0', completion: '0'}}",
            "providers.0.precision: Value error, unknown precision 'fp2'",
        ),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int4, precision: int4-native,"
            " pricing: {prompt: 'cheap', completion: '0'}}",
            "providers.0.pricing.prompt",
        ),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int4, precision: int4-native, color: red,"
            " pricing: {prompt: '0', completion: '0'}}",
            "providers.0.color: unknown key (got 'red')",
        ),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int4, precision: int4-native,"
            " mixture: {nvfp4: 1.5}, pricing: {prompt: '0', completion: '0'}}",
            "providers.0.mixture",
        ),
        (
            "providers:\n- {name: A, slug: a, tag: a/x, quantization: int4, precision: int4-native, status: 3,"
            " pricing: {prompt: '0', completion: '0'}}",
            "providers.0.status",
        ),
        (
            "deployments: {Big Box: int4-native}\nproviders:\n- {name: A, slug: a, tag: a/x, quantization: int4,"
            " precision: int4-native, pricing: {prompt: '0', completion: '0'}}",
            "deployments: Value error, deployment name 'Big Box' must be lower-case letters, digits and dashes",
        ),
        (
            "deployments: {box: fp2}\nproviders:\n- {name: A, slug: a, tag: a/x, quantization: int4,"
            " precision: int4-native, pricing: {prompt: '0', completion: '0'}}",
            "deployments: Value error, deployment box: unknown precision 'fp2'",
        ),
    ],
)
def test_bad_roster_names_file_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_roster(text, source="bad.yaml")
    assert str(info.value).startswith("bad.yaml:")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_provider_may_have_several_endpoints_but_one_name_and_unique_tags() -> None:
    entry = "{name: %s, slug: a, tag: %s, quantization: int4, precision: int4-native, pricing: {prompt: '0', completion: '0'}}"
    roster = parse_roster(f"providers:\n- {entry % ('A', 'a')}\n- {entry % ('A', 'a/turbo')}", source="r.yaml")
    assert [p.tag for p in roster.find("A")] == ["a", "a/turbo"] and [p.tag for p in roster.find("A/TURBO")] == ["a/turbo"]
    with pytest.raises(ConfigError, match="provider slug a is named both 'A' and 'B'"):
        parse_roster(f"providers:\n- {entry % ('A', 'a/x')}\n- {entry % ('B', 'a/y')}", source="r.yaml")
    with pytest.raises(ConfigError, match="endpoint tags must be unique \\(any case\\); repeated: a/x"):
        parse_roster(f"providers:\n- {entry % ('A', 'a/x')}\n- {entry % ('A', 'A/X')}", source="r.yaml")


def test_missing_and_undecodable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="roster file not found"):
        load_roster(tmp_path / "nope.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read roster"):
        load_roster(binary)


ENTRY = "{name: A, slug: a, tag: a/x, quantization: int4, precision: int4-native, pricing: {prompt: '0', completion: '0'}, %s}"


def drifting(**extra: object) -> Provider:
    entry = {"name": "A", "slug": "a", "tag": "a/x", "quantization": "int4", "precision": "int4-native",
             "mixture": {"int8": 0.1}, "temperature_offset": 0.5, "pricing": {"prompt": "0", "completion": "0"}}  # fmt: skip
    return Provider.model_validate({**entry, **extra})


def test_a_good_drift_parses() -> None:
    drift = "drift: [{after_requests: 30, precision: nvfp4}, {after_s: 60, mixture: {mxfp4: 0.2}, temperature_offset: 0.3}]"
    (provider,) = parse_roster(f"providers:\n- {ENTRY % drift}", source="r.yaml").providers
    assert [(d.moment, d.precision, d.mixture, d.temperature_offset) for d in provider.drift] == [
        (("after_requests", 30), "nvfp4", None, None),
        (("after_s", 60.0), None, {"mxfp4": 0.2}, 0.3),
    ]


@pytest.mark.parametrize(
    ("drift", "message"),
    [
        ("[{after_requests: 3, precision: fp2}]", "drift.0.precision: Value error, unknown precision 'fp2'"),
        ("[{after_requests: 3, mixture: {fp2: 0.1}}]", "drift.0.mixture: Value error, unknown precision 'fp2' in mixture"),
        ("[{after_requests: 3, mixture: {nvfp4: 0.7, int8: 0.7}}]", "drift.0.mixture: Value error, mixture shares add up"),
        ("[{after_requests: 3, after_s: 5, precision: nvfp4}]",
         "drift.0: Value error, a drift needs exactly one of after_requests or after_s, got both"),
        ("[{precision: nvfp4}]", "drift.0: Value error, a drift needs exactly one of after_requests or after_s, got neither"),
        ("[{after_requests: 3}]",
         "drift.0: Value error, a drift must change at least one of precision, mixture or temperature_offset"),
        ("[{after_requests: 0, precision: nvfp4}]", "drift.0.after_requests: Input should be greater than or equal to 1"),
        ("[{after_s: 0, precision: nvfp4}]", "drift.0.after_s: Input should be greater than 0"),
        ("[{after_s: .nan, precision: nvfp4}]", "drift.0.after_s"),
        ("[{after_requests: 3, temperature_offset: .inf}]", "drift.0.temperature_offset"),
        ("[{after_requests: 3, quantization: fp8}]", "drift.0.quantization: unknown key"),
        ("[{after_requests: 30, precision: nvfp4}, {after_s: 5, precision: int8}, {after_requests: 30, precision: int8}]",
         "drift: Value error, drift 2's after_requests (30) must be later than drift 0's (30)"),
        ("[{after_s: 9.5, precision: nvfp4}, {after_s: 2, precision: int8}]",
         "drift: Value error, drift 1's after_s (2) must be later than drift 0's (9.5)"),
    ],
)  # fmt: skip
def test_bad_drift_names_the_field(drift: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_roster(f"providers:\n- {ENTRY % f'drift: {drift}'}", source="bad.yaml")
    assert str(info.value).startswith(f"bad.yaml: providers.0.{message}"), str(info.value)


def test_truth_without_drift_is_the_providers_own() -> None:
    provider = drifting()
    own = Truth(precision="int4-native", mixture={"int8": 0.1}, temperature_offset=0.5, drift=None)
    assert provider.truth_at(0, 0.0) == own
    assert provider.truth_at(10**6, 1e9) == own


def test_truth_at_applies_due_drifts_in_order() -> None:
    provider = drifting(
        drift=[
            {"after_requests": 30, "precision": "nvfp4"},
            {"after_s": 60, "mixture": {}, "temperature_offset": 0.0},
            {"after_requests": 100, "precision": "mxfp4", "mixture": {"substitute": 0.5}},
        ]
    )
    truth = provider.truth_at
    assert truth(29, 59.9) == Truth("int4-native", {"int8": 0.1}, 0.5, None)  # the 30th request: still the old truth
    assert truth(30, 0.0) == Truth("nvfp4", {"int8": 0.1}, 0.5, 0)  # the 31st: re-quantized, the rest kept
    assert truth(0, 60.0) == Truth("int4-native", {}, 0.0, 1)  # a drift in time alone
    assert truth(30, 60.0) == Truth("nvfp4", {}, 0.0, 1)
    assert truth(100, 0.0) == Truth("mxfp4", {"substitute": 0.5}, 0.5, 2)
    assert truth(100, 61.0) == Truth("mxfp4", {"substitute": 0.5}, 0.0, 2)  # list order: drift 2's mixture wins
