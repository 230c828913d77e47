"""Tests for ``quanthunt.distances``: the Hamming-kernel MMD test against a naive U-statistic and in
seeded simulations of size and power, and the top-k KL against exact values."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from quanthunt.distances import hamming_kernel_matrix, kl_topk_with_tail, mmd_hamming_test

ALPHA = 0.05
N_SEEDS = 200


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
