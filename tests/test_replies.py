"""The typed replies: what an endpoint listing says about prices and logprobs, and the values
no reply may carry (prices that are not decimal USD per token, positive logprobs)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from quanthunt.replies import Endpoint, Pricing, PricingOverride, TokenLogprob


def endpoint(**fields: Any) -> Endpoint:
    pricing = {"prompt": "0.0000006", "completion": "0.0000025", "discount": 0.04}
    return Endpoint.model_validate(
        {"provider_name": "Fireworks", "tag": "fireworks", "context_length": 8192, "pricing": pricing, **fields}
    )


def test_an_endpoint_reads_its_listing() -> None:
    listed = endpoint(supported_parameters=["logprobs", "top_logprobs"], uptime_extra="ignored")
    assert listed.usd_per_million() == pytest.approx((0.6 * 0.96, 2.5 * 0.96))
    assert listed.supports_logprobs and listed.declared_quantization == "unknown"
    assert not endpoint(supported_parameters=["logprobs"]).supports_logprobs  # verification sends both together
    with pytest.raises(ValidationError):
        listed.tag = "other"


@pytest.mark.parametrize("price", ["free", "nan", "inf", "-0.000001"])
def test_a_price_is_a_finite_non_negative_decimal(price: str) -> None:
    with pytest.raises(ValidationError, match=r"USD per token|non-negative price"):
        Pricing(prompt="0", completion=price)
    with pytest.raises(ValidationError):
        PricingOverride(prompt=price)
    assert PricingOverride(prompt=None, completion="0.000001").prompt is None


def test_a_logprob_is_finite_and_at_most_zero_up_to_rounding() -> None:
    assert TokenLogprob(token="a", logprob=0.0005).logprob == 0.0005
    for bad in (0.01, float("nan"), float("-inf")):
        with pytest.raises(ValidationError):
            TokenLogprob(token="a", logprob=bad)
