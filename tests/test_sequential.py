"""Tests for ``quanthunt.sequential``: known wealth values, and seeded simulations of validity under
optional stopping, power, coverage and the exact tail-test power."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quanthunt.sequential import (
    EProcess,
    average_e_processes,
    betting_e_process,
    completions_for_e_tail,
    confidence_sequence,
    e_tail_power_curve,
)
from quanthunt.stats import adjust, one_sided_mean_test

ALPHA = 0.05


def crossed_at(process: EProcess, threshold: float) -> int | None:
    """The first t (1-based) with wealth ≥ ``threshold``, or None."""
    hits = np.flatnonzero(process.wealth >= threshold)
    return int(hits[0]) + 1 if hits.size else None


def test_betting_wealth_known_answer() -> None:
    # one bet, fraction 0.5 of the largest: lambda = 0.5 / m0 = 1, factor 1 + (x - 0.5)
    greater = betting_e_process([1.0, 1.0, 0.0], null_mean=0.5, alternative="greater", fractions=(0.5,))
    np.testing.assert_allclose(greater.wealth, [1.5, 2.25, 1.125])
    # "less" bets on m0 - x with lambda = f / (1 - m0): 1 + 0.25 / 0.75 * (0.25 - x)
    less = betting_e_process([0.0, 1.0], null_mean=0.25, alternative="less", fractions=(0.25,))
    np.testing.assert_allclose(less.wealth, [1 + 0.25 / 0.75 * 0.25, (1 + 0.25 / 0.75 * 0.25) * (1 - 0.25)])
    # two bets: the wealth is the average of the two capital processes
    mixed = betting_e_process([1.0], null_mean=0.5, alternative="greater", fractions=(0.5, 0.25))
    assert mixed.final == pytest.approx((1.5 + 1.25) / 2)
    assert mixed.peak == mixed.final and mixed.pvalue == pytest.approx(1 / mixed.final)
    assert crossed_at(greater, 2.0) == 2 and crossed_at(greater, 3.0) is None


def test_betting_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        betting_e_process([1.2], null_mean=0.5, alternative="greater")
    with pytest.raises(ValueError, match="null_mean"):
        betting_e_process([0.2], null_mean=0.0, alternative="greater")
    with pytest.raises(ValueError, match="fractions"):
        betting_e_process([0.2], null_mean=0.5, alternative="greater", fractions=(1.0,))
    with pytest.raises(ValueError, match="same observations"):
        average_e_processes([EProcess(np.ones(2)), EProcess(np.ones(3))])


@pytest.mark.parametrize("kind", ["bernoulli", "uniform-two-sided", "beta-at-margin"])
def test_e_process_ever_crosses_at_most_alpha_under_the_null(kind: str) -> None:
    """Ville: P(the wealth ever reaches 1/alpha) <= alpha, checked over 2,000 seeded null
    sequences of 400 observations, looked at after every one of them."""
    rng = np.random.default_rng(7)
    runs, n, crossed = 2000, 400, 0
    for _ in range(runs):
        if kind == "bernoulli":
            process = betting_e_process((rng.random(n) < 0.02).astype(float), null_mean=0.02, alternative="greater")
        elif kind == "uniform-two-sided":
            u = rng.random(n)  # both sides of mean 1/2, averaged (the sampler's two-sided test)
            sides = [betting_e_process(u, null_mean=0.5, alternative=side) for side in ("greater", "less")]
            process = average_e_processes(sides)
        else:  # the null's boundary: mean exactly at the margin
            process = betting_e_process(rng.beta(2, 6, n), null_mean=0.25, alternative="greater")
        crossed += process.peak >= 1 / ALPHA
    bound = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    assert crossed / runs <= bound


def test_optional_stopping_inflates_a_t_test_but_not_the_e_process() -> None:
    """Peeking after every observation and stopping at the first "significant" look: the
    fixed-sample t-test's error rate balloons, the e-process's stays below alpha."""
    rng = np.random.default_rng(3)
    runs, n = 400, 200
    t_hits = e_hits = 0
    for _ in range(runs):
        x = rng.random(n)  # mean 1/2: the null "mean <= 1/2" holds with equality
        e_hits += betting_e_process(x, null_mean=0.5, alternative="greater").peak >= 1 / ALPHA
        t_hits += any(one_sided_mean_test(x[:k], threshold=0.5, alternative="greater").pvalue < ALPHA for k in range(5, n + 1, 5))
    assert t_hits / runs > 0.15  # looking 40 times at a 5 % test
    assert e_hits / runs <= ALPHA


def test_e_process_power_grows_with_the_effect() -> None:
    rng = np.random.default_rng(11)
    x = np.clip(rng.normal(0.7, 0.2, 200), 0, 1)
    process = betting_e_process(x, null_mean=0.5, alternative="greater")
    first = crossed_at(process, 1 / ALPHA)
    assert first is not None and first < 40
    far = betting_e_process(np.clip(rng.normal(0.9, 0.1, 200), 0, 1), null_mean=0.5, alternative="greater")
    crossed_far = crossed_at(far, 1 / ALPHA)
    assert crossed_far is not None and crossed_far < first


def test_stopped_wealth_is_the_first_reaching_a_level_else_the_last() -> None:
    process = betting_e_process([1.0, 1.0, 1.0, 0.0, 0.0], null_mean=0.5, alternative="greater", fractions=(0.5,))
    np.testing.assert_allclose(process.wealth, [1.5, 2.25, 3.375, 1.6875, 0.84375])
    assert process.stopped(2.0) == 2.25  # stops betting at the first K_t ≥ 2
    assert process.stopped(10.0) == process.final == 0.84375  # never reached: the last


def test_confidence_sequence_covers_the_mean_at_every_time() -> None:
    rng = np.random.default_rng(5)
    runs, misses = 300, 0
    for _ in range(runs):
        x = rng.beta(2, 5, 150)  # mean 2/7
        low, high = confidence_sequence(x, alpha=ALPHA, grid=400)
        misses += bool(((low > 2 / 7) | (high < 2 / 7)).any())
        assert (np.diff(low) >= -1e-12).all() and (np.diff(high) <= 1e-12).all()  # it only shrinks
    assert misses / runs <= ALPHA
    low, high = confidence_sequence(rng.beta(2, 5, 2000), alpha=ALPHA, grid=400)
    assert high[-1] - low[-1] < 0.06  # and it does shrink around the mean


def test_confidence_sequence_holds_every_mean_no_test_has_rejected() -> None:
    """Off the grid too: a mean between the last kept grid point and the first rejected one
    may be unrejected, so the bounds reach the first rejected points (a coarse grid here)."""
    rng = np.random.default_rng(11)
    x = rng.beta(2, 5, 300)
    low, high = confidence_sequence(x, alpha=ALPHA, grid=40)
    outside = 0
    for m in np.linspace(0.001, 0.999, 999):
        for side, bound in (("less", high), ("greater", low)):
            wealth = betting_e_process(x, null_mean=float(m), alternative=side).wealth
            kept = np.maximum.accumulate(wealth) < 2 / ALPHA
            beyond = m > bound if side == "less" else m < bound
            outside += int((kept & beyond).sum())
    assert outside == 0
    assert high[-1] - low[-1] < 0.2  # the bounds still shrink


def e_bh(e_values: list[float]) -> list[bool]:
    """e-BH (Wang & Ramdas, JRSS-B 2022) as the decision module runs it: BH on ``1 / e``."""
    return [p <= ALPHA for p in adjust([min(1.0, 1.0 / e) for e in e_values], "bh")]  # e-BH rejects at equality


def test_e_bh_known_answer() -> None:
    # m = 3, alpha 0.05: e-BH rejects the k largest with e_(k) ≥ m / (alpha k) = 60, 30, 20
    assert e_bh([80.0, 1.2, 30.0]) == [True, False, True]
    assert e_bh([59.0, 1.0, 1.0]) == [False, False, False]
    assert e_bh([25.0, 25.0, 25.0]) == [True, True, True]
    assert e_bh([]) == []


def test_e_tail_power_is_exact() -> None:
    """The dynamic programme against a simulation of the very test it models."""
    rng = np.random.default_rng(2)
    rate, n, p0, threshold = 0.12, 40, 0.02, 60.0
    hits = sum(
        betting_e_process((rng.random(n) < rate).astype(float), null_mean=p0, alternative="greater").peak >= threshold
        for _ in range(4000)
    )
    curve = e_tail_power_curve(rate, 200, p0=p0, threshold=threshold)
    assert curve[n - 1] == pytest.approx(hits / 4000, abs=0.025)
    assert (np.diff(curve) >= 0).all()  # a crossed test stays crossed
    needed = completions_for_e_tail(rate, p0=p0, threshold=threshold, power=0.9)
    assert needed is not None and curve[needed - 1] >= 0.9 > curve[needed - 2]
    assert completions_for_e_tail(p0, p0=p0, threshold=threshold, power=0.9) is None  # the null never gets there
    # half the weight of an average: the tail test alone must reach twice the threshold
    half = e_tail_power_curve(rate, n, p0=p0, threshold=threshold, weight=0.5)
    np.testing.assert_array_equal(half, e_tail_power_curve(rate, n, p0=p0, threshold=2 * threshold))
