"""Policy decisions and budget arithmetic (the survey's pure core)."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.params import SHIPPED, changed

from quanthunt.params import PurchasePlan
from quanthunt.replies import Endpoint
from quanthunt.survey import SENT_PARAMETERS, apply_policy, plan_budget, price_scenario, probe_cost


def endpoint(name: str, **fields: Any) -> Endpoint:
    data: dict[str, Any] = {
        "provider_name": name,
        "tag": f"{name.lower()}/int4",
        "quantization": "int4",
        "context_length": 8192,
        "pricing": {"prompt": "0.0000006", "completion": "0.0000022"},
        "status": 0,
        "uptime_last_30m": 99.0,
        "supported_parameters": [*SENT_PARAMETERS, "stop", "logprobs", "top_logprobs"],
    }
    data.update(fields)
    return Endpoint.model_validate(data)


OPEN = changed(
    SHIPPED.survey.policy,
    allowed_quantizations=("int4", "int8", "fp8", "bf16", "fp16", "fp32", "unknown"),
    ignore_providers=(), max_prompt_usd_per_m=None, max_completion_usd_per_m=None, min_uptime=0.0, min_status=-2,
    require_logprobs=False,
)  # fmt: skip
"""A policy that excludes only what a test says."""


def make_budget(**fields: Any) -> PurchasePlan:
    return PurchasePlan(**{"input_tokens_per_output_token": 0.0, **fields})


POLICY = changed(OPEN, max_completion_usd_per_m=3.0, min_uptime=90, allowed_quantizations=("int4", "fp8", "unknown"))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, "candidate"),
        ({"quantization": None}, "candidate"),  # declared nothing: verification decides
        ({"quantization": "unknown"}, "candidate"),
        ({"quantization": "nvfp4"}, "excluded: declared nvfp4"),
        ({"status": -5}, "excluded: status -5"),
        ({"uptime_last_30m": 41.0}, "excluded: uptime 41.0 below 90"),
        ({"pricing": {"prompt": "0.0000006", "completion": "0.0000031"}}, "excluded: price above max"),
        ({"pricing": {"prompt": "0.0000006", "completion": "0.0000031", "discount": 0.1}}, "candidate"),  # 2.79 after discount
    ],
)
def test_policy_reasons(fields: dict[str, Any], reason: str) -> None:
    (row,) = apply_policy([endpoint("P", **fields)], POLICY)
    assert row.reason == reason
    assert row.is_candidate == (reason == "candidate")


def test_ignore_and_logprobs_requirements() -> None:
    rows = apply_policy(
        [endpoint("Keep"), endpoint("Skip"), endpoint("Blind", supported_parameters=list(SENT_PARAMETERS))],
        changed(OPEN, ignore_providers=("skip",), require_logprobs=True),
    )
    assert [r.reason for r in rows] == ["candidate", "excluded: ignored by policy", "excluded: no logprobs"]


def test_overrides_are_noted_and_discounts_applied() -> None:
    pricing = {
        "prompt": "0.000001",
        "completion": "0.000004",
        "discount": 0.25,
        "overrides": [{"min_prompt_tokens": 128000, "completion": "0.000008"}],
    }
    (row,) = apply_policy([endpoint("D", pricing=pricing)], OPEN)
    assert (row.prompt_usd_per_m, row.completion_usd_per_m) == pytest.approx((0.75, 3.0))
    assert row.price_note == "overrides apply: prompts >= 128000 tokens"


def test_the_seeds_arithmetic() -> None:
    """60M output tokens at $2.20/M cost $132 > $100; $100 buys ~45M tokens, 7.5M per dataset."""
    (row,) = apply_policy([endpoint("Seed")], OPEN)
    scenario = price_scenario("cheapest", row, make_budget(usd=100, datasets=6, output_tokens_per_dataset=10_000_000))
    assert scenario.output_cost_usd == pytest.approx(132.0)
    assert not scenario.within_budget
    assert scenario.affordable_output_tokens == 45_454_545
    assert scenario.affordable_output_tokens_per_dataset == 7_575_757


def test_input_tokens_raise_the_cost() -> None:
    (row,) = apply_policy([endpoint("Seed")], OPEN)
    budget = make_budget(usd=100, datasets=6, output_tokens_per_dataset=10_000_000, input_tokens_per_output_token=0.5)
    scenario = price_scenario("x", row, budget)
    assert scenario.input_cost_usd == pytest.approx(60e6 * 0.5 * 0.6 / 1e6)  # $18
    assert scenario.total_cost_usd == pytest.approx(150.0)
    assert scenario.affordable_with_input_tokens == int(100 / (2.2e-6 + 0.5 * 0.6e-6))


def test_plan_prices_cheapest_median_worst_and_probes() -> None:
    rows = apply_policy(
        [
            endpoint("A", pricing={"prompt": "0.0000005", "completion": "0.000002"}),
            endpoint("B", pricing={"prompt": "0.0000006", "completion": "0.0000025"}),
            endpoint("C", pricing={"prompt": "0.0000004", "completion": "0.0000022"}),
            endpoint("Down", status=-10),
        ],
        OPEN,
    )
    probes = changed(SHIPPED.verify.probes, prompts=25, completions_per_prompt=2, max_tokens=64, mean_prompt_tokens=60)
    verify = changed(SHIPPED.verify, probes=probes, max_probes_per_provider=50)
    plan = plan_budget(rows, make_budget(usd=100, datasets=6, output_tokens_per_dataset=10_000_000), verify)
    assert [(s["scenario"], s["provider"]) for s in plan["scenarios"]] == [("cheapest", "A"), ("median", "C"), ("worst", "B")]
    assert plan["candidates"] == 3
    # worst case: every provider audited to its 50th probe, 2 each, and 2 asked at the generation's temperature
    assert plan["verification"]["requests"] == 3 * (50 * 2 + 2)
    expected = sum(probe_cost(r, verify) for r in rows if r.is_candidate)
    assert plan["verification"]["cost_usd"] == pytest.approx(expected, abs=2e-6)  # each endpoint's rounded to 1e-6
    assert probe_cost(rows[0], verify) == pytest.approx(102 * (60 * 0.5 + 64 * 2.0) / 1e6)
    assert plan["budget_after_verification_usd"] == pytest.approx(100 - expected, abs=2e-6)


def test_plan_without_candidates() -> None:
    rows = apply_policy([endpoint("X", quantization="fp4")], changed(OPEN, allowed_quantizations=("int4",)))
    plan = plan_budget(rows, make_budget(usd=10, datasets=1, output_tokens_per_dataset=1000), SHIPPED.verify)
    assert plan["candidates"] == 0 and plan["scenarios"] == [] and plan["verification"]["cost_usd"] == 0


@pytest.mark.parametrize(
    ("missing", "reason", "logprobs"),
    [
        ((), "candidate", True),
        (("seed",), "excluded: does not support seed", True),  # verification sends a seed with every probe
        (("top_p", "temperature"), "excluded: does not support temperature, top_p", True),
        (("max_tokens",), "excluded: does not support max_tokens", True),
        (("top_logprobs",), "candidate", False),  # logprobs without top_logprobs: sample-mode audit
    ],
)
def test_every_parameter_the_later_stages_send_must_be_supported(missing: tuple[str, ...], reason: str, logprobs: bool) -> None:
    listed = [p for p in (*SENT_PARAMETERS, "stop", "logprobs", "top_logprobs") if p not in missing]
    (row,) = apply_policy([endpoint("P", supported_parameters=listed)], POLICY)
    assert (row.reason, row.supports_logprobs) == (reason, logprobs)


def test_two_endpoints_of_one_provider_are_planned_apart() -> None:
    rows = apply_policy(
        [endpoint("DeepInfra", tag="deepinfra/fp8", quantization="fp8"), endpoint("DeepInfra", tag="deepinfra/int4")], POLICY
    )
    plan = plan_budget(rows, make_budget(usd=100, datasets=1, output_tokens_per_dataset=10**6), SHIPPED.verify)
    assert set(plan["verification"]["per_endpoint_usd"]) == {"deepinfra/fp8", "deepinfra/int4"}
    assert plan["verification"]["cost_usd"] == pytest.approx(2 * probe_cost(rows[0], SHIPPED.verify), abs=1e-6)
