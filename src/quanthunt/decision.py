"""Deciding, from what the audits measured, whether each provider serves the reference's
distribution: sequential, anytime-valid tests by betting. Pure: audits in, verdicts out.

Each audited completion becomes a few observations bounded in [0, 1] (betting needs bounds):

- **shift** (logprob mode): the completion's mean |Δ logprob| against the reference,
  clipped at the extreme threshold ``tail_dlogprob`` and divided by it;
- **extreme** (logprob mode): 1 if that mean is beyond ``tail_dlogprob``;
- **pit**: ``Φ(z)`` of the completion's rank z, the normal score of each sampled token's
  randomised PIT under the reference (the stop token included) summed over a fixed horizon,
  a shorter text padded with independent draws (``measurements.rank``). Text the
  reference's own sampler would have produced gives z ~ N(0, 1) exactly, so pit is uniform
  with mean ½; a coarser model or a hotter sampler picks tokens the reference ranks lower
  (pit above ½), a colder or truncating sampler picks its favourites (below ½). Measured
  in both modes: in logprob mode it is the sampler check (the numbers a provider reports
  can be exact while its sampler is not);
- **pit extreme**: 1 if z is beyond ``sample_tail_z`` (a mixture's coarse completions).

A provider is ``different`` when the average of its difference e-processes crosses its
threshold (Holm across providers on the anytime p-values ``1 / max wealth``, or e-BH on
the wealth at stopping); ``equivalent`` when every equivalence e-process has crossed (the
confidence sequence of each mean lies inside its margin: an intersection–union test,
corrected across providers) *and* the audit so far would have caught a ``mixture_share``
mixture of the calibrated coarse precision with probability ≥ ``min_power``; otherwise it
is undecided, and the stage audits it further until its budget runs out (then
``inconclusive``). By Ville's inequality the error rates hold however often the verdicts
are looked at, which is what lets the stage keep auditing undecided providers.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from quanthunt import distances, sequential, stats
from quanthunt.measurements import Audit
from quanthunt.params import Decision, Margins
from quanthunt.replies import same_provider
from quanthunt.verdicts import Estimate, Observed, ProviderVerdict, TestResult, Verdict

_STANDARD_NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class Subject:
    """A provider to judge, as the survey described it."""

    provider: str
    tag: str
    declared_quantization: str
    survey_decision: str


@dataclass(frozen=True)
class Observations:
    """One provider's audited completions as betting observations, in audit order."""

    mode: str
    shift: list[float]
    """Logprob mode: mean |Δ logprob| per completion (unclipped)."""
    z: list[float]
    """Rank z per completion (N(0, 1) for the reference's own sampler)."""
    probes: list[str]
    first_round: int
    """How many of them the first round produced."""
    pits: list[float] | None = None
    """``Rank.pit`` per completion (E[Φ(z)] given its text); None: Φ(z) (verdicts from
    before it was kept)."""

    @classmethod
    def of(cls, audit: Audit) -> Observations:
        end = audit.first_round_end
        if audit.mode == "logprob":
            done = [c for c in audit.logprob if c.deltas]
            first = sum(c.seq < end for c in done)
            return cls("logprob", [c.mean_abs_delta for c in done], [c.rank_z for c in done], [c.probe_id for c in done],
                       first, [c.rank_pit for c in done])  # fmt: skip
        texts = [s for s in audit.sampled if s.source == "provider" and s.tokens]
        return cls("sample", [], [s.rank_z for s in texts], [s.probe_id for s in texts], sum(s.seq < end for s in texts),
                   [s.rank_pit for s in texts])  # fmt: skip

    @property
    def n(self) -> int:
        return len(self.z)

    def pit(self) -> list[float]:
        """What the sampler's mean tests bet on: each completion's mean Φ(rank z) given its text."""
        return list(self.pits) if self.pits is not None else [_STANDARD_NORMAL.cdf(z) for z in self.z]


Side = Literal["greater", "less"]
Bet = tuple[list[float], float, Side]
"""A one-sided betting test: its observations, null mean and the side it bets on."""


