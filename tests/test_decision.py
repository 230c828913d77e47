"""Sequential decisions on simulated audits whose truth is known (fixed seeds): what each
kind of provider comes out as, how many completions it takes, and that looking after every
round does not make a faithful provider ``different`` more often than alpha."""

from __future__ import annotations

import random
import statistics

import pytest
from fixtures.params import SHIPPED, changed

from quanthunt import decision, sequential
from quanthunt.decision import MIXTURE_SEARCH_MAX, Subject, TailTest, judge, mixture_needed, mixture_power, verdicts
from quanthunt.measurements import Audit, LogprobCompletion, SampledText
from quanthunt.params import Margins

NORMAL = statistics.NormalDist()
"""Simulated completions are as long as the horizon: their pit is Φ(z)."""
MARGIN = changed(SHIPPED.verify.margin, sampler_equivalence=0.15)
"""Φ(z) varies as much as a uniform does; the shipped 0.1 is for real texts, mostly shorter
than the horizon, whose pit varies far less (``benchmarks/verify_power.py``)."""
POLICY = changed(SHIPPED.verify.decision, mixture_detection_logprob=1.0, mixture_detection_sample=0.6)


def logprob_audit(name: str, *, n: int, scale: float, z_shift: float = 0.0, extreme_share: float = 0.0, seed: int = 0) -> Audit:
    """``n`` completions of 24 tokens: Δ ~ N(0, scale) per token (0.8 for an extreme one)
    and rank z ~ N(z_shift, 1) (a faithful sampler's is N(0, 1))."""
    rng = random.Random(seed)
    audit = Audit(name, f"{name.lower()}/x", "logprob", attempted=n, first_round_end=12)
    for i in range(n):
        extreme = rng.random() < extreme_share
        deltas = [rng.gauss(0, 0.8 if extreme else scale) for _ in range(24)]
        z = rng.gauss(2.5 if extreme else z_shift, 1.0)
        audit.logprob.append(LogprobCompletion(f"p{i}", 0, 24, 24, deltas, [0.0] * 24, [True] * 24, z, NORMAL.cdf(z), i))
        audit.served_by[name] += 1
    return audit


def sample_audit(name: str, *, n: int, z_shift: float = 0.0, extreme_share: float = 0.0, seed: int = 0) -> Audit:
    rng = random.Random(seed)
    audit = Audit(name, f"{name.lower()}/x", "sample", attempted=n, first_round_end=36)
    for i in range(n):
        z = rng.gauss(2.5 if rng.random() < extreme_share else z_shift, 1.0)
        audit.sampled.append(SampledText(f"p{i // 3}", i % 3, "provider", [1, 2, i], -2.0, z, NORMAL.cdf(z), 24, i))
        audit.served_by[name] += 1
    return audit


def subject(audit: Audit) -> Subject:
    return Subject(audit.provider, audit.tag, "unknown", "candidate")


def outcome(audits: list[Audit], *, margin: Margins = MARGIN, family: int | None = None) -> dict[str, decision.State]:
    judged = judge([subject(a) for a in audits], audits, margin, POLICY, family=family)
    return {a.provider: s for a, s in zip(audits, judged, strict=True)}


def test_logprob_mode_finds_precision_mixtures_and_the_sampler() -> None:
    audits = [
        logprob_audit("Faithful", n=150, scale=1e-6),
        logprob_audit("Bf16", n=150, scale=0.04, z_shift=0.05, seed=1),
        logprob_audit("Nvfp4", n=150, scale=0.7, z_shift=1.5, seed=2),
        logprob_audit("Mixture", n=150, scale=0.04, extreme_share=0.2, seed=3),
        logprob_audit("Hot", n=150, scale=1e-6, z_shift=1.0, seed=4),  # exact numbers, hotter sampler
        logprob_audit("Cold", n=150, scale=1e-6, z_shift=-1.0, seed=5),
    ]
    states = outcome(audits)
    assert states["Faithful"].verdict == "equivalent" and states["Bf16"].verdict == "equivalent"
    for name in ("Nvfp4", "Mixture", "Hot", "Cold"):
        assert states[name].verdict == "different", (name, states[name].reason)
    assert "extreme completions" in states["Mixture"].reason
    assert "sampler" in states["Hot"].reason and "sampler" in states["Cold"].reason
    assert states["Faithful"].power >= POLICY.min_power
    # the power is printed with what it assumes (issue 25 §2): the coarse rate, by value, and no faithful flags
    assert (f"caught with probability {states['Faithful'].power:.3f}, assuming coarse completions are flagged at "
            f"{POLICY.mixture_detection_logprob:.3g} and faithful ones never") in states["Faithful"].reason  # fmt: skip


