"""Anytime-valid tests by betting: what the verify stage decides with, and what the generate
stage's monitor continues one observation at a time.

A test by betting turns observations in [0, 1] into the wealth of a gambler who bets against
the null (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting",
JRSS-B 2024). Under the null the wealth is a nonnegative supermartingale that starts at 1, so
by Ville's inequality it ever reaches ``1/α`` with probability at most α: the test may be
looked at after every observation and stopped at any time without inflating its error rate.

* :func:`betting_e_process` tests the mean against a null mean; :func:`average_e_processes`
  averages several into one test of the intersection of their nulls; :func:`log_bet_factors`
  is what each bet does to the wealth per observation (the generate stage's monitor applies it
  one observation at a time).
* :func:`confidence_sequence`: anytime-valid bounds on the mean, from the same bets.
* Across providers, e-BH is :func:`quanthunt.stats.benjamini_hochberg` on ``1 / e``.
* :func:`e_tail_power_curve` / :func:`completions_for_e_tail`: the exact power of the
  sequential tail test against a mixture, which sizes an audit.

Conventions: every function is pure (arrays or sequences in, an array, a number or a frozen
dataclass out; no I/O, and nothing here draws random numbers). Observations must lie in
[0, 1]; invalid input (NaN, observations or bet fractions out of range, empty or mismatched
e-processes) raises ``ValueError``, through the checks :mod:`quanthunt.stats` defines. Wealth
is capped at :data:`WEALTH_CAP` instead of overflowing, so a p-value is never NaN.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from quanthunt.stats import FloatArray, as_finite_1d, check_unit_open

__all__ = [
    "BET_FRACTIONS",
    "WEALTH_CAP",
    "EProcess",
    "average_e_processes",
    "betting_e_process",
    "completions_for_e_tail",
    "confidence_sequence",
    "e_tail_power_curve",
    "log_bet_factors",
]

BET_FRACTIONS = (0.9, 0.5, 0.25, 0.125, 0.0625, 0.03125)
"""The bets an e-process spreads its wealth over, as fractions of the largest bet that cannot
lose everything on one observation (a "diversified Kelly" mixture, Waudby-Smith & Ramdas
2024 §5.5): large fractions win fast against a large effect, small ones win surely against a
small one, and the mixture pays at most ``log 6`` nats for not knowing which."""

WEALTH_CAP = 1e300
"""Wealth is capped here (far beyond any threshold) instead of overflowing to infinity."""


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

    def stopped(self, level: float) -> float:
        """``K`` at the first t with ``K_t ≥ level``, else ``K_n``: the wealth of a test that
        stops betting once it reaches ``level``, an e-value at any stopping time as ``final``
        is, and at least ``level`` whenever the process ever reached it (what lets e-BH reject
        everything the anytime test at ``level`` rejects)."""
        hits = np.flatnonzero(self.wealth >= level)
        return float(self.wealth[hits[0]]) if hits.size else self.final

    @property
    def peak(self) -> float:
        """``max(1, max_t K_t)``."""
        return max(1.0, float(self.wealth.max())) if self.wealth.size else 1.0

    @property
    def pvalue(self) -> float:
        """The anytime-valid p-value ``min(1, 1 / max_t K_t)``: ``P(it ever falls to α) ≤ α``."""
        return 1.0 / self.peak


def _check_bounded(values: npt.ArrayLike) -> FloatArray:
    x = as_finite_1d(values, "observations")
    if ((x < 0) | (x > 1)).any():
        raise ValueError("betting observations must lie in [0, 1] (scale and clip them first)")
    return x


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
    under H0, and so is the average. What H0 must say for that: each observation's mean *given
    the ones before it* is on H0's side (then every factor has conditional mean ≤ 1). Order and
    dependence are free within that; data whose conditional means drift across m0 (a provider
    faithful on some prompts, off on others, in a data-dependent order) are not covered by it.
    Observations are only assumed bounded; nothing about their distribution (Waudby-Smith &
    Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2024). The
    wealth is capped at :data:`WEALTH_CAP`.

    Usage: ``betting_e_process(flags, null_mean=0.001, alternative="greater").pvalue``
    """
    check_unit_open(null_mean, "null_mean")
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
    these bets, so each bound is the first grid point rejected: a mean between the last kept
    point and it may not be rejected either, so the bound never stops short of that point.

    Usage: ``low, high = confidence_sequence(u, alpha=0.05); high[-1]``
    """
    check_unit_open(alpha, "alpha")
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
            # the first rejected point above is means[highest_kept + 1] = (highest_kept + 1.5) / grid
            bounds[side] = np.where(highest_kept >= 0, np.minimum((highest_kept + 1.5) / grid, 1.0), 0.0)
        else:
            lowest_kept = np.where(kept.any(axis=0), np.argmax(kept, axis=0), grid)
            bounds[side] = np.where(lowest_kept < grid, np.maximum((lowest_kept - 0.5) / grid, 0.0), 1.0)
    return np.asarray(bounds["greater"], dtype=np.float64), np.asarray(bounds["less"], dtype=np.float64)


def _e_tail_crossings(rate: float, *, p0: float, threshold: float, weight: float, fractions: Sequence[float]) -> Iterator[float]:
    """P(the tail e-process has crossed by t) for t = 1, 2, ... (an endless generator).

    The wealth after t observations with k flags grows with k, so the test has crossed by t
    iff some earlier (t', k') crossed; the dynamic programme keeps P(not crossed, k flags)
    only for the k below the crossing count, which stays small."""
    check_unit_open(p0, "p0")
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
    check_unit_open(power, "power")
    crossings = _e_tail_crossings(rate, p0=p0, threshold=threshold, weight=weight, fractions=fractions)
    for n, reached in enumerate(itertools.islice(crossings, max_n), start=1):
        if reached >= power:
            return n
    return None