@dataclass
class Tests:
    """A provider's e-processes: the components of each side, by name."""

    difference_bets: dict[str, list[Bet]]
    """Each difference test: the one-sided bets it averages (two for a two-sided one)."""
    bets: dict[str, Bet]
    """The equivalence tests (kept as data for the plug-in estimate of what they still need)."""
    null: dict[str, str]
    """What each test's null hypothesis says, for the report."""

    @functools.cached_property
    def difference(self) -> dict[str, sequential.EProcess]:
        return {name: sequential.average_e_processes([_e_process(bet) for bet in bets])
                for name, bets in self.difference_bets.items()}  # fmt: skip

    @functools.cached_property
    def equivalence(self) -> dict[str, sequential.EProcess]:
        return {name: _e_process(bet) for name, bet in self.bets.items()}

    @functools.cached_property
    def combined(self) -> sequential.EProcess:
        """The average of the difference tests: one e-process for "everything is as the
        reference" (its null is the intersection of theirs)."""
        return sequential.average_e_processes(list(self.difference.values()))


def _e_process(bet: Bet) -> sequential.EProcess:
    x, m0, side = bet
    return sequential.betting_e_process(x, null_mean=m0, alternative=side)


def sequential_tests(obs: Observations, margin: Margins, *, sampler: bool = True) -> Tests:
    """Every betting test on one provider's observations.

    Difference (any of them can make a provider ``different``): in both modes the sampler's
    mean PIT off ½ (bets on both sides) and its extreme-z share; in logprob mode also the mean
    |Δ logprob| above its margin and the extreme-|Δ| share. Equivalence (all of them must
    cross): in both modes the mean PIT inside ½ ± ``sampler_equivalence``, from each side; in
    logprob mode also the mean |Δ| below its margin (the numbers show the model, the PIT its
    sampler). ``sampler=False`` leaves the sampler's tests out (the generate stage's monitor
    when generation samples where the PIT cannot be computed: top-p below 1, a temperature
    above 1)."""
    pit = obs.pit()
    extreme_pit = [1.0 if z > margin.sample_tail_z else 0.0 for z in obs.z]
    low, high = 0.5 - margin.sampler_shift, 0.5 + margin.sampler_shift
    eq_low, eq_high = 0.5 - margin.sampler_equivalence, 0.5 + margin.sampler_equivalence
    difference: dict[str, list[Bet]] = {}
    bets: dict[str, Bet] = {}
    null: dict[str, str] = {}
    if sampler:
        difference = {
            "sampler: mean Φ(rank z) off ½": [(pit, high, "greater"), (pit, low, "less")],
            "sampler: extreme rank z": [(extreme_pit, margin.sample_tail_p0, "greater")],
        }
        bets = {
            "sampler: mean Φ(rank z) above ½ − margin": (pit, eq_low, "greater"),
            "sampler: mean Φ(rank z) below ½ + margin": (pit, eq_high, "less"),
        }
        null = {
            "sampler: mean Φ(rank z) off ½": f"|mean Φ(z) − ½| ≤ {margin.sampler_shift}",
            "sampler: extreme rank z": f"share with z > {margin.sample_tail_z} ≤ {margin.sample_tail_p0}",
            "sampler: mean Φ(rank z) above ½ − margin": f"mean Φ(z) ≤ {eq_low:g}",
            "sampler: mean Φ(rank z) below ½ + margin": f"mean Φ(z) ≥ {eq_high:g}",
        }
    if obs.mode != "logprob":
        return Tests(difference, bets, null)
    scale = margin.tail_dlogprob
    clipped = [min(s, scale) / scale for s in obs.shift]
    extreme = [1.0 if s > scale else 0.0 for s in obs.shift]
    m0 = margin.mean_abs_dlogprob / scale
    shift_tests: dict[str, list[Bet]] = {
        "mean |Δ logprob| above margin": [(clipped, m0, "greater")],
        "extreme completions": [(extreme, margin.tail_p0, "greater")],
    }
    difference = shift_tests | difference
    below: Bet = (clipped, m0, "less")
    bets = {"mean |Δ logprob| below margin": below} | bets
    null |= {
        "mean |Δ logprob| above margin": f"mean |Δ| (clipped at {scale}) ≤ {margin.mean_abs_dlogprob}",
        "extreme completions": f"share with mean |Δ| > {scale} ≤ {margin.tail_p0}",
        "mean |Δ logprob| below margin": f"mean |Δ| (clipped at {scale}) ≥ {margin.mean_abs_dlogprob}",
    }
    return Tests(difference, bets, null)


