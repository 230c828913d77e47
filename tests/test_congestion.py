"""The adaptive in-flight limit: cut to half the flight on a timeout, once per window; grown
by about one per round trip on success; waiters admitted only under the limit."""

from __future__ import annotations

import asyncio

import pytest

from quanthunt.congestion import AdaptiveLimit


def test_a_timeout_halves_the_flight_once_per_window_and_success_grows_it_back() -> None:
    async def scenario() -> None:
        cuts: list[tuple[int, int]] = []
        limit = AdaptiveLimit(256, on_cut=lambda before, after: cuts.append((before, after)))
        async with limit.slot() as first, limit.slot() as second, limit.slot() as third, limit.slot() as fourth:
            assert limit.in_flight == 4
            assert limit.timed_out(first) is True  # 4 in flight: the limit drops to 2, below the 256 it was sent under
            assert limit.allowed == 2 and cuts == [(256, 2)]
            assert limit.timed_out(second) is True  # same window: no second cut, but its retry runs lower
            assert limit.allowed == 2 and len(cuts) == 1
            limit.succeeded(third)
            limit.succeeded(fourth)
        assert limit.limit == pytest.approx(2 + 1 / 2 + 1 / 2.5)
        async with limit.slot() as alone:
            assert limit.timed_out(alone) is True  # a new window: cut again, to half of one in flight (floor 1)
        assert limit.allowed == 1
        async with limit.slot() as lonely:
            assert limit.timed_out(lonely) is False  # sent alone and still too slow: a retry would not be lower
        for _ in range(50):
            async with limit.slot() as ok:
                limit.succeeded(ok)
        assert 9 < limit.limit < 11  # additive: ~√(2·50) after 50 successes from 1, never a jump to the ceiling

    asyncio.run(scenario())


def test_waiters_are_admitted_only_under_the_limit() -> None:
    async def scenario() -> int:
        limit = AdaptiveLimit(3)
        peak = 0

        async def request() -> None:
            nonlocal peak
            async with limit.slot() as ticket:
                peak = max(peak, limit.in_flight)
                await asyncio.sleep(0.01)
                limit.succeeded(ticket)

        await asyncio.gather(*(request() for _ in range(20)))
        return peak

    assert asyncio.run(scenario()) == 3


def test_the_ceiling_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AdaptiveLimit(0)
