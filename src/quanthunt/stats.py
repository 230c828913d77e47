"""Fixed-sample statistics for precision verification (is a provider serving the model it
claims?), and the input checks that :mod:`quanthunt.sequential` and :mod:`quanthunt.distances`
share.

Design
------
Every function here is pure: arrays or sequences in, a float, a list or a small frozen
dataclass out. There is no I/O and no global random state; every random procedure takes a
``numpy.random.Generator`` so that a seed reproduces a result exactly. scipy provides the
distributions (``binomtest``, ``t``); this module only wires them to the questions the
verification asks. The verify stage decides with the anytime-valid tests of
:mod:`quanthunt.sequential`; the tests here are its reported baselines.

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
* **Sample mode** (no logprobs). Provider and reference each sample several completions per
  prompt and the reference scores all of them. :func:`stratified_permutation_test` compares the
  scores within prompt (prompt = stratum), with a mean, a minimum or a tail-count statistic (the
  tail count does not dilute a mixture).
* **Several providers** at once: :func:`holm` (family-wise error) or
  :func:`benjamini_hochberg` (false discovery rate), both via :func:`adjust`.
* **Intervals**: :func:`bootstrap_ci` (optionally resampling whole prompts) on any statistic.

Conventions: p-values are never NaN (degenerate inputs get a documented 0 or 1); invalid input
(empty data, NaN, out-of-range probabilities, mismatched lengths) raises ``ValueError``.
Permutation p-values use the ``(b + 1) / (m + 1)`` correction (:func:`permutation_pvalue`),
so they are never 0 and the test is exact (size ≤ α) under exchangeability.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsFloat

import numpy as np
import numpy.typing as npt
from numpy.typing import NDArray

__all__ = [
    "PERMUTATION_BATCH_CELLS",
    "FloatArray",
    "IntArray",
    "Labels",
    "MeanTest",
    "PermutationTest",
    "adjust",
    "as_finite_1d",
    "benjamini_hochberg",
    "binomial_tail_test",
    "bootstrap_ci",
    "check_unit_open",
    "holm",
    "label_codes",
    "label_list",
    "one_sided_mean_test",
    "permutation_pvalue",
    "stratified_permutation_test",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
Labels = Sequence[Hashable] | NDArray[Any]
"""Stratum / prompt labels: any hashable values (str, int, numpy scalars)."""

Alternative = Literal["less", "greater", "two-sided"]
PermutationStatistic = Literal["mean", "min", "tail_count"] | Callable[[FloatArray, FloatArray], SupportsFloat]

PERMUTATION_BATCH_CELLS = 1 << 22
"""Permutation batches hold at most this many indices at once (~32 MiB of int64)."""


# --------------------------------------------------------------------------------------------
# Input checks and labels (shared with quanthunt.sequential and quanthunt.distances)
# --------------------------------------------------------------------------------------------


def as_finite_1d(values: npt.ArrayLike, name: str) -> FloatArray:
    """``values`` as a flat float array; ``ValueError`` naming ``name`` if any is NaN or infinite."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return arr