@dataclass(frozen=True)
class TailTest:
    """The tail test that must catch a ``mixture_share`` mixture, as the stage runs it."""

    p0: float
    """The faithful flag rate it tests against."""
    detected: float
    """The coarse precision's flag rate (``mixture_detection_*``: shipped or calibrated)."""
    rate: float
    """The mixture's flag rate: ``detected`` on its coarse share and none on the rest. A
    faithful completion may be flagged at up to ``p0``, but nothing measures how rarely: one
    that never is makes the mixture's rate, and the power, lowest (issue 25 §2), so its
    flags are given no credit."""
    threshold: float
    """The wealth the combined e-process must reach in the correction's worst case: Holm's
    first step (and e-BH's smallest rejection) across ``providers`` needs ``m / α``."""
    weight: float
    """The tail test's share of the averaged difference e-process."""

    @classmethod
    def of(cls, mode: str, *, providers: int, margin: Margins, policy: Decision) -> TailTest:
        if mode == "logprob":
            p0, detected = margin.tail_p0, policy.mixture_detection_logprob
        else:
            p0, detected = margin.sample_tail_p0, policy.mixture_detection_sample
        share = policy.mixture_share
        components = len(sequential_tests(Observations(mode, [], [], [], 0), margin).difference)
        return cls(p0, detected, share * detected, max(providers, 1) / policy.alpha, 1.0 / components)


def mixture_power(mode: str, n: int, *, providers: int, margin: Margins, policy: Decision) -> list[float]:
    """Probability that 1, 2, ..., ``n`` audited completions catch a ``mixture_share``
    mixture: the tail test alone, at its share of the averaged difference e-process,
    crossing the correction's worst-case threshold (exact; the other tests only add to it)."""
    t = TailTest.of(mode, providers=providers, margin=margin, policy=policy)
    return [float(v) for v in sequential.e_tail_power_curve(t.rate, n, p0=t.p0, threshold=t.threshold, weight=t.weight)]


MIXTURE_SEARCH_MAX = 20_000
"""The longest audit ``mixture_needed`` looks for the mixture power in."""


@functools.lru_cache(maxsize=64)
def mixture_needed(mode: str, *, providers: int, margin: Margins, policy: Decision) -> int | None:
    """The fewest completions with :func:`mixture_power` ≥ ``min_power`` (None: beyond :data:`MIXTURE_SEARCH_MAX`)."""
    t = TailTest.of(mode, providers=providers, margin=margin, policy=policy)
    return sequential.completions_for_e_tail(t.rate, p0=t.p0, threshold=t.threshold, power=policy.min_power,
                                        weight=t.weight, max_n=MIXTURE_SEARCH_MAX)  # fmt: skip


@dataclass
class State:
    """Where one provider stands after a round."""

    verdict: Verdict | None
    """``different``/``equivalent`` once decided; ``inconclusive`` for a reason more
    probes cannot fix (failures, misrouting); None while undecided."""
    reason: str
    tests: Tests
    power: float = 0.0
    needed: int | None = None
    results: list[TestResult] = field(default_factory=list)


def _p(process: sequential.EProcess, correction: str, level: float) -> float:
    """The p-value a correction uses: anytime-valid (Holm), or for e-BH one over the wealth
    stopped at its first reaching ``level`` (the family's ``m / α``). The wealth at a round's
    end alone could fall back below a crossing that happened mid-audit (a provider off for
    its first completions, then faithful), which the power programme counts as caught."""
    if correction == "holm":
        return process.pvalue
    return min(1.0, 1.0 / max(process.stopped(level), 1e-300))


