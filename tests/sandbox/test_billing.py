"""Key accounts: reservations keep concurrent requests from overdrawing a key."""

from __future__ import annotations

import pytest

from quanthunt.sandbox.billing import Billing, Refusal, key_label
from quanthunt.sandbox.roster import Credits, KeyLimit


def test_reserve_settle_release() -> None:
    billing = Billing(Credits(default_usd=1.0))
    held = billing.reserve("k", 0.4)
    billing.settle("k", held, 0.1)
    account = billing.account("k")
    assert (account.usage, account.reserved, account.remaining) == pytest.approx((0.1, 0.0, 0.9))
    held = billing.reserve("k", 0.5)
    billing.release("k", held)
    assert billing.account("k").usage == pytest.approx(0.1)


def test_in_flight_reservations_give_a_transient_402() -> None:
    billing = Billing(Credits(default_usd=1.0))
    billing.reserve("k", 0.6)
    with pytest.raises(Refusal) as info:
        billing.reserve("k", 0.6)
    assert info.value.limit_source == "openrouter_in_flight_budget"
    assert info.value.retry_after_s


def test_out_of_credit_and_key_limits() -> None:
    billing = Billing(Credits(default_usd=0.5, keys=(KeyLimit(key="small", limit_usd=0.01),)))
    with pytest.raises(Refusal) as info:
        billing.reserve("other", 0.6)
    assert info.value.limit_source == "openrouter_credits"
    with pytest.raises(Refusal) as info:
        billing.reserve("small", 0.02)
    assert info.value.limit_source == "openrouter_key_limit"
    billing.add_credit("small", 1.0)
    assert billing.reserve("small", 0.02) == 0.02


def test_keys_are_held_as_digests_and_labels_are_masked() -> None:
    billing = Billing(Credits())
    billing.account("sk-or-v1-secret-value-123")
    assert all("secret" not in digest for digest in billing.totals())
    assert "secret" not in key_label("sk-or-v1-secret-value-123")