def test_the_mixture_power_credits_no_faithful_flags() -> None:
    """Issue 25 §2: a faithful completion may be flagged at up to the margin's rate, but no
    audit measures how rarely, and one that never is leaves the mixture only its coarse
    share's flags. The power behind ``equivalent`` is computed so: at a calibrated-looking
    ``tail_p0`` of 0.049 (where crediting it let 7.5-15.5 % of 20 % mixtures through as
    equivalent, README) it needs more completions than the credited rate would, and a
    provider audited between the two is not called equivalent."""
    margin = MARGIN.model_copy(update={"tail_p0": 0.049})
    tail = TailTest.of("logprob", providers=8, margin=margin, policy=POLICY)
    assert tail.rate == pytest.approx(POLICY.mixture_share * POLICY.mixture_detection_logprob)
    needed = mixture_needed("logprob", providers=8, margin=margin, policy=POLICY)
    credited = sequential.completions_for_e_tail(tail.rate + (1 - POLICY.mixture_share) * tail.p0, p0=tail.p0,
                                                 threshold=tail.threshold, power=POLICY.min_power, weight=tail.weight,
                                                 max_n=MIXTURE_SEARCH_MAX)  # fmt: skip
    assert needed is not None and credited is not None and needed > credited
    between = (needed + credited) // 2
    assert mixture_power("logprob", between, providers=8, margin=margin, policy=POLICY)[-1] < POLICY.min_power
    states = outcome([logprob_audit("Faithful", n=between, scale=1e-6)], margin=margin, family=8)
    assert states["Faithful"].verdict != "equivalent" and states["Faithful"].power < POLICY.min_power


def test_sample_mode_decides_both_ways() -> None:
    audits = [
        sample_audit("Same", n=240, seed=1),
        sample_audit("Shifted", n=240, z_shift=0.8, seed=2),
        sample_audit("Mixture", n=240, extreme_share=0.2, seed=3),
    ]
    states = outcome(audits)
    assert states["Same"].verdict == "equivalent", states["Same"].reason
    assert states["Shifted"].verdict == "different" and states["Mixture"].verdict == "different"
    # It says what was shown (the mean), never that every margin holds: the extreme-z share
    # is only tested for difference (issue 26: a 0.051 share was reported "within" 0.035).
    reason = states["Same"].reason
    assert reason.startswith(f"mean Φ(rank z) within ½ ± {MARGIN.sampler_equivalence:g} after 240 completions"), reason
    assert "every margin" not in reason and "extreme shares not shown above their margins" in reason


def test_equivalence_waits_for_the_power_to_catch_a_mixture() -> None:
    """A faithful provider after one round of 12 is not yet ``equivalent``: a 20 % mixture
    would slip through too often; the state says how many more completions it needs."""
    (state,) = judge([subject(a := logprob_audit("Early", n=12, scale=1e-6))], [a], MARGIN, POLICY)
    assert state.verdict is None and state.power < POLICY.min_power
    assert state.needed is not None and state.needed > 0
    assert f"about {state.needed} more completions" in state.reason
    needed = decision.mixture_needed("logprob", providers=1, margin=MARGIN, policy=POLICY)
    assert needed is not None and state.needed >= needed - 12