def judge(
    subjects: Sequence[Subject], audits: Sequence[Audit], margin: Margins, policy: Decision, *, family: int | None = None
) -> list[State]:
    """Every provider's state from its audit so far (see the module docstring).

    ``family``: the number of providers the correction is across, when more than those
    judged here (the benchmark judges one provider as one of the stage's eight); the others
    count as never rejected, which is exactly Holm's (or e-BH's) worst case for these."""
    method = policy.correction
    m = max(family or 0, len(subjects))
    states: list[State] = []
    for subject, audit in zip(subjects, audits, strict=True):
        blocked = _blocked(subject, audit, policy)
        obs = Observations.of(audit)
        tests = sequential_tests(obs, margin)
        states.append(State("inconclusive" if blocked else None, blocked or "", tests))
    padding = [1.0] * (m - len(states))  # the family's other providers, never rejected
    level = m / policy.alpha  # e-BH's smallest rejection, Holm's first step
    diff_adj = stats.adjust([_p(s.tests.combined, method, level) for s in states] + padding, method)[: len(states)]
    equiv_p = [max(_p(e, method, level) for e in s.tests.equivalence.values()) for s in states]
    equiv_adj = stats.adjust(equiv_p + padding, method)[: len(states)]
    for state, audit, d_adj, e_adj in zip(states, audits, diff_adj, equiv_adj, strict=True):
        tests = state.tests
        n = tests.combined.n
        curve = mixture_power(audit.mode, n, providers=m, margin=margin, policy=policy)
        state.power = curve[-1] if curve else 0.0
        state.results = _results(tests, method, level, d_adj, e_adj)
        if state.verdict is not None:
            continue
        if d_adj < policy.alpha:
            crossed = [name for name, e in tests.difference.items() if e.peak >= len(tests.difference) / policy.alpha]
            state.verdict, state.reason = (
                "different",
                (
                    f"e-value {tests.combined.peak:.3g} after {n} completions (p_adj={d_adj:.2g}): "
                    + (", ".join(crossed) or "several tests together")
                ),
            )
        elif e_adj < policy.alpha and state.power >= policy.min_power:
            state.verdict, state.reason = (
                "equivalent",
                (
                    f"{_shown_within(audit.mode, margin)} after {n} completions (p_adj={e_adj:.2g}); extreme "
                    f"shares not shown above their margins; a {policy.mixture_share:.0%} mixture would have been "
                    f"caught with probability {state.power:.3f}, {_power_assumes(audit.mode, margin, policy)}"
                ),
            )
        else:
            needed = mixture_needed(audit.mode, providers=m, margin=margin, policy=policy)
            threshold = TailTest.of(audit.mode, providers=m, margin=margin, policy=policy).threshold
            state.needed = _still_needed(tests, n, threshold, needed, e_adj < policy.alpha)
            state.reason = _undecided(state, n, policy, e_adj, reachable=needed is not None)
    return states


def _power_assumes(mode: str, margin: Margins, policy: Decision) -> str:
    """What the mixture power rests on, said beside it: the coarse part's flag rate (the lower
    end of its measured interval, shipped or calibrated: the verdicts' ``calibration`` says
    which), and none for the faithful part (``TailTest.rate``)."""
    t = TailTest.of(mode, providers=1, margin=margin, policy=policy)
    return f"assuming coarse completions are flagged at {t.detected:.3g} and faithful ones never"


def _shown_within(mode: str, margin: Margins) -> str:
    """What the equivalence tests showed: only the means. The extreme shares are tested for
    difference only (not rejected is not shown within: a faithful-looking provider may sit
    above a tail margin by less than the audit could tell)."""
    sampler = f"mean Φ(rank z) within ½ ± {margin.sampler_equivalence:g}"
    if mode == "logprob":
        return f"mean |Δ logprob| below {margin.mean_abs_dlogprob:g} and {sampler}"
    return sampler