def check_unit_open(value: float, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``0 < value < 1``."""
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")


def label_list(labels: Labels) -> list[Hashable]:
    """Labels as plain Python values (numpy arrays via ``tolist`` so numpy scalars hash like Python ones)."""
    return labels.tolist() if isinstance(labels, np.ndarray) else list(labels)


def label_codes(labels: Labels, name: str) -> tuple[IntArray, int]:
    """Map arbitrary hashable labels to integer codes 0..k-1 (first-appearance order)."""
    items = label_list(labels)
    index: dict[Hashable, int] = {}
    codes = np.empty(len(items), dtype=np.int64)
    for i, label in enumerate(items):
        try:
            codes[i] = index.setdefault(label, len(index))
        except TypeError as exc:
            raise ValueError(f"{name} labels must be hashable, got {label!r}") from exc
    return codes, len(index)


# --------------------------------------------------------------------------------------------
# Multiple testing
# --------------------------------------------------------------------------------------------


def _in_input_order(pvalues: Sequence[float], adjust_ascending: Callable[[FloatArray], FloatArray]) -> list[float]:
    """``adjust_ascending`` applied to the p-values sorted ascending, returned in input order."""
    p = np.asarray(pvalues, dtype=np.float64).reshape(-1)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p-values must lie in [0, 1] and not be NaN, got {list(pvalues)!r}")
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(p.size)
    adjusted[order] = adjust_ascending(p[order])
    return [float(v) for v in adjusted]


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni step-down adjusted p-values (family-wise error control), in input order.

    With the ascending order ``p_(1) ≤ … ≤ p_(m)``, ``adj_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j))``.
    Reject hypothesis ``i`` at level α iff ``adj_i ≤ α``. The result is monotone in the raw
    p-values, never below them, and capped at 1. An empty input gives ``[]``.

    Usage: ``holm([0.01, 0.04, 0.03, 0.005])  # -> [0.03, 0.06, 0.06, 0.02]``
    """
    return _in_input_order(pvalues, lambda p: np.maximum.accumulate(np.minimum(1.0, (p.size - np.arange(p.size)) * p)))


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini–Hochberg step-up adjusted p-values (false-discovery-rate control), in input order.

    With the ascending order ``p_(1) ≤ … ≤ p_(m)``, ``adj_(i) = min_{j ≥ i} min(1, m p_(j) / j)``.
    Rejecting every hypothesis with ``adj_i ≤ q`` controls the FDR at ``q`` (independent or
    positively dependent tests). Monotone, never below the raw p-values, capped at 1. An empty
    input gives ``[]``.

    Usage: ``benjamini_hochberg([0.01, 0.04, 0.03, 0.005])  # -> [0.02, 0.04, 0.04, 0.02]``
    """
    return _in_input_order(
        pvalues, lambda p: np.minimum.accumulate(np.minimum(1.0, p * p.size / np.arange(1, p.size + 1))[::-1])[::-1]
    )


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
    check_unit_open(confidence, "confidence")
    x = as_finite_1d(values, "values")
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
    from scipy import stats as _sps  # here: 1.4 s to import, and generate's monitor needs none of it

    pvalue = float(_sps.t.cdf(statistic, df) if alternative == "less" else _sps.t.sf(statistic, df))
    half_width = float(_sps.t.ppf(0.5 + confidence / 2, df)) * se
    return MeanTest(statistic, pvalue, mean, sd, n, mean - half_width, mean + half_width, threshold, alternative, confidence)


# --------------------------------------------------------------------------------------------
# Bootstrap
# --------------------------------------------------------------------------------------------


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
    check_unit_open(confidence, "confidence")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be ≥ 1, got {n_resamples}")
    x = as_finite_1d(values, "values")
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if clusters is None:
        codes, k = np.arange(x.size), x.size
    else:
        codes, k = label_codes(clusters, "clusters")
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
    from scipy import stats as _sps

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


def permutation_pvalue(null: FloatArray, observed: float, alternative: Alternative, tol: float) -> float:
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
    xa = as_finite_1d(x, "x")
    ya = as_finite_1d(y, "y")
    if xa.size == 0 or ya.size == 0:
        raise ValueError("both x and y need at least one value")
    codes, k = label_codes([*label_list(strata_x), *label_list(strata_y)], "strata")
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
        check_unit_open(tail_quantile, "tail_quantile")
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
    batch = max(1, PERMUTATION_BATCH_CELLS // z.size)
    null_parts = []
    for start in range(0, n_permutations, batch):
        perms = _within_stratum_permutations(codes, min(batch, n_permutations - start), rng)
        null_parts.append(stat_fn(perms))
    null = np.concatenate(null_parts)
    return PermutationTest(observed, permutation_pvalue(null, observed, alternative, tol), n_permutations)
