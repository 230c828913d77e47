"""Margins measured on a deployment the team trusts (issue 25): what the verify stage's
difference tests may assume of a faithful provider, from that deployment's own completions.
Pure: observations in, margins out.

The shipped ``verify.margin`` values were set on the sandbox's SmolLM2 pools. Each of them
is a claim about faithful providers: their mean |Δ logprob| is at most ``mean_abs_dlogprob``,
at most ``tail_p0`` of their completions are beyond ``tail_dlogprob``, at most
``sample_tail_p0`` have rank z beyond ``sample_tail_z``, and their mean Φ(rank z) lies within
``sampler_shift`` of ½. A *control* (a second deployment of the reference on other hardware
or dtype, or the model author's own endpoint), measured exactly as verify measures a
provider, shows how far a faithful deployment really is: :func:`calibrate` keeps each
shipped margin where the control's confidence bound is inside it and widens it to that
bound where it is not, so the null holds for every provider as noisy as the control. It
never narrows a margin: the shipped values are also the team's tolerance.

The bounds hold jointly at ``confidence`` (Bonferroni over the :data:`BOUNDS` they are):
Clopper–Pearson for the shares, the betting confidence sequence (``sequential``) for the
means. A share measured as 0 of 288 bounds the faithful rate only by 1.0 % at 95 % (1.7 %
as one of a calibration's 8 bounds): that, not the shipped 0.1 %, is what it establishes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from quanthunt import sequential
from quanthunt.params import Decision, Margins

BOUNDS = 8
"""The one-sided confidence bounds a calibration takes: mean |Δ| and its extreme share
(upper), and in each listing the extreme-z share (upper) and mean Φ(z) (lower and upper)."""

GENERATION_BOUNDS = 2
"""The one-sided bounds a control's completions at the generation's settings take: the
extreme-z share (upper) and mean pit's distance from ½ (upper)."""

MEAN_MARGIN_FACTOR = 2.0
"""A widened ``mean_abs_dlogprob`` is this many times the control's upper bound, so that a
provider as noisy as the control can still be shown *below* it (the equivalence test): a
margin at the bound itself would take thousands of completions. The shipped 0.08 is 2.35
times bf16 compute's measured 0.034 (``benchmarks/verify_power.py``)."""

TAIL_OVER_MARGIN = 1.25
"""Where the mean margin is widened past ``tail_dlogprob`` / this, the extreme threshold
moves up with it (it must stay above the mean margin). Any threshold keeps the error rates,
since the share beyond it is bounded on the same completions (``tail_p0``) and the
detection rate measured at it (``detection``); this one is a choice for power, which
``benchmarks/noisy_faithful.py`` measures."""

_NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class Faithful:
    """One control's completions, each measured as verify measures a provider's."""

    name: str
    shifts: Sequence[float]
    """Mean |Δ logprob| of each completion against the reference (logprob mode)."""
    z_listed: Sequence[float]
    """Rank z of each completion under the reference's top ``verify.probes.top_logprobs``
    (logprob mode's sampler check)."""
    z_sample: Sequence[float]
    """Rank z of each completion under the reference's top 20 (sample mode)."""
    pit_listed: Sequence[float] | None = None
    """``Rank.pit`` of each under the top ``top_logprobs`` (what the sampler's mean tests bet
    on); None: Φ(z), as for completions as long as the horizon."""
    pit_sample: Sequence[float] | None = None
    """The same under the top 20."""


@dataclass(frozen=True)
class Bound:
    """One margin: what the control measured, its confidence bound, and the margin used."""

    margin: str
    measured: float
    bound: float
    shipped: float
    used: float
    n: int
    lower_is_looser: bool = False
    """For a detection rate: claiming less detection is the cautious way."""

    @property
    def widened(self) -> bool:
        """Whether calibration loosened what the shipped value assumed."""
        return self.used < self.shipped if self.lower_is_looser else self.used > self.shipped


