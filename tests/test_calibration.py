"""Margins from a control's completions: widened to what was measured, never narrowed."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.params import SHIPPED, changed
from scipy.stats import norm

from quanthunt.calibration import (
    BOUNDS,
    GENERATION_BOUNDS,
    MEAN_MARGIN_FACTOR,
    TAIL_OVER_MARGIN,
    Faithful,
    Sampled,
    at_generation,
    calibrate,
    detection,
    mean_interval,
    share_interval,
)

MARGIN = SHIPPED.verify.margin
EACH = 1 - 0.05 / BOUNDS


def control(shift: float, *, n: int = 288, z_mean: float = 0.0, seed: int = 0) -> Faithful:
    rng = np.random.default_rng(seed)
    shifts = np.abs(rng.normal(shift, shift / 3, n)).tolist()
    return Faithful("box", shifts, rng.normal(z_mean, 1, n).tolist(), rng.normal(z_mean, 1, n).tolist())


def test_share_interval_is_one_sided_clopper_pearson() -> None:
    assert share_interval(0, 288, confidence=0.95) == (0.0, pytest.approx(1 - 0.05 ** (1 / 288)))  # 0.0103: "0 of 288"
    assert share_interval(50, 50, confidence=0.95) == (pytest.approx(0.05 ** (1 / 50)), 1.0)
    low, high = share_interval(6, 288, confidence=0.95)
    assert low < 6 / 288 < high < 0.045
    assert 0.2 < share_interval(100, 288, confidence=0.95)[0] < 100 / 288
    with pytest.raises(ValueError, match="0 ≤ flagged ≤ n"):
        share_interval(3, 2, confidence=0.95)


def test_mean_interval_holds_the_mean_and_narrows_with_n() -> None:
    rng = np.random.default_rng(1)
    small = mean_interval(rng.uniform(0.2, 0.4, 50).tolist(), confidence=0.95)
    large = mean_interval(rng.uniform(0.2, 0.4, 2000).tolist(), confidence=0.95)
    assert small[0] < 0.3 < small[1] and large[0] < 0.3 < large[1]
    assert large[1] - large[0] < small[1] - small[0]


def test_a_quiet_control_keeps_the_mean_margin_and_bounds_the_unmeasured_shares() -> None:
    used, bounds = calibrate(MARGIN, control(0.02), confidence=0.95)
    assert used.mean_abs_dlogprob == MARGIN.mean_abs_dlogprob  # 2 x its bound is below 0.08
    by_name = {b.margin: b for b in bounds}
    assert not by_name["mean_abs_dlogprob"].widened and by_name["mean_abs_dlogprob"].bound < MARGIN.mean_abs_dlogprob / 2
    # no completion beyond the tail, yet 0 of 288 bounds the rate only by ~1.7 % at 1 - 0.05/8, not the shipped 0.1 %
    assert used.tail_p0 == pytest.approx(share_interval(0, 288, confidence=EACH)[1]) and used.tail_p0 > 10 * MARGIN.tail_p0
    # an exact sampler's z: ~2.3 % beyond 2, whose upper bound is above the shipped 3.5 %
    assert used.sample_tail_p0 >= max(by_name["sample_tail_p0 (listed)"].bound, by_name["sample_tail_p0 (sample)"].bound)
    assert used.sampler_equivalence >= used.sampler_shift >= MARGIN.sampler_shift
    assert {b.margin for b in bounds} == {
        "mean_abs_dlogprob", "tail_p0", "sample_tail_p0 (listed)", "sampler_shift (listed)", "sample_tail_p0 (sample)",
        "sampler_shift (sample)",
    }  # fmt: skip


def test_a_noisy_control_widens_the_mean_margin_to_twice_its_bound() -> None:
    used, bounds = calibrate(MARGIN, control(0.06), confidence=0.95)
    (mean,) = (b for b in bounds if b.margin == "mean_abs_dlogprob")
    assert mean.widened and mean.measured == pytest.approx(0.06, abs=0.005)
    assert used.mean_abs_dlogprob == pytest.approx(MEAN_MARGIN_FACTOR * mean.bound) and mean.bound > mean.measured


def test_a_shifted_sampler_widens_the_sampler_margins() -> None:
    used, bounds = calibrate(MARGIN, control(0.02, z_mean=0.4), confidence=0.95)
    shifted = [b for b in bounds if b.margin.startswith("sampler_shift")]
    assert all(b.widened for b in shifted) and used.sampler_shift == max(b.bound for b in shifted) > 0.1
    assert used.sample_tail_p0 > 0.06  # z shifted up by 0.4: ~5.5 % beyond 2


def test_margins_are_never_narrowed() -> None:
    wide = changed(MARGIN, tail_p0=0.2, sample_tail_p0=0.3, sampler_shift=0.3, sampler_equivalence=0.4, mean_abs_dlogprob=0.2)
    used, bounds = calibrate(wide, control(0.02), confidence=0.95)
    assert used == wide and not any(b.widened for b in bounds)


def test_a_control_noisier_than_the_extreme_threshold_moves_the_threshold_up() -> None:
    used, bounds = calibrate(MARGIN, control(0.2), confidence=0.95)
    by_name = {b.margin: b for b in bounds}
    assert by_name["tail_dlogprob"].widened
    assert used.tail_dlogprob == pytest.approx(TAIL_OVER_MARGIN * used.mean_abs_dlogprob, rel=0.01)  # bounded until still
    assert used.tail_dlogprob >= TAIL_OVER_MARGIN * used.mean_abs_dlogprob
    assert used.mean_abs_dlogprob >= MEAN_MARGIN_FACTOR * by_name["mean_abs_dlogprob"].bound > 0.4  # clipped at the new tail
    assert used.tail_p0 == by_name["tail_p0"].bound  # the share beyond the new threshold, bounded
    with pytest.raises(ValueError, match="control box: need the same number"):
        calibrate(MARGIN, Faithful("box", [0.1], [], []), confidence=0.95)
    with pytest.raises(ValueError, match=r"control box: 6 completions bound .* measure more completions"):
        calibrate(MARGIN, control(0.0, n=6), confidence=0.95)  # no noise, but too few to bound it


def test_detection_rates_are_the_coarse_builds_lower_bounds() -> None:
    rng = np.random.default_rng(2)
    coarse = Faithful("nvfp4", np.abs(rng.normal(0.6, 0.15, 288)).tolist(), [], rng.normal(0.3, 1.3, 288).tolist())
    decision = SHIPPED.verify.decision
    used, bounds = detection(decision, MARGIN, coarse, confidence=0.95)
    by_name = {b.margin: b for b in bounds}
    logprob, sample = by_name["mixture_detection_logprob"], by_name["mixture_detection_sample"]
    assert logprob.measured > 0.9 and logprob.bound < logprob.measured
    assert (
        used.mixture_detection_logprob
        == logprob.bound
        == pytest.approx(share_interval(round(logprob.measured * 288), 288, confidence=1 - 0.05 / 2)[0])
    )
    assert 0.03 < sample.bound < sample.measured < 0.15 and used.mixture_detection_sample == sample.bound  # ~9.5 % flagged
    assert sample.widened  # a lower detection rate than shipped claims less power: looser
    assert used.mixture_share == decision.mixture_share  # nothing else moves
    with pytest.raises(ValueError, match="never flagged"):
        detection(decision, MARGIN, Faithful("fp8", [0.01] * 10, [], [0.0] * 10), confidence=0.95)


def sampled(z_mean: float, *, n: int = 288, seed: int = 3) -> Sampled:
    z = np.random.default_rng(seed).normal(z_mean, 1, n)
    return Sampled("box", z.tolist(), [float(v) for v in norm.cdf(z)])


def test_the_generations_sampler_margins_widen_to_the_controls_bounds_there() -> None:
    """At the generation's temperature a deployment's noise shifts the tempered ranks more
    than at the audit's T 1: a control whose ranks there sit 0.4 high widens the monitor's
    sampler margins to their bounds, and nothing else."""
    used, bounds = at_generation(MARGIN, sampled(0.4), confidence=0.95)
    assert [b.margin for b in bounds] == ["sample_tail_p0 (generation)", "sampler_shift (generation)"]
    tail, shift = bounds
    z = sampled(0.4).z
    flagged = sum(v > MARGIN.sample_tail_z for v in z)
    each = 1 - 0.05 / GENERATION_BOUNDS
    assert tail.measured == flagged / 288 and tail.bound == share_interval(flagged, 288, confidence=each)[1]
    assert used.sample_tail_p0 == tail.bound > MARGIN.sample_tail_p0 and used.sampler_shift == shift.bound > 0.1
    assert used.sampler_equivalence >= used.sampler_shift
    unchanged = {f for f in type(MARGIN).model_fields if f not in {"sample_tail_p0", "sampler_shift", "sampler_equivalence"}}
    assert all(getattr(used, f) == getattr(MARGIN, f) for f in unchanged)


def test_the_generations_sampler_margins_are_never_narrowed() -> None:
    wide = changed(MARGIN, sample_tail_p0=0.3, sampler_shift=0.3, sampler_equivalence=0.4)
    used, bounds = at_generation(wide, sampled(0.0), confidence=0.95)
    assert used == wide and not any(b.widened for b in bounds)
    with pytest.raises(ValueError, match="control box: need the same number"):
        at_generation(MARGIN, Sampled("box", [0.1, 0.2], [0.5]), confidence=0.95)