def _blocked(subject: Subject, audit: Audit, policy: Decision) -> str | None:
    """A reason no further probe can fix, or None."""
    others = {name: n for name, n in audit.served_by.items() if not same_provider(name, subject.provider, subject.tag)}
    if audit.attempted and audit.failed / audit.attempted > policy.max_failed_share:
        kinds = ", ".join(f"{k} ×{n}" for k, n in audit.errors.most_common(3)) or "errors"
        return f"{audit.failed} of {audit.attempted} probe requests failed ({kinds})"
    if others:
        return "responses named another provider: " + ", ".join(f"{k} ×{n}" for k, n in others.items())
    return None


def _still_needed(tests: Tests, n: int, threshold: float, mixture_needed: int | None, shown: bool) -> int | None:
    """About how many more completions the verdict needs: the mixture-power requirement
    (exact), and for each equivalence test not yet crossed a plug-in estimate: the size at
    which a bet at the observed mean and variance would grow to ``threshold`` (with the
    mixture's ``log(#bets)`` overhead). None when an observed mean lies on the wrong side
    of its margin (more completions would not show equivalence)."""
    needs = [mixture_needed]
    if not shown:
        for name, (values, m0, side) in tests.bets.items():
            if tests.equivalence[name].peak >= threshold or len(values) < 2:
                continue
            gap = (statistics.fmean(values) - m0) * (1 if side == "greater" else -1)
            if gap <= 0:
                return None
            rate = gap**2 / (2 * max(statistics.variance(values), 1e-6))
            needs.append(math.ceil((math.log(threshold) + math.log(len(sequential.BET_FRACTIONS))) / rate))
    if any(v is None for v in needs):
        return None
    return max(max(v for v in needs if v is not None) - n, 1)


def _undecided(state: State, n: int, policy: Decision, e_adj: float, *, reachable: bool) -> str:
    if e_adj >= policy.alpha:
        why = f"equivalence within the margins not shown after {n} completions (p_adj={e_adj:.2g})"
    else:
        why = f"the power to catch a {policy.mixture_share:.0%} mixture is {state.power:.3f} < {policy.min_power}"
    if not reachable:
        return why + (f"; no audit of up to {MIXTURE_SEARCH_MAX:,} completions would reach that power at the mixture detection "
                      "rate assumed (the tail test flags too few coarse completions beyond its faithful share)")  # fmt: skip
    more = (
        f"; about {state.needed} more completions would be needed"
        if state.needed
        else "; the tests are not converging on equivalence"
    )
    return why + more


def _results(tests: Tests, method: str, level: float, d_adj: float, e_adj: float) -> list[TestResult]:
    combined = tests.combined
    results = [
        TestResult(name="all difference tests (average e-process)", kind="difference", statistic=_finite(combined.peak),
                   p_value=_p(combined, method, level), p_adjusted=d_adj,
                   null="the provider serves the reference's distribution"),
    ]  # fmt: skip
    for name, process in tests.difference.items():
        results.append(TestResult(name=name, kind="difference", statistic=_finite(process.peak),
                                  p_value=_p(process, method, level), p_adjusted=None, null=tests.null[name]))  # fmt: skip
    for name, process in tests.equivalence.items():
        results.append(TestResult(name=name, kind="equivalence", statistic=_finite(process.peak),
                                  p_value=_p(process, method, level), p_adjusted=e_adj, null=tests.null[name]))  # fmt: skip
    return results


def _finite(value: float) -> float:
    if math.isnan(value):
        return 0.0
    return max(min(value, 1e300), -1e300)


# -- effects and baselines (reported; they decide nothing) ---------------------------------


def _estimate(values: Sequence[float], clusters: Sequence[str], rng: np.random.Generator) -> Estimate:
    if not values:
        return Estimate(value=0.0, ci_low=0.0, ci_high=0.0)
    if len(values) < 2:
        return Estimate(value=float(values[0]), ci_low=float(values[0]), ci_high=float(values[0]))
    low, high = stats.bootstrap_ci(values, rng=rng, clusters=list(clusters), n_resamples=1000)
    return Estimate(value=float(np.mean(values)), ci_low=float(low), ci_high=float(high))