def share_interval(flagged: int, n: int, *, confidence: float) -> tuple[float, float]:
    """Each side a one-sided ``confidence`` Clopper–Pearson bound of a rate seen ``flagged``
    times in ``n`` (the exact two-sided interval at ``2 * confidence - 1``)."""
    if n <= 0 or not 0 <= flagged <= n:
        raise ValueError(f"need 0 ≤ flagged ≤ n and n > 0, got {flagged} of {n}")
    from scipy.stats import binomtest

    interval = binomtest(flagged, n).proportion_ci(confidence_level=2 * confidence - 1, method="exact")
    return float(interval.low), float(interval.high)


def mean_interval(values: Sequence[float], *, confidence: float) -> tuple[float, float]:
    """Each side a one-sided ``confidence`` bound of the mean of ``values`` in [0, 1]."""
    low, high = sequential.confidence_sequence(list(values), alpha=2 * (1 - confidence))
    return float(low[-1]), float(high[-1])


def calibrate(shipped: Margins, control: Faithful, *, confidence: float) -> tuple[Margins, list[Bound]]:
    """The margins verify should use given ``control``'s completions, and every bound behind them."""
    n = len(control.shifts)
    if n == 0 or len(control.z_listed) != n or len(control.z_sample) != n:
        raise ValueError(f"control {control.name}: need the same number (> 0) of shifts and rank z, got {n}")
    each = 1 - (1 - confidence) / BOUNDS
    tail = shipped.tail_dlogprob
    for _ in range(20):  # the test clips at the tail, so a wider tail clips less: bound again until it holds still
        clipped = [min(s, tail) / tail for s in control.shifts]
        fraction = mean_interval(clipped, confidence=each)[1]
        mean_high = fraction * tail
        mean_margin = max(shipped.mean_abs_dlogprob, MEAN_MARGIN_FACTOR * mean_high)
        if mean_margin * TAIL_OVER_MARGIN <= tail:
            break
        tail = mean_margin * TAIL_OVER_MARGIN
    else:  # each wider threshold widened the bound as much: too few completions to bound the mean
        raise ValueError(
            f"control {control.name}: {n} completions bound its mean |Δ logprob| only by {fraction:.2f} of any extreme "
            "threshold: measure more completions"
        )
    bounds = [Bound("mean_abs_dlogprob", statistics.fmean(control.shifts), mean_high, shipped.mean_abs_dlogprob, mean_margin, n)]
    if tail > shipped.tail_dlogprob:
        # moved up with the mean margin, on the same evidence
        bounds.append(Bound("tail_dlogprob", statistics.fmean(control.shifts), mean_high, shipped.tail_dlogprob, tail, n))
    extreme = sum(s > tail for s in control.shifts)
    tail_p0 = share_interval(extreme, n, confidence=each)[1]
    bounds.append(Bound("tail_p0", extreme / n, tail_p0, shipped.tail_p0, max(shipped.tail_p0, tail_p0), n))
    widened = shipped.model_copy(update={"mean_abs_dlogprob": mean_margin, "tail_dlogprob": tail,
                                         "tail_p0": max(shipped.tail_p0, tail_p0)})  # fmt: skip
    for listing, zs, pits in (("listed", control.z_listed, control.pit_listed), ("sample", control.z_sample, control.pit_sample)):
        widened = _sampler_bounds(widened, shipped, listing, zs, pits, each=each, into=bounds)
    return Margins.model_validate(widened.model_dump()), bounds


def _sampler_bounds(
    margins: Margins, shipped: Margins, listing: str, zs: Sequence[float], pits: Sequence[float] | None, *, each: float,
    into: list[Bound],
) -> Margins:  # fmt: skip
    """``margins`` with the sampler's two margins widened to the upper bounds of the extreme-z
    share and of mean pit's distance from ½ over ``zs`` (``pits``; None: Φ(z)), each bound at
    ``each`` and appended to ``into`` (named ``sample_tail_p0 (listing)``)."""
    n = len(zs)
    flagged = sum(z > margins.sample_tail_z for z in zs)
    upper = share_interval(flagged, n, confidence=each)[1]
    tail_p0 = max(margins.sample_tail_p0, upper)
    into.append(Bound(f"sample_tail_p0 ({listing})", flagged / n, upper, shipped.sample_tail_p0, tail_p0, n))
    values = list(pits) if pits is not None else [_NORMAL.cdf(z) for z in zs]
    low, high = mean_interval(values, confidence=each)
    off = max(high - 0.5, 0.5 - low)
    shift = max(margins.sampler_shift, off)
    into.append(Bound(f"sampler_shift ({listing})", abs(statistics.fmean(values) - 0.5), off, shipped.sampler_shift, shift, n))
    return margins.model_copy(update={"sample_tail_p0": tail_p0, "sampler_shift": shift,
                                      "sampler_equivalence": max(margins.sampler_equivalence, shift)})  # fmt: skip


