"""Tests for ``quanthunt.stats``: known values, scipy cross-checks, and seeded simulations of size and power."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from quanthunt.stats import (
    adjust,
    benjamini_hochberg,
    binomial_tail_test,
    bootstrap_ci,
    holm,
    one_sided_mean_test,
    stratified_permutation_test,
)

ALPHA = 0.05
N_SEEDS = 200


# ---------------------------------------------------------------------------------------------
# Multiple testing
# ---------------------------------------------------------------------------------------------


def test_holm_hand_computed() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_bh_hand_computed() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 → ×4/1, ×4/2, ×4/3, ×4/4 = 0.02, 0.02, 0.04, 0.04 (already monotone)
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    # step-up: the later, smaller scaled value pulls earlier ones down: 0.03·3/2 = 0.045 > 0.04·3/3 = 0.04
    assert benjamini_hochberg([0.02, 0.03, 0.04]) == pytest.approx([0.04, 0.04, 0.04])
    # textbook example (Benjamini & Hochberg 1995 style): m = 5
    assert benjamini_hochberg([0.001, 0.008, 0.039, 0.041, 0.042]) == pytest.approx([0.005, 0.02, 0.042, 0.042, 0.042])


def test_adjust_caps_at_one_and_dispatches() -> None:
    assert holm([0.5, 0.6, 0.9]) == pytest.approx([1.0, 1.0, 1.0])
    assert benjamini_hochberg([0.9, 0.95]) == pytest.approx([0.95, 0.95])
    p = [0.2, 0.01, 0.03]
    assert adjust(p, "holm") == holm(p)
    assert adjust(p, "bh") == benjamini_hochberg(p)
    assert holm([]) == [] and benjamini_hochberg([]) == []
    with pytest.raises(ValueError, match="method"):
        adjust(p, "bonferroni")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        holm([0.1, float("nan")])
    with pytest.raises(ValueError):
        benjamini_hochberg([1.2])


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=30))
def test_adjusted_pvalues_properties(p: list[float]) -> None:
    h, b = holm(p), benjamini_hochberg(p)
    for adj in (h, b):
        assert all(raw <= a + 1e-12 for raw, a in zip(p, adj, strict=True))
        assert all(a <= 1.0 for a in adj)
        # order preserving: a smaller raw p-value never gets a larger adjusted one
        order = np.argsort(p, kind="stable")
        assert all(np.diff(np.asarray(adj)[order]) >= -1e-12)
    # Holm is never less conservative than BH
    assert all(hv >= bv - 1e-12 for hv, bv in zip(h, b, strict=True))


# ---------------------------------------------------------------------------------------------
# One-sided t-test
# ---------------------------------------------------------------------------------------------


def test_t_test_matches_scipy() -> None:
    values = np.random.default_rng(7).normal(0.04, 0.02, size=23)
    for alternative in ("less", "greater"):
        res = one_sided_mean_test(values, threshold=0.05, alternative=alternative)
        ref = sps.ttest_1samp(values, popmean=0.05, alternative=alternative)
        assert res.pvalue == pytest.approx(ref.pvalue, rel=1e-10)
        assert res.statistic == pytest.approx(ref.statistic, rel=1e-10)
        assert res.n == 23
        assert res.mean == pytest.approx(values.mean())
        assert res.sd == pytest.approx(values.std(ddof=1))
        ci = sps.ttest_1samp(values, popmean=0.05).confidence_interval(0.95)
        assert (res.ci_low, res.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-10)
        assert res.ci_low < res.mean < res.ci_high
    # the mean is below the margin here, so "less" is significant and "greater" is not
    assert one_sided_mean_test(values, threshold=0.05, alternative="less").pvalue < 0.05
    assert one_sided_mean_test(values, threshold=0.05, alternative="greater").pvalue > 0.95


def test_t_test_degenerate_inputs() -> None:
    const = one_sided_mean_test([0.03, 0.03, 0.03], threshold=0.05, alternative="less")
    assert const.pvalue == 0.0 and const.statistic == -math.inf and const.sd == 0.0
    assert (const.ci_low, const.ci_high) == (0.03, 0.03)
    assert one_sided_mean_test([0.03, 0.03], threshold=0.05, alternative="greater").pvalue == 1.0
    assert one_sided_mean_test([0.05, 0.05], threshold=0.05, alternative="less").pvalue == 1.0
    single = one_sided_mean_test([0.01], threshold=0.05, alternative="less")
    assert single.pvalue == 1.0 and single.n == 1 and math.isnan(single.sd)
    assert (single.ci_low, single.ci_high) == (-math.inf, math.inf)
    with pytest.raises(ValueError):
        one_sided_mean_test([], threshold=0.05, alternative="less")
    with pytest.raises(ValueError):
        one_sided_mean_test([0.1, float("nan")], threshold=0.05, alternative="less")


# ---------------------------------------------------------------------------------------------
# Bootstrap
# ---------------------------------------------------------------------------------------------


def test_bootstrap_ci_contains_mean_and_is_reproducible() -> None:
    values = np.random.default_rng(1).exponential(1.0, size=80)
    low, high = bootstrap_ci(values, rng=np.random.default_rng(2))
    assert low < values.mean() < high
    assert (low, high) == bootstrap_ci(values, rng=np.random.default_rng(2))
    # roughly the normal-theory interval
    se = values.std(ddof=1) / math.sqrt(values.size)
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.25)
    med_low, med_high = bootstrap_ci(values, statistic=np.median, rng=np.random.default_rng(2), n_resamples=500)
    assert med_low < float(np.median(values)) < med_high


def test_cluster_bootstrap_is_wider_for_correlated_clusters() -> None:
    rng = np.random.default_rng(3)
    prompts = np.repeat(np.arange(20), 10)
    values = rng.normal(0, 1, size=20)[prompts] + rng.normal(0, 0.1, size=prompts.size)
    iid = bootstrap_ci(values, rng=np.random.default_rng(4))
    clustered = bootstrap_ci(values, rng=np.random.default_rng(4), clusters=[f"p{p}" for p in prompts])
    # 20 effective observations instead of 200: about √10 ≈ 3× wider
    assert (clustered[1] - clustered[0]) > 2.0 * (iid[1] - iid[0])
    assert clustered[0] < values.mean() < clustered[1]
    with pytest.raises(ValueError, match="clusters"):
        bootstrap_ci(values, rng=rng, clusters=prompts[:-1])


# ---------------------------------------------------------------------------------------------
# Binomial tail test
# ---------------------------------------------------------------------------------------------


def test_binomial_tail_known_values() -> None:
    assert binomial_tail_test(1, 15, p0=1e-4) == pytest.approx(1 - (1 - 1e-4) ** 15, rel=1e-9)
    assert binomial_tail_test(0, 15, p0=1e-4) == 1.0
    assert binomial_tail_test(0, 0, p0=1e-4) == 1.0
    assert binomial_tail_test(15, 15, p0=0.5) == pytest.approx(0.5**15)
    # P(X ≥ 2), X ~ Bin(10, 0.1)
    assert binomial_tail_test(2, 10, p0=0.1) == pytest.approx(1 - 0.9**10 - 10 * 0.1 * 0.9**9)
    with pytest.raises(ValueError):
        binomial_tail_test(3, 2, p0=0.1)


# ---------------------------------------------------------------------------------------------
# Stratified permutation test
# ---------------------------------------------------------------------------------------------


def _strata_sample(rng: np.random.Generator, shift: float, n_strata: int = 25, per: int = 4) -> tuple[np.ndarray, ...]:
    """x and y with large stratum (prompt) effects; x shifted by ``shift``."""
    effects = rng.normal(0, 3, size=n_strata)
    strata = np.repeat(np.arange(n_strata), per)
    x = effects[strata] + rng.normal(shift, 1, size=strata.size)
    y = effects[strata] + rng.normal(0, 1, size=strata.size)
    return x, y, strata, strata.copy()


@pytest.mark.parametrize(("statistic", "alternative"), [("mean", "less"), ("tail_count", "greater")])
def test_stratified_permutation_null_size(
    statistic: Literal["mean", "tail_count"], alternative: Literal["less", "greater"]
) -> None:
    rejections = 0
    for seed in range(N_SEEDS):
        rng = np.random.default_rng(seed)
        x, y, sx, sy = _strata_sample(rng, shift=0.0)
        res = stratified_permutation_test(
            x,
            y,
            sx,
            sy,
            statistic=statistic,
            alternative=alternative,
            n_permutations=200,
            rng=rng,
        )
        assert 0 < res.pvalue <= 1
        rejections += res.pvalue <= ALPHA
    assert rejections / N_SEEDS <= 0.08


def test_stratified_permutation_power_under_clear_shift() -> None:
    rejections = 0
    for seed in range(N_SEEDS):
        rng = np.random.default_rng(10_000 + seed)
        x, y, sx, sy = _strata_sample(rng, shift=-0.6)
        res = stratified_permutation_test(x, y, sx, sy, statistic="mean", alternative="less", n_permutations=200, rng=rng)
        rejections += res.pvalue <= ALPHA
    assert rejections / N_SEEDS >= 0.9


def test_stratification_matters() -> None:
    """Big stratum effects swamp an unstratified comparison but not the within-stratum one."""
    rng = np.random.default_rng(5)
    x, y, sx, sy = _strata_sample(rng, shift=-0.6)
    stratified = stratified_permutation_test(x, y, sx, sy, statistic="mean", alternative="less", rng=rng)
    # x − y within stratum removes the stratum effects; a single stratum keeps them
    one = np.zeros(x.size, dtype=int)
    pooled = stratified_permutation_test(x, y, one, one, statistic="mean", alternative="less", rng=rng)
    assert stratified.statistic == pooled.statistic
    assert stratified.pvalue < 0.01 < pooled.pvalue


def test_permutations_stay_within_strata() -> None:
    strata_x = ["a", "a", "b", "c", "c", "c"]
    strata_y = ["a", "b", "b", "c"]
    code = {"a": 0.0, "b": 100.0, "c": 200.0}
    rng = np.random.default_rng(0)
    x = np.array([code[s] for s in strata_x]) + rng.random(len(strata_x))
    y = np.array([code[s] for s in strata_y]) + rng.random(len(strata_y))
    expected_x, expected_y = np.array([code[s] for s in strata_x]), np.array([code[s] for s in strata_y])
    seen: set[tuple[float, ...]] = set()

    def check(xp: np.ndarray, yp: np.ndarray) -> float:
        assert np.array_equal(np.floor(xp / 100) * 100, expected_x)
        assert np.array_equal(np.floor(yp / 100) * 100, expected_y)
        seen.add(tuple(xp))
        return float(xp.sum())

    res = stratified_permutation_test(
        x, y, strata_x, strata_y, statistic=check, alternative="two-sided", n_permutations=300, rng=rng
    )
    assert len(seen) > 10  # labels really were shuffled
    assert res.n_permutations == 300


def test_permutation_pvalue_matches_exact_enumeration() -> None:
    # one stratum, x = {1, 2}, y = {3, 4}: mean(x) − mean(y) = −2 is the smallest of C(4,2) = 6 splits
    res = stratified_permutation_test(
        [1.0, 2.0], [3.0, 4.0], [0, 0], [0, 0], statistic="mean", alternative="less", n_permutations=3000,
        rng=np.random.default_rng(0),
    )  # fmt: skip
    assert res.statistic == pytest.approx(-2.0)
    assert res.pvalue == pytest.approx(1 / 6, abs=0.03)
    assert res.pvalue >= 1 / 3001
    minimum = stratified_permutation_test(
        [1.0, 2.0], [3.0, 4.0], [0, 0], [0, 0], statistic="min", alternative="two-sided", n_permutations=3000,
        rng=np.random.default_rng(0),
    )  # fmt: skip
    # min(x) − min(y) over the 6 splits: −2, −1, −1, 1, 1, 2 → p_less = 1/6, two-sided doubles it
    assert minimum.statistic == pytest.approx(-2.0)
    assert minimum.pvalue == pytest.approx(1 / 3, abs=0.05)


def test_tail_count_catches_mixture_that_mean_dilutes() -> None:
    """A fifth of provider completions is far below everything else; per-completion scores are
    heavy-tailed upwards, so the mean shift drowns in the noise but the lower tail is clean."""
    rng = np.random.default_rng(11)
    n_strata, per = 10, 10
    strata = np.repeat(np.arange(n_strata), per)
    y = rng.lognormal(0.0, 2.0, size=strata.size)
    x = rng.lognormal(0.0, 2.0, size=strata.size)
    bad = np.arange(x.size) % 5 == 0  # exactly two per stratum
    x[bad] = -1.0 - rng.exponential(1.0, size=int(bad.sum()))
    mean = stratified_permutation_test(x, y, strata, strata, statistic="mean", alternative="less", n_permutations=2000, rng=rng)
    tail = stratified_permutation_test(
        x, y, strata, strata, statistic="tail_count", alternative="greater", n_permutations=2000, rng=rng, tail_quantile=0.1
    )
    assert tail.statistic == 20.0  # the 0.1 quantile of 20 values sits between the 2nd and 3rd smallest
    assert tail.pvalue < 0.001
    assert mean.pvalue > 0.1