def _sequence(values: Sequence[float], alpha: float, scale: float = 1.0) -> Estimate:
    """The mean with its confidence sequence's bounds (valid at any stopping time)."""
    low, high = sequential.confidence_sequence(values, alpha=alpha)
    return Estimate(value=float(np.mean(values)) * scale, ci_low=float(low[-1]) * scale, ci_high=float(high[-1]) * scale)


def effects(audit: Audit, margin: Margins, alpha: float, rng: np.random.Generator) -> dict[str, Estimate]:
    """Effect sizes: confidence sequences for what the tests bet on, bootstrap intervals
    (resampling prompts) for the rest."""
    obs = Observations.of(audit)
    if obs.n == 0:
        return {}
    pit = obs.pit()
    out = {"mean_pit": _sequence(pit, alpha), "rank_z": _estimate(obs.z, obs.probes, rng)}
    flagged = sum(z > margin.sample_tail_z for z in obs.z)
    out["extreme_rank_z_share"] = _share(flagged, obs.n)
    if audit.mode != "logprob":
        provider = [s for s in audit.sampled if s.source == "provider" and s.tokens]
        out["provider_mean_loglik"] = _estimate([s.mean_loglik for s in provider], obs.probes, rng)
        reference = [s for s in audit.sampled if s.source == "reference" and s.tokens]
        if len(reference) >= 2:
            out["reference_rank_z"] = _estimate([s.rank_z for s in reference], [s.probe_id for s in reference], rng)
        return out
    done = [c for c in audit.logprob if c.deltas]
    scale = margin.tail_dlogprob
    out["mean_abs_dlogprob_clipped"] = _sequence([min(s, scale) / scale for s in obs.shift], alpha, scale)
    out["mean_abs_dlogprob"] = _estimate(obs.shift, obs.probes, rng)
    out["max_abs_dlogprob"] = _estimate([max(abs(d) for d in c.deltas) for c in done], obs.probes, rng)
    with_kl = [c for c in done if c.kls]
    out["mean_kl_topk"] = _estimate([statistics.fmean(c.kls) for c in with_kl], [c.probe_id for c in with_kl], rng)
    agree = [statistics.fmean(1.0 if a else 0.0 for a in c.top1_agree) for c in with_kl]
    out["top1_agreement"] = _estimate(agree, [c.probe_id for c in with_kl], rng)
    out["extreme_share"] = _share(sum(s > scale for s in obs.shift), obs.n)
    return out


def _share(k: int, n: int) -> Estimate:
    from scipy.stats import binomtest

    interval = binomtest(k, n).proportion_ci(confidence_level=0.95)
    return Estimate(value=k / n, ci_low=float(interval.low), ci_high=float(interval.high))