def test_looking_after_every_round_keeps_the_false_different_rate_below_alpha() -> None:
    """200 faithful providers (bf16-like numbers, a faithful sampler), judged after every
    round of 12 up to 96 completions as the stage does, stopping at the first verdict."""
    wrong = 0
    for seed in range(200):
        full = logprob_audit("F", n=96, scale=0.04, z_shift=0.0, seed=seed)
        for end in range(12, 97, 12):
            audit = Audit("F", "f/x", "logprob", attempted=end, first_round_end=12)
            audit.logprob = full.logprob[:end]
            audit.served_by["F"] = end
            (state,) = judge([subject(audit)], [audit], MARGIN, POLICY)
            if state.verdict is not None:
                wrong += state.verdict == "different"
                break
    assert wrong / 200 <= POLICY.alpha


@pytest.mark.parametrize("correction", ["holm", "bh"])
def test_a_crossing_mid_audit_stays_caught_under_either_correction(correction: str) -> None:
    """Off for its first 3 completions (extreme deltas), faithful for the next 300: the
    combined wealth crossed the family's threshold early and has fallen far below it by the
    end. The power programme counts that crossing as caught, so both corrections must too
    (e-BH on the round's end wealth had called it ``equivalent``)."""
    audit = logprob_audit("Early", n=303, scale=1e-4)
    for completion in audit.logprob[:3]:
        completion.deltas[:] = [0.8] * len(completion.deltas)
    (state,) = judge([subject(audit)], [audit], MARGIN, changed(POLICY, correction=correction), family=8)
    assert state.tests.combined.peak >= 8 / POLICY.alpha > state.tests.combined.final
    assert state.verdict == "different", state.reason


def test_failures_and_misrouting_are_inconclusive_at_once() -> None:
    failing = logprob_audit("Flaky", n=12, scale=1e-6)
    failing.attempted, failing.failed = 20, 8
    failing.errors["http_503"] = 24
    rerouted = logprob_audit("Rerouted", n=24, scale=1e-6)
    rerouted.served_by["Someone Else"] = 3
    states = outcome([failing, rerouted])
    assert states["Flaky"].verdict == "inconclusive" and "8 of 20 probe requests failed (http_503 ×24)" in states["Flaky"].reason
    assert states["Rerouted"].verdict == "inconclusive" and "Someone Else ×3" in states["Rerouted"].reason


def test_verdicts_report_the_sequence_and_the_fixed_sample_baselines() -> None:
    audits = [logprob_audit("Faithful", n=120, scale=1e-6), sample_audit("Slow", n=12, seed=3)]
    out = verdicts([subject(a) for a in audits], audits, MARGIN, POLICY, rounds=[10, 1], seed=0)
    faithful, slow = out
    assert faithful.verdict == "equivalent" and faithful.eligible and faithful.rounds == 10
    assert len(faithful.e_path) == 120 and faithful.e_value == max([1.0, *faithful.e_path])
    assert {t.kind for t in faithful.tests} == {"difference", "equivalence", "baseline"}
    baseline = [t.name for t in faithful.tests if t.kind == "baseline"]
    assert "fixed-sample binomial: extreme completions" in baseline
    assert faithful.effects["mean_pit"].ci_low < 0.5 < faithful.effects["mean_pit"].ci_high
    assert slow.verdict == "inconclusive" and slow.probes_needed is not None
    for v in out:
        for t in v.tests:
            assert t.p_adjusted is None or t.p_adjusted >= t.p_value


@pytest.mark.parametrize("mode", ["logprob", "sample"])
def test_mixture_power_is_the_tail_tests_share(mode: str) -> None:
    curve = decision.mixture_power(mode, 400, providers=8, margin=MARGIN, policy=POLICY)
    assert curve == sorted(curve) and 0 <= curve[0] <= curve[-1] <= 1
    needed = decision.mixture_needed(mode, providers=8, margin=MARGIN, policy=POLICY)
    assert needed is not None and curve[needed - 1] >= POLICY.min_power > curve[needed - 2]