@dataclass(frozen=True)
class Sampled:
    """One control's completions sampled at the generation's settings (its temperature and
    ``max_tokens``, top-p 1), each ranked as the generate stage's monitor ranks a reply: under
    the reference's top 20 at that temperature (``measurements.rank``)."""

    name: str
    z: Sequence[float]
    pit: Sequence[float]


def at_generation(margins: Margins, control: Sampled, *, confidence: float) -> tuple[Margins, list[Bound]]:
    """The sampler margins the generate stage's monitor may assume of a faithful provider at
    the generation's settings, from ``control``'s completions there: ``margins`` (verify's,
    already calibrated) with ``sample_tail_p0`` and ``sampler_shift`` widened to the two
    upper bounds (jointly at ``confidence``), never narrowed.

    The audit samples at T 1; at the generation's T 0.7 every logit is scaled by 1/T and the
    texts keep to likelier tokens, so a deployment's noise may move the tempered ranks more
    or less than the audit saw (on the sandbox's fp8 KV, less: ``benchmarks/noisy_faithful.py``),
    and only a measurement there says which. A looser margin keeps every test's null, so the
    monitor can bet on the audit's observations and its own against these."""
    n = len(control.z)
    if n == 0 or len(control.pit) != n:
        raise ValueError(f"control {control.name}: need the same number (> 0) of rank z and pits, got {n}")
    bounds: list[Bound] = []
    each = 1 - (1 - confidence) / GENERATION_BOUNDS
    used = _sampler_bounds(margins, margins, "generation", control.z, control.pit, each=each, into=bounds)
    return Margins.model_validate(used.model_dump()), bounds


def detection(shipped: Decision, margins: Margins, coarse: Faithful, *, confidence: float) -> tuple[Decision, list[Bound]]:
    """The mixture detection rates measured on a coarse build's completions: the share of
    them each mode flags extreme under ``margins``, at its lower confidence bound (jointly at
    ``confidence`` over the two). Replaces the shipped rates, which were measured on
    SmolLM2's NVFP4: the power behind ``equivalent`` then rests on the team's own model."""
    n = len(coarse.shifts)
    if n == 0 or len(coarse.z_sample) != n:
        raise ValueError(f"coarse build {coarse.name}: need the same number (> 0) of shifts and rank z, got {n}")
    each = 1 - (1 - confidence) / 2
    logprob = sum(s > margins.tail_dlogprob for s in coarse.shifts)
    sample = sum(z > margins.sample_tail_z for z in coarse.z_sample)
    bounds = [
        Bound("mixture_detection_logprob", logprob / n, share_interval(logprob, n, confidence=each)[0],
              shipped.mixture_detection_logprob, 0.0, n),
        Bound("mixture_detection_sample", sample / n, share_interval(sample, n, confidence=each)[0],
              shipped.mixture_detection_sample, 0.0, n),
    ]  # fmt: skip
    if any(b.bound <= 0 for b in bounds):
        zero = ", ".join(b.margin for b in bounds if b.bound <= 0)
        raise ValueError(f"coarse build {coarse.name}: its completions are never flagged ({zero}): no mixture can be caught")
    bounds = [Bound(b.margin, b.measured, b.bound, b.shipped, b.bound, n, lower_is_looser=True) for b in bounds]
    used = shipped.model_copy(update={b.margin: b.bound for b in bounds})
    return Decision.model_validate(used.model_dump()), bounds
