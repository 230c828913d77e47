"""Tests for ``quanthunt.stats``: known values, scipy cross-checks, and seeded simulations of size and power."""

from __future__ import annotations

import math
import time
from typing import Literal

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from quanthunt.stats import (
    EProcess,
    adjust,
    average_e_processes,
    benjamini_hochberg,
    betting_e_process,
    binomial_tail_test,
    bootstrap_ci,
    completions_for_e_tail,
    confidence_sequence,
    e_tail_power_curve,
    hamming_kernel_matrix,
    holm,
    kl_topk_with_tail,
    mmd_hamming_test,
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


# ---------------------------------------------------------------------------------------------
# MMD with a Hamming kernel
# ---------------------------------------------------------------------------------------------


def test_hamming_kernel_values() -> None:
    samples = [[1, 2, 3, 4], [1, 9, 3], [1, 2, 3, 4], [], [1, 2]]
    prompts = ["p", "p", "q", "p", "p"]
    k = hamming_kernel_matrix(samples, prompts)
    assert k[0, 0] == 4  # self-similarity is the length
    assert k[0, 1] == k[1, 0] == 2  # positions 0 and 2 match; the longer tail is ignored
    assert k[0, 2] == 0  # identical sequence, different prompt
    assert k[3].sum() == 0  # an empty completion matches nothing
    assert k[0, 4] == 2 and k[1, 4] == 1
    assert np.array_equal(k, k.T)


def _naive_mmd2(samples_x: list[list[int]], samples_y: list[list[int]], px: list[int], py: list[int]) -> float:
    def kern(a: tuple[int, list[int]], b: tuple[int, list[int]]) -> int:
        return 0 if a[0] != b[0] else sum(s == t for s, t in zip(a[1], b[1], strict=False))

    xs, ys = list(zip(px, samples_x, strict=True)), list(zip(py, samples_y, strict=True))
    n, m = len(xs), len(ys)
    kxx = sum(kern(a, b) for i, a in enumerate(xs) for j, b in enumerate(xs) if i != j) / (n * (n - 1))
    kyy = sum(kern(a, b) for i, a in enumerate(ys) for j, b in enumerate(ys) if i != j) / (m * (m - 1))
    kxy = sum(kern(a, b) for a in xs for b in ys) / (n * m)
    return kxx + kyy - 2 * kxy


def _token_samples(rng: np.random.Generator, probs: np.ndarray, prompts: np.ndarray, min_length: int = 6) -> list[list[int]]:
    """One sequence per prompt entry; token at position i drawn from ``probs[prompt, i]`` (inverse CDF)."""
    cdf = probs.cumsum(axis=2)[prompts]  # (samples, width, vocab)
    tokens = (rng.random(cdf.shape[:2])[:, :, None] > cdf).sum(axis=2)
    tokens = np.minimum(tokens, probs.shape[2] - 1)  # guard against cdf[-1] rounding below 1
    lengths = rng.integers(min_length, probs.shape[1] + 1, size=len(prompts))
    return [row[:length].tolist() for row, length in zip(tokens, lengths, strict=True)]


def test_mmd_statistic_matches_naive_u_statistic() -> None:
    rng = np.random.default_rng(2)
    px, py = [0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2]
    sx = [[int(t) for t in rng.integers(0, 3, size=rng.integers(0, 7))] for _ in px]
    sy = [[int(t) for t in rng.integers(0, 3, size=rng.integers(0, 7))] for _ in py]
    res = mmd_hamming_test(sx, sy, px, py, n_permutations=50, rng=rng)
    assert res.statistic == pytest.approx(_naive_mmd2(sx, sy, px, py), rel=1e-12, abs=1e-12)
    same = mmd_hamming_test(sx, sx, px, px, n_permutations=50, rng=rng)
    # identical samples: the U-statistic is below zero (the diagonal is excluded from the within terms only)
    assert same.statistic < 0
    with pytest.raises(ValueError):
        mmd_hamming_test(sx[:1], sy, px[:1], py, rng=rng)


def _mmd_rejection_rate(mix: float) -> float:
    """Share of seeds rejected at α; y's per-position distributions are ``(1 − mix) · p_x + mix · other``."""
    n_prompts, per, width, vocab = 25, 4, 12, 6
    prompts = np.repeat(np.arange(n_prompts), per)
    labels = [f"p{p}" for p in prompts]
    rejections = 0
    for seed in range(N_SEEDS):
        rng = np.random.default_rng(20_000 + seed)
        probs_x = rng.dirichlet(np.ones(vocab), size=(n_prompts, width))
        probs_y = (1 - mix) * probs_x + mix * rng.dirichlet(np.ones(vocab), size=(n_prompts, width))
        sx = _token_samples(rng, probs_x, prompts)
        sy = _token_samples(rng, probs_y, prompts)
        rejections += mmd_hamming_test(sx, sy, labels, labels, n_permutations=200, rng=rng).pvalue <= ALPHA
    return rejections / N_SEEDS


def test_mmd_null_size() -> None:
    assert _mmd_rejection_rate(mix=0.0) <= 0.08


def test_mmd_power_when_distributions_differ() -> None:
    # 25 prompts × 4 completions per side, positions 6–12 tokens, vocabulary 6
    assert _mmd_rejection_rate(mix=0.6) >= 0.9


def test_mmd_one_completion_per_side_per_prompt_is_uninformative() -> None:
    """Documented limitation: with one x and one y per prompt the statistic is permutation-invariant."""
    rng = np.random.default_rng(0)
    sx = [[1, 2, 3], [4, 5], [6]]
    sy = [[1, 2, 0], [0, 5], [7]]
    assert mmd_hamming_test(sx, sy, ["a", "b", "c"], ["a", "b", "c"], n_permutations=100, rng=rng).pvalue == 1.0


def test_mmd_is_fast() -> None:
    rng = np.random.default_rng(0)
    prompts = np.repeat(np.arange(50), 5)
    sx = [[int(t) for t in rng.integers(0, 50, size=rng.integers(20, 64))] for _ in prompts]
    sy = [[int(t) for t in rng.integers(0, 50, size=rng.integers(20, 64))] for _ in prompts]
    start = time.perf_counter()
    res = mmd_hamming_test(sx, sy, prompts, prompts, n_permutations=1000, rng=rng)
    elapsed = time.perf_counter() - start
    assert res.n_permutations == 1000
    assert elapsed < 2.0  # typically ~0.1 s; generous for slow CI machines


# ---------------------------------------------------------------------------------------------
# KL over top-k with a tail bucket
# ---------------------------------------------------------------------------------------------


def test_kl_zero_for_identical_and_positive_otherwise() -> None:
    top = {"a": math.log(0.6), "b": math.log(0.3), "c": math.log(0.05)}
    assert kl_topk_with_tail(top, dict(top)) == 0.0
    other = {"a": math.log(0.3), "b": math.log(0.6), "c": math.log(0.05)}
    assert kl_topk_with_tail(top, other) > 0.1
    # each side's unlisted token gets min(smallest listed, leftover): c and d swap 0.09 ↔ 0.01
    top3 = {"a": math.log(0.6), "b": math.log(0.3), "c": math.log(0.09)}
    disjoint = {"a": math.log(0.6), "b": math.log(0.3), "d": math.log(0.09)}
    swapped = 0.09 * math.log(0.09 / 0.01) + 0.01 * math.log(0.01 / 0.09)
    assert kl_topk_with_tail(top3, disjoint) == pytest.approx(swapped, rel=1e-6)
    # exactly computable case: both sides list the same two tokens, the rest is one tail bucket
    p2 = {1: math.log(0.5), 2: math.log(0.3)}
    q2 = {1: math.log(0.4), 2: math.log(0.4)}
    exact = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert kl_topk_with_tail(p2, q2) == pytest.approx(exact)
    with pytest.raises(ValueError):
        kl_topk_with_tail({}, top)


def test_kl_close_to_exact_when_topk_covers_the_mass() -> None:
    rng = np.random.default_rng(0)
    vocab, k = 1000, 20
    logits_p = -0.6 * rng.permutation(vocab).astype(float)  # geometric decay: top-20 holds all but ~1e-5
    logits_q = logits_p + rng.normal(0, 0.4, size=vocab)
    p = np.exp(logits_p - np.logaddexp.reduce(logits_p))
    q = np.exp(logits_q - np.logaddexp.reduce(logits_q))
    exact = float(np.sum(p * np.log(p / q)))
    top_p = {int(t): float(np.log(p[t])) for t in np.argsort(p)[::-1][:k]}
    top_q = {int(t): float(np.log(q[t])) for t in np.argsort(q)[::-1][:k]}
    approx = kl_topk_with_tail(top_p, top_q)
    assert exact > 0.01
    assert approx == pytest.approx(exact, rel=0.02, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Testing by betting
# ---------------------------------------------------------------------------------------------


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
