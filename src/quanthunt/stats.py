"""Statistics for precision verification: is a provider serving the model it claims?

Design
------
Every function here is pure: arrays or sequences in, a float, a list or a small frozen
dataclass out. There is no I/O and no global random state; every random procedure takes a
``numpy.random.Generator`` so that a seed reproduces a result exactly. scipy provides the
distributions (``binomtest``, ``t``, ``nct``, ``binom``); this module only wires them to the
questions the verification asks.

The questions, and the tools for each:

* **Logprob mode** (the provider returns logprobs; the reference scores the same tokens
  teacher-forced). Per token ``d_t = provider_logprob − reference_logprob``; per completion an
  aggregate such as mean ``|d_t|``. A faithful provider on other hardware is *not* identical to
  the reference (bf16 ≈ 0.03 mean ``|d|``), so "identical" is never the null hypothesis.
  Instead :func:`one_sided_mean_test` tests the mean against a tolerance margin
  (``alternative="less"``: evidence that the mean is *below* the margin, an equivalence-style
  test; ``alternative="greater"``: evidence that it is *above*). A provider that serves only a
  share of requests at lower precision hardly moves the mean but produces a few extreme
  completions, so :func:`binomial_tail_test` counts completions above a strict threshold and
  compares that count with a tiny allowed false-flag rate ``p0``.
  :func:`kl_topk_with_tail` compares the two sides' top-k next-token distributions.
* **Sample mode** (no logprobs). Provider and reference each sample several completions per
  prompt and the reference scores all of them. :func:`stratified_permutation_test` compares the
  scores within prompt (prompt = stratum), with a mean, a minimum or a tail-count statistic (the
  tail count does not dilute a mixture), and :func:`mmd_hamming_test` is the kernel two-sample
  test on the token sequences themselves (Gao, Liang & Guestrin, "Model Equality Testing: Which
  Model Is This API Serving?", ICLR 2025).
* **Several providers** at once: :func:`holm` (family-wise error) or
  :func:`benjamini_hochberg` (false discovery rate), both via :func:`adjust`.
* **Sequential, anytime-valid tests** (what the verify stage decides with): testing by
  betting (:func:`betting_e_process`, averaged with :func:`average_e_processes`; the
  generate stage's monitor continues the same bets one observation at a time with
  :func:`log_bet_factors`), whose error rate holds however often the data are looked at;
  :func:`confidence_sequence` for the matching bounds; e-BH across providers is
  :func:`benjamini_hochberg` on ``1 / e``; and :func:`e_tail_power_curve` /
  :func:`completions_for_e_tail`, the exact power of the sequential tail test against a
  mixture. The fixed-sample tests above are kept as reported baselines.
* **Intervals**: :func:`bootstrap_ci` (optionally resampling whole prompts) on any statistic.

Conventions: p-values are never NaN (degenerate inputs get a documented 0 or 1); invalid input
(empty data, NaN, out-of-range probabilities, mismatched lengths) raises ``ValueError``.
Permutation p-values use the ``(b + 1) / (m + 1)`` correction, so they are never 0 and the
test is exact (size ≤ α) under exchangeability.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsFloat, TypeVar

import numpy as np
import numpy.typing as npt
from numpy.typing import NDArray
from scipy import stats as _sps

__all__ = [
    "BET_FRACTIONS",
    "EProcess",
    "MeanTest",
    "PermutationTest",
    "adjust",
    "average_e_processes",
    "benjamini_hochberg",
    "betting_e_process",
    "binomial_tail_test",
    "bootstrap_ci",
    "completions_for_e_tail",
    "confidence_sequence",
    "e_tail_power_curve",
    "hamming_kernel_matrix",
    "holm",
    "kl_topk_with_tail",
    "log_bet_factors",
    "mmd_hamming_test",
    "one_sided_mean_test",
    "stratified_permutation_test",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
Labels = Sequence[Hashable] | NDArray[Any]
"""Stratum / prompt labels: any hashable values (str, int, numpy scalars)."""

Alternative = Literal["less", "greater", "two-sided"]
PermutationStatistic = Literal["mean", "min", "tail_count"] | Callable[[FloatArray, FloatArray], SupportsFloat]

TokenT = TypeVar("TokenT", str, int)
"""Token keys of a top-logprob dict: token strings or token ids (both dicts use the same kind)."""

PROB_FLOOR = 1e-12
"""Smallest probability :func:`kl_topk_with_tail` uses (clipping floor and tail-bucket floor)."""

_BATCH_CELLS = 1 << 22  # permutation batches hold at most this many indices at once (~32 MiB of int64)


# --------------------------------------------------------------------------------------------
# Multiple testing
# --------------------------------------------------------------------------------------------


def _check_pvalues(pvalues: Sequence[float]) -> FloatArray:
    p = np.asarray(pvalues, dtype=np.float64).reshape(-1)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p-values must lie in [0, 1] and not be NaN, got {list(pvalues)!r}")
    return p


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni step-down adjusted p-values (family-wise error control), in input order.

    With the ascending order ``p_(1) ≤ … ≤ p_(m)``, ``adj_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j))``.
    Reject hypothesis ``i`` at level α iff ``adj_i ≤ α``. The result is monotone in the raw
    p-values, never below them, and capped at 1. An empty input gives ``[]``.

    Usage: ``holm([0.01, 0.04, 0.03, 0.005])  # -> [0.03, 0.06, 0.06, 0.02]``
    """
    p = _check_pvalues(pvalues)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return [float(v) for v in adjusted]


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini–Hochberg step-up adjusted p-values (false-discovery-rate control), in input order.

    With the ascending order ``p_(1) ≤ … ≤ p_(m)``, ``adj_(i) = min_{j ≥ i} min(1, m p_(j) / j)``.
    Rejecting every hypothesis with ``adj_i ≤ q`` controls the FDR at ``q`` (independent or
    positively dependent tests). Monotone, never below the raw p-values, capped at 1.

    Usage: ``benjamini_hochberg([0.01, 0.04, 0.03, 0.005])  # -> [0.02, 0.04, 0.04, 0.02]``
    """
    p = _check_pvalues(pvalues)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, p[order] * m / np.arange(1, m + 1))
    adjusted = np.empty(m)
    adjusted[order] = np.minimum.accumulate(scaled[::-1])[::-1]
    return [float(v) for v in adjusted]


def adjust(pvalues: Sequence[float], method: Literal["holm", "bh"]) -> list[float]:
    """Adjust p-values for multiple testing: ``"holm"`` (FWER) or ``"bh"`` (Benjamini–Hochberg FDR).

    Usage: ``adjust(pvalues_per_provider, "holm")``
    """
    if method == "holm":
        return holm(pvalues)
    if method == "bh":
        return benjamini_hochberg(pvalues)
    raise ValueError(f"unknown adjustment method {method!r}; expected 'holm' or 'bh'")


# --------------------------------------------------------------------------------------------
# One-sample t-test against a margin
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeanTest:
    """Result of :func:`one_sided_mean_test`.

    ``statistic`` is the t statistic ``(mean − threshold) / (sd / √n)`` (±inf for zero variance,
    NaN when ``n < 2``); ``sd`` is the sample standard deviation (ddof = 1; NaN when ``n < 2``);
    ``ci_low``/``ci_high`` is the two-sided ``confidence`` interval for the mean (whatever the
    alternative).
    """

    statistic: float
    pvalue: float
    mean: float
    sd: float
    n: int
    ci_low: float
    ci_high: float
    threshold: float
    alternative: Literal["less", "greater"]
    confidence: float = 0.95


def _as_finite_1d(values: npt.ArrayLike, name: str) -> FloatArray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return arr


def _check_unit_open(value: float, name: str) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")


def one_sided_mean_test(
    values: npt.ArrayLike,
    *,
    threshold: float,
    alternative: Literal["less", "greater"],
    confidence: float = 0.95,
) -> MeanTest:
    """One-sample one-sided t-test of the mean against a margin.

    ``alternative="less"``: H0 mean ≥ threshold vs H1 mean < threshold — a small p-value is
    evidence that the mean is *below* the margin (equivalence-style: "the provider is within
    tolerance"). ``alternative="greater"``: H0 mean ≤ threshold vs H1 mean > threshold — a small
    p-value is evidence that the mean *exceeds* the margin. The p-value equals
    ``scipy.stats.ttest_1samp(values, threshold, alternative=...)``.

    Degenerate cases (never a NaN p-value):

    * ``n == 0`` raises ``ValueError``; non-finite values raise ``ValueError``.
    * ``n == 1``: no variance estimate, so no evidence: ``pvalue = 1``, ``statistic = sd = NaN``,
      CI ``(-inf, inf)``.
    * zero variance (all values equal, ``n ≥ 2``): the mean is known exactly, so ``pvalue = 0``
      when it lies strictly on the alternative's side of the threshold and ``1`` otherwise;
      ``statistic = ±inf`` (0 if mean == threshold); CI ``(mean, mean)``.

    Usage: ``one_sided_mean_test(mean_abs_d, threshold=0.05, alternative="less").pvalue``
    """
    if alternative not in ("less", "greater"):
        raise ValueError(f"alternative must be 'less' or 'greater', got {alternative!r}")
    _check_unit_open(confidence, "confidence")
    x = _as_finite_1d(values, "values")
    n = int(x.size)
    if n == 0:
        raise ValueError("one_sided_mean_test needs at least one value")
    mean = float(x.mean())
    if n == 1:
        return MeanTest(math.nan, 1.0, mean, math.nan, 1, -math.inf, math.inf, threshold, alternative, confidence)
    sd = float(x.std(ddof=1))
    if float(np.ptp(x)) == 0.0:
        diff = mean - threshold
        statistic = 0.0 if diff == 0 else math.copysign(math.inf, diff)
        on_alternative_side = diff < 0 if alternative == "less" else diff > 0
        pvalue = 0.0 if on_alternative_side else 1.0
        return MeanTest(statistic, pvalue, mean, 0.0, n, mean, mean, threshold, alternative, confidence)
    df = n - 1
    se = sd / math.sqrt(n)
    statistic = (mean - threshold) / se
    pvalue = float(_sps.t.cdf(statistic, df) if alternative == "less" else _sps.t.sf(statistic, df))
    half_width = float(_sps.t.ppf(0.5 + confidence / 2, df)) * se
    return MeanTest(statistic, pvalue, mean, sd, n, mean - half_width, mean + half_width, threshold, alternative, confidence)


# --------------------------------------------------------------------------------------------
# Bootstrap
# --------------------------------------------------------------------------------------------


def _label_list(labels: Labels) -> list[Hashable]:
    """Labels as plain Python values (numpy arrays via ``tolist`` so numpy scalars hash like Python ones)."""
    return labels.tolist() if isinstance(labels, np.ndarray) else list(labels)


def _codes(labels: Labels, name: str) -> tuple[IntArray, int]:
    """Map arbitrary hashable labels to integer codes 0..k-1 (first-appearance order)."""
    items = _label_list(labels)
    index: dict[Hashable, int] = {}
    codes = np.empty(len(items), dtype=np.int64)
    for i, label in enumerate(items):
        try:
            codes[i] = index.setdefault(label, len(index))
        except TypeError as exc:
            raise ValueError(f"{name} labels must be hashable, got {label!r}") from exc
    return codes, len(index)


def bootstrap_ci(
    values: npt.ArrayLike,
    *,
    statistic: Callable[[FloatArray], SupportsFloat] = np.mean,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    rng: np.random.Generator,
    clusters: Labels | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval ``(low, high)`` for ``statistic(values)``.

    Without ``clusters`` each resample draws ``len(values)`` values with replacement. With
    ``clusters`` (one label per value, e.g. the prompt id) each resample draws as many *clusters*
    as there are, with replacement, and concatenates all their values — the right interval when
    values within a prompt are correlated (resample sizes then vary with cluster sizes). The
    interval is the ``(1 ± confidence)/2`` quantiles (numpy's default linear interpolation) of
    the resampled statistics.

    Usage: ``bootstrap_ci(scores, rng=np.random.default_rng(0), clusters=prompt_ids)``
    """
    _check_unit_open(confidence, "confidence")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be ≥ 1, got {n_resamples}")
    x = _as_finite_1d(values, "values")
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if clusters is None:
        codes, k = np.arange(x.size), x.size
    else:
        codes, k = _codes(clusters, "clusters")
        if codes.size != x.size:
            raise ValueError(f"clusters has {codes.size} labels for {x.size} values")
    picks = rng.integers(0, k, size=(n_resamples, k))
    if statistic is np.mean:
        # The mean of a resample is (Σ picked clusters' sums) / (Σ their sizes): one matrix
        # product instead of n_resamples concatenations (the verify stage runs thousands).
        counts = np.zeros((n_resamples, k))
        np.add.at(counts, (np.repeat(np.arange(n_resamples), k), picks.ravel()), 1.0)
        resampled = (counts @ np.bincount(codes, weights=x, minlength=k)) / (counts @ np.bincount(codes, minlength=k))
    else:
        order = np.argsort(codes, kind="stable")
        members = np.split(order, np.cumsum(np.bincount(codes, minlength=k))[:-1])
        resampled = np.array([float(statistic(x[np.concatenate([members[c] for c in row])])) for row in picks])
    low, high = np.quantile(resampled, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


# --------------------------------------------------------------------------------------------
# Binomial tail test
# --------------------------------------------------------------------------------------------


def binomial_tail_test(flagged: int, n: int, *, p0: float) -> float:
    """p-value of H0 "flag rate ≤ p0" vs H1 "flag rate > p0", given ``flagged`` of ``n`` completions.

    Exact binomial test (``scipy.stats.binomtest(..., alternative="greater")``), i.e.
    ``P(X ≥ flagged)`` for ``X ~ Binomial(n, p0)``. ``n == 0`` gives 1 (no evidence).

    Usage: ``binomial_tail_test(1, 15, p0=1e-4)  # ≈ 1 − (1 − 1e-4)**15``
    """
    if n < 0 or not 0 <= flagged <= n:
        raise ValueError(f"need 0 ≤ flagged ≤ n, got flagged={flagged}, n={n}")
    if not 0.0 <= p0 <= 1.0:
        raise ValueError(f"p0 must lie in [0, 1], got {p0!r}")
    if n == 0:
        return 1.0
    return float(_sps.binomtest(int(flagged), int(n), p0, alternative="greater").pvalue)


# --------------------------------------------------------------------------------------------
# Permutation tests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PermutationTest:
    """Result of a permutation test: observed ``statistic``, ``pvalue`` with the +1 correction."""

    statistic: float
    pvalue: float
    n_permutations: int


def _permutation_pvalue(null: FloatArray, observed: float, alternative: Alternative, tol: float) -> float:
    """``(b + 1) / (m + 1)``; two-sided is ``min(1, 2 · min(p_less, p_greater))``.

    ``tol`` absorbs floating-point noise (a permutation that reproduces the observed statistic up
    to rounding counts as "at least as extreme"), which can only make the test more conservative.
    """
    m = null.size
    p_greater = (int(np.count_nonzero(null >= observed - tol)) + 1) / (m + 1)
    p_less = (int(np.count_nonzero(null <= observed + tol)) + 1) / (m + 1)
    if alternative == "greater":
        return p_greater
    if alternative == "less":
        return p_less
    return min(1.0, 2.0 * min(p_less, p_greater))


def _within_stratum_permutations(codes: IntArray, m: int, rng: np.random.Generator) -> IntArray:
    """``m`` index permutations (rows) of ``0..N-1`` that only move indices within their stratum.

    Sorting ``code + U(0, 1)`` groups indices by stratum in a uniformly random order within each
    stratum; assigning that order onto the stratum-sorted positions permutes within strata.
    """
    base = np.argsort(codes, kind="stable")
    keys = codes.astype(np.float64)[None, :] + rng.random((m, codes.size))
    perms = np.empty((m, codes.size), dtype=np.int64)
    perms[:, base] = np.argsort(keys, axis=1)
    return perms


def stratified_permutation_test(
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    strata_x: Labels,
    strata_y: Labels,
    *,
    statistic: PermutationStatistic,
    alternative: Alternative,
    n_permutations: int = 2000,
    rng: np.random.Generator,
    tail_quantile: float = 0.1,
) -> PermutationTest:
    """Two-sample permutation test of provider values ``x`` against reference values ``y``,
    permuting the x/y labels only within each stratum (prompt).

    Statistics (all computed on the whole sample, strata pooled):

    * ``"mean"``: ``mean(x) − mean(y)``, each mean over all of its values (so strata are weighted
      by their counts). Within-stratum permutation keeps every stratum's x and y counts, so the
      test stays valid when counts differ between strata, even with large stratum effects.
    * ``"min"``: ``min(x) − min(y)``.
    * ``"tail_count"``: the number of x values strictly below the ``tail_quantile`` quantile
      (numpy's linear interpolation) of the pooled x+y values of their own stratum. The
      thresholds do not change under permutation. With ``n_s`` pooled values in a stratum about
      ``tail_quantile · n_s`` of them are below (at least one once ``tail_quantile · (n_s − 1) > 0``;
      with 8 values and 0.1 only the stratum minimum). This counts *low* values: use
      ``alternative="greater"`` for "x is over-represented in the lower tail". Unlike the mean
      it does not dilute a mixture in which a share of x values is far out.
    * a callable ``f(x_values, y_values) -> float``: called with the permuted arrays. The
      per-position stratum labels never change (``strata_x``/``strata_y`` stay valid for the
      permuted arrays), so ``f`` may close over them.

    ``alternative`` refers to the statistic: ``"greater"`` means it is larger than under
    exchangeability. ``"two-sided"`` is ``min(1, 2 · min(p_less, p_greater))``. The p-value is
    ``(b + 1) / (m + 1)`` with ``b`` the number of permutations at least as extreme as observed.
    Strata with values from one side only contribute fixed terms.

    Usage: ``stratified_permutation_test(px, rx, pid_x, pid_y, statistic="mean", alternative="less", rng=rng)``
    """
    if alternative not in ("less", "greater", "two-sided"):
        raise ValueError(f"alternative must be 'less', 'greater' or 'two-sided', got {alternative!r}")
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be ≥ 1, got {n_permutations}")
    xa = _as_finite_1d(x, "x")
    ya = _as_finite_1d(y, "y")
    if xa.size == 0 or ya.size == 0:
        raise ValueError("both x and y need at least one value")
    codes, k = _codes([*_label_list(strata_x), *_label_list(strata_y)], "strata")
    if codes.size != xa.size + ya.size:
        raise ValueError(f"strata labels ({codes.size}) must match values ({xa.size} + {ya.size})")
    z = np.concatenate([xa, ya])
    nx = xa.size

    stat_fn: Callable[[IntArray], FloatArray]
    tol: float
    scale = float(np.max(np.abs(z)))
    if callable(statistic):
        user_fn = statistic

        def stat_fn(perms: IntArray) -> FloatArray:
            return np.array([float(user_fn(z[p[:nx]], z[p[nx:]])) for p in perms])

        tol = -1.0  # set relative to the observed value below
    elif statistic == "mean":

        def stat_fn(perms: IntArray) -> FloatArray:
            values = z[perms]
            return np.asarray(values[:, :nx].mean(axis=1) - values[:, nx:].mean(axis=1), dtype=np.float64)

        tol = 1e-9 * scale
    elif statistic == "min":

        def stat_fn(perms: IntArray) -> FloatArray:
            values = z[perms]
            return np.asarray(values[:, :nx].min(axis=1) - values[:, nx:].min(axis=1), dtype=np.float64)

        tol = 0.0
    elif statistic == "tail_count":
        _check_unit_open(tail_quantile, "tail_quantile")
        thresholds = np.empty(k)
        for c in range(k):
            thresholds[c] = np.quantile(z[codes == c], tail_quantile)
        below = z < thresholds[codes]

        def stat_fn(perms: IntArray) -> FloatArray:
            return np.asarray(below[perms[:, :nx]].sum(axis=1), dtype=np.float64)

        tol = 0.0
    else:
        raise ValueError(f"unknown statistic {statistic!r}; expected 'mean', 'min', 'tail_count' or a callable")

    observed = float(stat_fn(np.arange(z.size, dtype=np.int64)[None, :])[0])
    if not math.isfinite(observed):
        raise ValueError(f"the statistic is not finite on the observed data ({observed})")
    if tol < 0:
        tol = 1e-9 * abs(observed)
    batch = max(1, _BATCH_CELLS // z.size)
    null_parts = []
    for start in range(0, n_permutations, batch):
        perms = _within_stratum_permutations(codes, min(batch, n_permutations - start), rng)
        null_parts.append(stat_fn(perms))
    null = np.concatenate(null_parts)
    return PermutationTest(observed, _permutation_pvalue(null, observed, alternative, tol), n_permutations)


# --------------------------------------------------------------------------------------------
# MMD with a Hamming kernel (Gao, Liang & Guestrin, ICLR 2025)
# --------------------------------------------------------------------------------------------


def _hamming_block(seqs: Sequence[Sequence[int]]) -> FloatArray:
    """Position-wise match counts ``K[a, b] = #{i < min(len_a, len_b): s_a[i] == s_b[i]}``."""
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    width = int(lengths.max()) if n else 0
    tokens = np.full((n, width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            tokens[i, : len(s)] = np.asarray(s, dtype=np.int64)
    if (tokens[np.arange(width)[None, :] < lengths[:, None]] < 0).any():
        raise ValueError("token ids must be non-negative integers")
    # Padding is -1 and real tokens are ≥ 0, so a pad never matches a token; pad–pad matches are
    # removed by requiring position i to be valid in the first sequence.
    valid = np.arange(width)[None, :] < lengths[:, None]
    kernel = np.zeros((n, n))
    chunk = max(1, (1 << 24) // max(1, n * n))
    for start in range(0, width, chunk):
        sl = slice(start, start + chunk)
        eq = (tokens[:, None, sl] == tokens[None, :, sl]) & valid[:, None, sl]
        kernel += eq.sum(axis=2)
    return kernel


def _prompt_blocks(samples: Sequence[Sequence[int]], prompts: Labels) -> tuple[list[IntArray], list[FloatArray]]:
    codes, k = _codes(prompts, "prompts")
    if codes.size != len(samples):
        raise ValueError(f"{codes.size} prompt labels for {len(samples)} samples")
    members = [np.flatnonzero(codes == c) for c in range(k)]
    return members, [_hamming_block([samples[int(i)] for i in idx]) for idx in members]


def hamming_kernel_matrix(samples: Sequence[Sequence[int]], prompts: Labels) -> FloatArray:
    """The full kernel matrix :func:`mmd_hamming_test` uses, for inspection.

    ``K[a, b] = 0`` if the prompts differ, else the number of positions ``i < min(len_a, len_b)``
    with equal token ids (longer tails are ignored).

    Usage: ``hamming_kernel_matrix([[1, 2, 3], [1, 5]], ["p", "p"])  # -> [[3, 1], [1, 2]]``
    """
    members, blocks = _prompt_blocks(samples, prompts)
    kernel = np.zeros((len(samples), len(samples)))
    for idx, block in zip(members, blocks, strict=True):
        kernel[np.ix_(idx, idx)] = block
    return kernel


def mmd_hamming_test(
    samples_x: Sequence[Sequence[int]],
    samples_y: Sequence[Sequence[int]],
    prompts_x: Labels,
    prompts_y: Labels,
    *,
    n_permutations: int = 1000,
    rng: np.random.Generator,
) -> PermutationTest:
    """MMD two-sample test with a Hamming kernel on (prompt, completion) pairs (Gao et al., ICLR 2025).

    Kernel: ``k((a, s), (b, t)) = 1[a == b] · #{i < min(len s, len t): s[i] == t[i]}`` — token-id
    sequences are compared position by position and the longer sequence's tail is ignored (the
    paper pads to a fixed length instead, which also counts agreement on where completions end;
    here a length difference only shows up through fewer comparable positions). The statistic is
    the unbiased U-statistic

        MMD²_u = Σ_{i≠j∈X} k / (n(n−1)) + Σ_{i≠j∈Y} k / (m(m−1)) − 2 Σ_{i∈X, j∈Y} k / (nm),

    in units of matching positions. The kernel is computed once (one block per prompt; entries
    across prompts are zero); each permutation reshuffles the x/y labels *within* each prompt,
    keeping per-prompt counts, so the test is valid when prompts are sampled unequally. One-sided
    (large MMD² = different distributions); p-value ``(b + 1) / (m + 1)``. Needs ≥ 2 samples per side.

    Power comes only from prompts with several completions on at least one side: because the kernel
    is zero across prompts, a design with exactly one x and one y completion per prompt leaves the
    statistic permutation-invariant (p = 1). Sample several completions per prompt (sample mode).

    Usage: ``mmd_hamming_test(provider_ids, reference_ids, provider_prompts, reference_prompts, rng=rng).pvalue``
    """
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be ≥ 1, got {n_permutations}")
    n, m = len(samples_x), len(samples_y)
    if n < 2 or m < 2:
        raise ValueError(f"mmd_hamming_test needs at least 2 samples per side, got {n} and {m}")
    if len(prompts_x) != n or len(prompts_y) != m:
        raise ValueError("prompts_x / prompts_y must have one label per sample")
    members, blocks = _prompt_blocks([*samples_x, *samples_y], [*_label_list(prompts_x), *_label_list(prompts_y)])
    for block in blocks:
        np.fill_diagonal(block, 0.0)
    rowsums = [block.sum(axis=1) for block in blocks]
    total = float(sum(r.sum() for r in rowsums))

    def mmd2(labels: Sequence[FloatArray]) -> FloatArray:
        """MMD²_u for a batch of label matrices (one (rows, n_b) 0/1 matrix per prompt block)."""
        sxx = sum((((lab @ block) * lab).sum(axis=1) for lab, block in zip(labels, blocks, strict=True)), np.zeros(1))
        lr = sum((lab @ r for lab, r in zip(labels, rowsums, strict=True)), np.zeros(1))
        sxy = lr - sxx
        syy = total - sxx - 2.0 * sxy
        return np.asarray(sxx / (n * (n - 1)) + syy / (m * (m - 1)) - 2.0 * sxy / (n * m), dtype=np.float64)

    observed_labels = [(idx < n).astype(np.float64)[None, :] for idx in members]
    observed = float(mmd2(observed_labels)[0])
    null_parts = []
    n_total = n + m
    batch = max(1, _BATCH_CELLS // n_total)
    for start in range(0, n_permutations, batch):
        rows = min(batch, n_permutations - start)
        labels = []
        for obs in observed_labels:
            size, n_x = obs.shape[1], int(obs.sum())
            if n_x in (0, size):
                labels.append(np.repeat(obs, rows, axis=0))
                continue
            lab = np.zeros((rows, size))
            np.put_along_axis(lab, np.argsort(rng.random((rows, size)), axis=1)[:, :n_x], 1.0, axis=1)
            labels.append(lab)
        null_parts.append(mmd2(labels))
    null = np.concatenate(null_parts)
    tol = 1e-9 * max(1.0, abs(observed))
    return PermutationTest(observed, _permutation_pvalue(null, observed, "greater", tol), n_permutations)


# --------------------------------------------------------------------------------------------
# KL divergence between top-k logprob distributions
# --------------------------------------------------------------------------------------------


def _fill_distribution(top: Mapping[TokenT, float], union: list[TokenT], name: str) -> FloatArray:
    """One side on ``union`` + tail bucket: filled, floored, clipped and renormalised (see :func:`kl_topk_with_tail`)."""
    if not top:
        raise ValueError(f"{name} must list at least one token")
    listed = np.array([math.exp(lp) for lp in top.values()])
    if np.isnan(listed).any():
        raise ValueError(f"{name} contains NaN logprobs")
    missing = [tok for tok in union if tok not in top]
    fill = 0.0
    if missing:
        leftover = max(0.0, 1.0 - float(listed.sum()))
        fill = min(float(listed.min()), leftover / len(missing))
    probs = np.array([math.exp(top[tok]) if tok in top else fill for tok in union])
    tail = max(PROB_FLOOR, 1.0 - float(probs.sum()))
    full = np.clip(np.append(probs, tail), PROB_FLOOR, None)
    return np.asarray(full / full.sum(), dtype=np.float64)


def kl_topk_with_tail(p_top: Mapping[TokenT, float], q_top: Mapping[TokenT, float]) -> float:
    """Approximate KL(P‖Q) in nats from two top-k logprob dicts (token → logprob).

    Approximation: both distributions are placed on the union of listed tokens plus one "tail"
    bucket for everything else.

    * A token in the union that a side did not list gets, on that side, ``min(smallest listed
      probability, leftover / #missing)`` where ``leftover = max(0, 1 − Σ listed)`` — it cannot
      be likelier than anything in that side's top-k, and the unlisted tokens share the leftover.
    * The tail bucket is ``max(1e-12, 1 − Σ union)``; every probability is clipped at 1e-12 and
      each side is then renormalised to sum to 1 (which only matters when the listed logprobs
      round to more than 1).

    Identical dicts give exactly 0; the error vanishes as the top-k covers the mass (the tail
    bucket merges the unlisted tokens, which can only lower the KL — data processing).

    Usage: ``kl_topk_with_tail(provider_top_logprobs[t], reference_top_logprobs[t])``
    """
    union: list[TokenT] = list(p_top) + [tok for tok in q_top if tok not in p_top]
    p = _fill_distribution(p_top, union, "p_top")
    q = _fill_distribution(q_top, union, "q_top")
    return max(0.0, float(np.sum(p * (np.log(p) - np.log(q)))))


# --------------------------------------------------------------------------------------------
# Anytime-valid tests: testing by betting
# --------------------------------------------------------------------------------------------

BET_FRACTIONS = (0.9, 0.5, 0.25, 0.125, 0.0625, 0.03125)
"""The bets an e-process spreads its wealth over, as fractions of the largest bet that cannot
lose everything on one observation (a "diversified Kelly" mixture, Waudby-Smith & Ramdas
2024 §5.5): large fractions win fast against a large effect, small ones win surely against a
small one, and the mixture pays at most ``log 6`` nats for not knowing which."""


@dataclass(frozen=True)
class EProcess:
    """Wealth of a test by betting after each observation (result of :func:`betting_e_process`).

    Under the null the wealth is a nonnegative supermartingale that starts at 1, so by Ville's
    inequality ``P(wealth ever reaches 1/α) ≤ α``: the test may be looked at after every
    observation and stopped at any time, for any reason, without inflating its error rate.
    """

    wealth: FloatArray
    """``K_t`` for t = 1..n (``K_0 = 1`` is implicit)."""

    @property
    def n(self) -> int:
        return int(self.wealth.size)

    @property
    def final(self) -> float:
        """``K_n``: an e-value at any stopping time (what e-BH needs)."""
        return float(self.wealth[-1]) if self.wealth.size else 1.0

    @property
    def peak(self) -> float:
        """``max(1, max_t K_t)``."""
        return max(1.0, float(self.wealth.max())) if self.wealth.size else 1.0

    @property
    def pvalue(self) -> float:
        """The anytime-valid p-value ``min(1, 1 / max_t K_t)``: ``P(it ever falls to α) ≤ α``."""
        return 1.0 / self.peak


def _check_bounded(values: npt.ArrayLike) -> FloatArray:
    x = _as_finite_1d(values, "observations")
    if ((x < 0) | (x > 1)).any():
        raise ValueError("betting observations must lie in [0, 1] (scale and clip them first)")
    return x


WEALTH_CAP = 1e300
"""Wealth is capped here (far beyond any threshold) instead of overflowing to infinity."""


def log_bet_factors(
    x: FloatArray, null_means: FloatArray, alternative: Literal["greater", "less"], fractions: Sequence[float]
) -> FloatArray:
    """``log`` of what each constant bet multiplies its wealth by, per observation: shape
    (fractions, null means, observations). ``"greater"``: the bet ``λ = f / m0`` multiplies the
    wealth by ``1 + λ (x − m0)``; ``"less"``: ``λ = f / (1 − m0)``, factor ``1 + λ (m0 − x)``."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    f = np.asarray(fractions, dtype=np.float64)
    if f.size == 0 or ((f <= 0) | (f >= 1)).any():
        raise ValueError(f"bet fractions must lie strictly between 0 and 1, got {list(fractions)!r}")
    m = null_means[None, :, None]
    if alternative == "greater":
        factors = 1.0 + (f[:, None, None] / m) * (x[None, None, :] - m)
    else:
        factors = 1.0 + (f[:, None, None] / (1.0 - m)) * (m - x[None, None, :])
    return np.asarray(np.log(factors), dtype=np.float64)


def _log_wealth(
    x: FloatArray, null_means: FloatArray, alternative: Literal["greater", "less"], fractions: Sequence[float]
) -> FloatArray:
    """``log K_t`` of the mixture of constant bets against each of ``null_means`` (rows), after
    each observation of ``x`` (columns); the bets are :func:`log_bet_factors`'."""
    per_bet = np.cumsum(log_bet_factors(x, null_means, alternative, fractions), axis=2)
    top = per_bet.max(axis=0)
    return np.asarray(top + np.log(np.exp(per_bet - top).mean(axis=0)), dtype=np.float64)


def betting_e_process(
    values: npt.ArrayLike,
    *,
    null_mean: float,
    alternative: Literal["greater", "less"],
    fractions: Sequence[float] = BET_FRACTIONS,
) -> EProcess:
    """Test the mean of observations in [0, 1] by betting against ``null_mean``.

    ``alternative="greater"``: H0 mean ≤ m0. Each bet ``λ = f / m0`` multiplies the wealth by
    ``1 + λ (x − m0)`` per observation (never below ``1 − f``); ``"less"``: H0 mean ≥ m0, with
    ``λ = f / (1 − m0)`` and factor ``1 + λ (m0 − x)``. The wealth is the average over the
    ``fractions`` of these constant-bet capital processes: each is a nonnegative supermartingale
    under H0 (its factors have conditional mean ≤ 1 whenever the mean is on H0's side), so the
    average is too, whatever the order or dependence of the data. Observations are only assumed
    bounded; nothing about their distribution (Waudby-Smith & Ramdas, "Estimating means of bounded
    random variables by betting", JRSS-B 2024). The wealth is capped at :data:`WEALTH_CAP`.

    Usage: ``betting_e_process(flags, null_mean=0.001, alternative="greater").pvalue``
    """
    _check_unit_open(null_mean, "null_mean")
    log_wealth = _log_wealth(_check_bounded(values), np.array([null_mean]), alternative, fractions)[0]
    return EProcess(np.exp(np.minimum(log_wealth, math.log(WEALTH_CAP))))


def average_e_processes(processes: Sequence[EProcess]) -> EProcess:
    """The equal-weight average of e-processes on the same observations' clock: an e-process
    for the intersection of their nulls (one test of "everything is as claimed").

    Usage: ``average_e_processes([mean_test, tail_test])``
    """
    if not processes:
        raise ValueError("average_e_processes needs at least one process")
    lengths = {p.n for p in processes}
    if len(lengths) != 1:
        raise ValueError(f"e-processes must cover the same observations, got lengths {sorted(lengths)}")
    return EProcess(np.mean([p.wealth for p in processes], axis=0))


def confidence_sequence(
    values: npt.ArrayLike, *, alpha: float, fractions: Sequence[float] = BET_FRACTIONS, grid: int = 1000
) -> tuple[FloatArray, FloatArray]:
    """A (1 − α) confidence sequence for the mean of observations in [0, 1]: ``(lower_t, upper_t)``
    for t = 1..n, holding for all t at once with probability ≥ 1 − α.

    It is the set of means no betting test has rejected so far (``"less"`` tests at level α/2
    bound it from above, ``"greater"`` ones from below), on a grid of ``grid`` means, and
    intersected over time, so it only shrinks. Rejection is monotone in the tested mean for
    these bets, so each bound is the first grid point rejected.

    Usage: ``low, high = confidence_sequence(u, alpha=0.05); high[-1]``
    """
    _check_unit_open(alpha, "alpha")
    x = _check_bounded(values)
    means = (np.arange(grid) + 0.5) / grid
    if x.size == 0:
        return np.zeros(0), np.ones(0)
    bounds = {}
    for side in ("less", "greater"):  # "less" tests reject "mean ≥ m" (the upper bound), "greater" the lower
        rejected = np.maximum.accumulate(_log_wealth(x, means, side, fractions) >= math.log(2.0 / alpha), axis=1)
        kept = ~rejected  # once rejected, always
        if side == "less":
            highest_kept = np.where(kept.any(axis=0), grid - 1 - np.argmax(kept[::-1], axis=0), -1)
            bounds[side] = np.where(highest_kept >= 0, np.minimum((highest_kept + 1) / grid, 1.0), 0.0)
        else:
            lowest_kept = np.where(kept.any(axis=0), np.argmax(kept, axis=0), grid)
            bounds[side] = np.where(lowest_kept < grid, lowest_kept / grid, 1.0)
    return np.asarray(bounds["greater"], dtype=np.float64), np.asarray(bounds["less"], dtype=np.float64)


def _e_tail_crossings(rate: float, *, p0: float, threshold: float, weight: float, fractions: Sequence[float]) -> Iterator[float]:
    """P(the tail e-process has crossed by t) for t = 1, 2, ... (an endless generator).

    The wealth after t observations with k flags grows with k, so the test has crossed by t
    iff some earlier (t', k') crossed; the dynamic programme keeps P(not crossed, k flags)
    only for the k below the crossing count, which stays small."""
    _check_unit_open(p0, "p0")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must lie in [0, 1], got {rate!r}")
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"weight must lie in (0, 1], got {weight!r}")
    f = np.asarray(fractions, dtype=np.float64)
    log_hit = np.log1p(f / p0 * (1 - p0))
    log_miss = np.log1p(-f)
    target = math.log(threshold / weight)

    def crosses(t: int, k: int) -> bool:
        log_w = k * log_hit + (t - k) * log_miss
        top = float(log_w.max())
        return top + math.log(float(np.exp(log_w - top).mean())) >= target

    needed = 0  # the fewest flags that cross at t; never decreases in t (a miss only lowers wealth)
    alive = np.array([1.0])  # alive[k]: P(not crossed yet, k flags so far)
    crossed = 0.0
    t = 0
    while True:
        t += 1
        moved = np.append(alive * (1.0 - rate), 0.0)
        moved[1:] += alive * rate
        while needed <= t and not crosses(t, needed):
            needed += 1
        cut = min(needed, moved.size)
        crossed += float(moved[cut:].sum())
        alive = moved[:cut]
        yield min(crossed, 1.0)


def e_tail_power_curve(
    rate: float, n: int, *, p0: float, threshold: float, weight: float = 1.0, fractions: Sequence[float] = BET_FRACTIONS
) -> FloatArray:
    """Exact probability that the tail e-process (``betting_e_process`` on 0/1 flags against
    ``p0``, ``"greater"``) has reached ``threshold`` after 1, 2, ..., ``n`` observations when each
    is flagged independently with probability ``rate``.

    ``weight`` is the tail test's share of an average (:func:`average_e_processes`): the average
    reaches ``threshold`` no later than the tail test alone reaches ``threshold / weight``, so
    this is a lower bound on the average's power. The wealth after t observations depends only
    on the number of flags, so a dynamic programme over (t, flags) with crossing absorbing gives
    the power exactly; it never decreases in ``n`` (a crossed test stays crossed).

    Usage: ``e_tail_power_curve(0.2, 30, p0=0.001, threshold=160.0)[-1]``
    """
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    crossings = _e_tail_crossings(rate, p0=p0, threshold=threshold, weight=weight, fractions=fractions)
    return np.fromiter(itertools.islice(crossings, n), dtype=np.float64, count=n)


def completions_for_e_tail(
    rate: float,
    *,
    p0: float,
    threshold: float,
    power: float,
    weight: float = 1.0,
    max_n: int = 5000,
    fractions: Sequence[float] = BET_FRACTIONS,
) -> int | None:
    """Smallest ``n`` whose :func:`e_tail_power_curve` value is ≥ ``power`` (None if not within ``max_n``): the
    audit size at which a mixture flagging ``rate`` of completions would be caught.

    Usage: ``completions_for_e_tail(0.2, p0=0.001, threshold=160.0, power=0.95)``
    """
    _check_unit_open(power, "power")
    crossings = _e_tail_crossings(rate, p0=p0, threshold=threshold, weight=weight, fractions=fractions)
    for n, reached in enumerate(itertools.islice(crossings, max_n), start=1):
        if reached >= power:
            return n
    return None