def fixed_sample_tests(audit: Audit, margin: Margins, rng: np.random.Generator) -> list[TestResult]:
    """The one-shot tests the stage used before it became sequential, on the first round's
    completions, reported as baselines: t-tests of the mean against its
    margin, binomial tail counts, and in sample mode a stratified permutation test of
    log-likelihood and MMD with a Hamming kernel (Gao et al. 2025) against the reference's
    own samples."""
    obs = Observations.of(audit)
    first = obs.first_round
    shift, z, probes = obs.shift[:first], obs.z[:first], obs.probes[:first]
    out: list[tuple[str, float, float, str]] = []
    if len(z) >= 2:
        centred = stats.one_sided_mean_test(z, threshold=0.0, alternative="greater")
        flagged = sum(v > margin.sample_tail_z for v in z)
        out += [
            ("fixed-sample t-test: rank z above 0", centred.statistic, centred.pvalue, "mean rank z ≤ 0"),
            ("fixed-sample binomial: extreme rank z", float(flagged),
             stats.binomial_tail_test(flagged, len(z), p0=margin.sample_tail_p0), f"share ≤ {margin.sample_tail_p0}"),
        ]  # fmt: skip
    if len(shift) >= 2:
        above = stats.one_sided_mean_test(shift, threshold=margin.mean_abs_dlogprob, alternative="greater")
        flagged = sum(s > margin.tail_dlogprob for s in shift)
        out += [
            ("fixed-sample t-test: mean |Δ logprob| above margin", above.statistic, above.pvalue,
             f"mean |Δ| ≤ {margin.mean_abs_dlogprob}"),
            ("fixed-sample binomial: extreme completions", float(flagged),
             stats.binomial_tail_test(flagged, len(shift), p0=margin.tail_p0), f"share ≤ {margin.tail_p0}"),
        ]  # fmt: skip
    provider = [s for s in audit.sampled if s.source == "provider" and s.tokens and s.probe_id in set(probes)]
    reference = [s for s in audit.sampled if s.source == "reference" and s.tokens]
    sx, sy = [s.probe_id for s in provider], [s.probe_id for s in reference]
    if len(provider) >= 2 and len(reference) >= 2 and len(set(sx) & set(sy)) >= 2:
        x, y = [s.mean_loglik for s in provider], [s.mean_loglik for s in reference]
        loglik = stats.stratified_permutation_test(
            x, y, sx, sy, statistic="mean", alternative="less", n_permutations=2000, rng=rng
        )
        mmd = distances.mmd_hamming_test([s.token_ids for s in provider], [s.token_ids for s in reference], sx, sy,
                                     n_permutations=1000, rng=rng)  # fmt: skip
        out += [
            ("mean log-likelihood, stratified permutation (no margin)", loglik.statistic, loglik.pvalue,
             "exchangeable within prompt"),
            ("MMD, Hamming kernel (Gao et al. 2025)", mmd.statistic, mmd.pvalue, "same distribution"),
        ]  # fmt: skip
    return [TestResult(name=name, kind="baseline", statistic=_finite(s), p_value=p, p_adjusted=None, null=null)
            for name, s, p, null in out]  # fmt: skip


# -- verdicts ------------------------------------------------------------------------------


def verdicts(
    subjects: Sequence[Subject],
    audits: Sequence[Audit],
    margin: Margins,
    policy: Decision,
    *,
    rounds: Sequence[int],
    seed: int,
) -> list[ProviderVerdict]:
    """The final verdicts: every still-undecided provider becomes ``inconclusive`` with the
    completions it would still need. ``rounds[i]`` is how many rounds provider i was audited."""
    rng = np.random.default_rng(seed)
    states = judge(subjects, audits, margin, policy)
    out = []
    for subject, audit, state, n_rounds in zip(subjects, audits, states, rounds, strict=True):
        verdict = state.verdict or "inconclusive"
        combined = state.tests.combined
        obs = Observations.of(audit)
        out.append(
            ProviderVerdict(
                provider=subject.provider,
                tag=subject.tag,
                declared_quantization=subject.declared_quantization,
                survey_decision=subject.survey_decision,
                eligible=verdict == "equivalent" and subject.survey_decision == "candidate",
                mode=audit.mode,  # type: ignore[arg-type]
                verdict=verdict,
                reason=state.reason,
                tests=state.results + fixed_sample_tests(audit, margin, rng),
                effects=effects(audit, margin, policy.alpha, rng),
                power={"mixture": round(state.power, 4)},
                probes_needed=state.needed if verdict == "inconclusive" else None,
                probes=len({c.probe_id for c in audit.logprob} | {s.probe_id for s in audit.sampled}),
                completions=combined.n,
                rounds=n_rounds,
                e_value=_finite(combined.peak),
                e_path=[round(float(w), 6) for w in combined.wealth],
                observed=Observed(
                    shift=[round(v, 6) for v in obs.shift], z=[round(v, 6) for v in obs.z], pit=[round(v, 6) for v in obs.pit()]
                ),
                failed_requests=audit.failed,
                errors=dict(audit.errors),
                tokens=audit.tokens,
                served_by=dict(audit.served_by),
                cost_usd=round(audit.cost_usd, 8),
            )
        )
    return out
