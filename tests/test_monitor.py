"""The generate stage's change monitor (``quanthunt.monitor``) on synthetic observations
whose truth is known (fixed seeds): faithful streams are stopped at most alpha of the time
however long they are watched, a drift is stopped within a few replies with every drifted
reply quarantined, and the bookkeeping (order, unscored replies, saved state, a crash) never
changes the arithmetic."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest
from fixtures.params import SHIPPED

from quanthunt.monitor import MAX_COMPONENTS, Observation, ProviderMonitor, Stop, weight

MARGIN = SHIPPED.verify.margin
Draw = Callable[[np.random.Generator], Observation]


def monitor(
    *, alpha: float = 0.05, every: int = 8, sampler: bool = False, audited: list[Observation] | None = None
) -> ProviderMonitor:
    return ProviderMonitor.start("p/x", "logprob", sampler=sampler, margin=MARGIN, alpha=alpha, checkpoint_every=every,
                                 audited=audited or [])  # fmt: skip


def feed_all(m: ProviderMonitor, observations: list[Observation | None]) -> Stop | None:
    """Each observation as the next monitored reply, in order; the stop, if any."""
    for obs in observations:
        stop = m.feed(m.next_index(), obs)
        if stop is not None:
            return stop
    return None


def below_margin(rng: np.random.Generator) -> Observation:
    """Faithful on other hardware: mean |Δ| ~ |N(0, 0.02)|, far below the 0.08 margin."""
    return Observation(float(abs(rng.normal(0.0, 0.02))), float(rng.normal()))


def tail_boundary(rng: np.random.Generator) -> Observation:
    """Both shift tests exactly at their null's boundary: extreme (> tail_dlogprob) at rate
    tail_p0, otherwise a shift that brings the clipped mean to exactly the margin."""
    if rng.random() < MARGIN.tail_p0:
        return Observation(2 * MARGIN.tail_dlogprob, float(rng.normal()))
    rest = (MARGIN.mean_abs_dlogprob - MARGIN.tail_p0 * MARGIN.tail_dlogprob) / (1 - MARGIN.tail_p0)
    return Observation(rest, float(rng.normal()))


def two_point_boundary(rng: np.random.Generator) -> Observation:
    """The mean test's hardest null: clipped shift 0 or 1 (0.25 is not yet extreme) with mean
    exactly the margin, the most variance a null at the boundary can have."""
    high = rng.random() < MARGIN.mean_abs_dlogprob / MARGIN.tail_dlogprob
    return Observation(MARGIN.tail_dlogprob if high else 0.0, float(rng.normal()))


def flagged(rng: np.random.Generator) -> Observation:
    """An NVFP4-like reply: mean |Δ| ~0.6 (every one extreme), rank z high."""
    return Observation(float(rng.uniform(0.4, 0.9)), float(rng.normal(1.0, 1.0)))


def stop_rate(draw: Draw, *, runs: int, n: int, alpha: float, sampler: bool = False, seed: int = 0) -> float:
    stops = 0
    for run in range(runs):
        rng = np.random.default_rng([seed, run])
        m = monitor(alpha=alpha, every=25, sampler=sampler)
        stops += feed_all(m, [draw(rng) for _ in range(n)]) is not None
    return stops / runs


def upper(alpha: float, runs: int) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)


# -- the statistic ------------------------------------------------------------------------------


def test_weights_sum_to_one_and_a_fresh_monitor_starts_at_component_zeros_weight() -> None:
    assert sum(weight(j) for j in range(100_000)) == pytest.approx(1.0, abs=1e-5)
    m = monitor(alpha=0.01)
    assert m.threshold == pytest.approx(100.0)
    assert m.e_value == pytest.approx(weight(0))  # only component 0, at wealth 1
    assert m.bet_names == ["mean |Δ logprob| above margin", "extreme completions"]
    assert "sampler: extreme rank z" in monitor(sampler=True).bet_names


def test_a_faithful_audit_lowers_component_zero_and_an_extreme_one_raises_it() -> None:
    faithful = monitor(audited=[Observation(0.01, 0.0)] * 40)
    extreme = monitor(audited=[Observation(0.6, 0.0)] * 3)
    assert faithful.e_value < weight(0) / 10
    assert extreme.e_value > 100 * weight(0)


# -- false stops --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("draw", "sampler"),
    [(below_margin, False), (below_margin, True), (tail_boundary, False), (two_point_boundary, False)],
    ids=["below margin", "below margin, sampler tests", "tail boundary", "two-point boundary"],
)
def test_faithful_streams_are_stopped_at_most_alpha_of_the_time(draw: Draw, sampler: bool) -> None:
    # feed() decides after every observation: this rate is already the optionally-stopped one
    runs = 45 if sampler else 70
    assert stop_rate(draw, runs=runs, n=150, alpha=0.05, sampler=sampler) <= upper(0.05, runs)


def test_at_alpha_one_half_the_boundary_null_is_stopped_sometimes_never_more_than_half() -> None:
    rate = stop_rate(two_point_boundary, runs=80, n=150, alpha=0.5)
    # ~8 % in 400 runs: it does bet (a monitor that never bet would give 0), and within Ville's bound
    assert 0.02 <= rate <= upper(0.5, 80)


def test_above_the_margin_the_mean_test_alone_stops_it() -> None:
    # no extreme completion at all, mean |Δ| 0.2 > 0.08: only the mean test can win
    rng = np.random.default_rng(3)
    m = monitor(alpha=0.05 / 24)
    stop = feed_all(m, [Observation(float(rng.uniform(0.15, 0.25)), 0.0) for _ in range(300)])
    assert stop is not None
    assert stop.test == "mean |Δ logprob| above margin"


# -- drift ----------------------------------------------------------------------------------------


def moderate(rng: np.random.Generator) -> Observation:
    """Mean |Δ| 0.15-0.25: well above the margin, never extreme: only the mean test gains."""
    return Observation(float(rng.uniform(0.15, 0.25)), float(rng.normal()))


@pytest.mark.parametrize(
    ("draw", "drift", "within"),
    [(flagged, 600, 5), (flagged, 603, 5), (flagged, 607, 5), (moderate, 601, 30), (moderate, 604, 30), (moderate, 607, 30)],
    ids=["extreme at 600", "extreme at 603", "extreme at 607", "moderate at 601", "moderate at 604", "moderate at 607"],
)
def test_a_drift_is_stopped_soon_and_no_drifted_reply_escapes_quarantine(draw: Draw, drift: int, within: int) -> None:
    # a moderate drift is won by the component that starts after it: the change set must reach back over it
    rng = np.random.default_rng(drift)
    m = monitor(alpha=0.05 / 24, audited=[below_margin(rng) for _ in range(72)])
    stop = feed_all(m, [below_margin(rng) if i < drift else draw(rng) for i in range(drift + 100)])
    assert stop is not None
    assert drift <= stop.at < drift + within
    assert stop.test == ("extreme completions" if draw is flagged else "mean |Δ logprob| above margin")
    assert stop.e_value >= m.threshold
    quarantined_from = stop.suspect_from * m.checkpoint_every
    # every drifted reply, and at most the faithful replies benchmarks/monitor_drift.py measured (≤ 111 of them)
    assert drift - 14 * m.checkpoint_every <= quarantined_from <= drift
    assert m.checkpoint >= stop.suspect_from  # the records served now are in it


def test_the_stop_is_the_first_crossing_and_nothing_is_applied_after_it() -> None:
    rng = np.random.default_rng(5)
    m = monitor(alpha=0.05)
    stop = feed_all(m, [below_margin(rng) for _ in range(30)] + [flagged(rng) for _ in range(20)])
    assert stop is not None and m.stopped == stop
    values = [e for _, e in m.path]
    assert values[-1] >= m.threshold > max(values[:-1])
    assert [i for i, _ in m.path] == list(range(stop.at + 1))
    e_value, fed = m.e_value, m.fed
    assert m.feed(m.next_index(), flagged(rng)) is None
    assert (m.e_value, m.fed, len(m.path)) == (e_value, fed, stop.at + 1)


# -- bookkeeping ----------------------------------------------------------------------------------


def test_out_of_order_replies_are_applied_in_index_order() -> None:
    rng = np.random.default_rng(7)
    observations = [below_margin(rng) for _ in range(3)]
    in_order = monitor(every=2)
    feed_all(in_order, list(observations))
    shuffled = monitor(every=2)
    indices = [shuffled.next_index() for _ in range(3)]
    assert shuffled.feed(indices[2], observations[2]) is None
    assert (shuffled.fed, shuffled.path) == (0, [])  # waits for index 0
    shuffled.feed(indices[0], observations[0])
    assert shuffled.fed == 1
    shuffled.feed(indices[1], observations[1])
    assert shuffled.fed == 3
    assert shuffled.path == in_order.path
    assert shuffled.e_value == in_order.e_value
    assert shuffled.components.keys() == in_order.components.keys() == {0, 1}
    for j, wealth in in_order.components.items():
        assert np.array_equal(shuffled.components[j], wealth)


def test_an_unscored_reply_advances_without_betting() -> None:
    rng = np.random.default_rng(8)
    a, b = below_margin(rng), below_margin(rng)
    with_gap = monitor(every=2)
    without = monitor(every=2)
    with_gap.feed(with_gap.next_index(), a)
    without.feed(without.next_index(), a)
    before = with_gap.e_value
    with_gap.feed(with_gap.next_index(), None)
    assert (with_gap.fed, len(with_gap.path), with_gap.e_value) == (2, 1, before)
    with_gap.feed(with_gap.next_index(), None)  # index 2 opens checkpoint 1 unscored: no component yet
    assert set(with_gap.components) == {0}
    with_gap.feed(with_gap.next_index(), b)
    without.feed(without.next_index(), b)
    assert set(with_gap.components) == {0, 1}
    assert np.array_equal(with_gap.components[0], without.components[0])  # the gap bet nothing
    assert [i for i, _ in with_gap.path] == [0, 3]


def test_state_round_trip_through_json_continues_the_same_run() -> None:
    rng = np.random.default_rng(11)
    audited = [below_margin(rng) for _ in range(72)]
    observations = [below_margin(rng) for _ in range(150)] + [flagged(rng) for _ in range(20)]
    straight = monitor(alpha=0.05 / 24, audited=audited)
    straight_stop = feed_all(straight, list(observations))
    first = monitor(alpha=0.05 / 24, audited=audited)
    assert feed_all(first, observations[:100]) is None
    saved = json.loads(json.dumps(first.state()))
    resumed = monitor(alpha=0.05 / 24, audited=audited)
    resumed.restore(saved)
    assert resumed.state() == saved  # nothing lost or added by the round trip
    resumed_stop = feed_all(resumed, observations[100:])
    assert straight_stop is not None and resumed_stop is not None
    assert (resumed_stop.at, resumed_stop.suspect_from, resumed_stop.test) == (
        straight_stop.at, straight_stop.suspect_from, straight_stop.test)  # fmt: skip
    # state() keeps log wealth to 12 decimals: after the split the same run to ~1e-13, not the same bits
    assert resumed_stop.e_value == pytest.approx(straight_stop.e_value, rel=1e-9)
    assert resumed.e_value == pytest.approx(straight.e_value, rel=1e-9)
    assert [i for i, _ in resumed.path] == [i for i, _ in straight.path]
    assert resumed.path[:100] == straight.path[:100]  # the saved part exactly
    assert [e for _, e in resumed.path] == pytest.approx([e for _, e in straight.path], rel=1e-9)
    assert resumed.components.keys() == straight.components.keys()
    assert (resumed.served, resumed.fed) == (straight.served, straight.fed)
    # a stopped monitor resumes stopped
    again = monitor(alpha=0.05 / 24, audited=audited)
    again.restore(json.loads(json.dumps(resumed.state())))
    assert again.stopped == resumed_stop
    assert again.feed(again.next_index(), flagged(rng)) is None


def test_restore_after_a_crash_counts_replies_in_flight_as_unscored() -> None:
    rng = np.random.default_rng(12)
    crashed = monitor(every=4)
    indices = [crashed.next_index() for _ in range(12)]
    checkpoints = [crashed.checkpoint]
    for i in indices[:9]:  # 9, 10 and 11 were still being scored
        crashed.feed(i, below_margin(rng))
    assert (crashed.served, crashed.fed) == (12, 9)
    resumed = monitor(every=4)
    resumed.restore(json.loads(json.dumps(crashed.state())))
    assert (resumed.served, resumed.fed) == (12, 12)
    assert resumed.checkpoint == crashed.checkpoint == 3
    path = list(resumed.path)
    assert resumed.feed(10, below_margin(rng)) is None  # a lost reply arriving late is ignored
    assert resumed.path == path
    for _ in range(6):
        index = resumed.next_index()
        checkpoints.append(resumed.checkpoint)
        resumed.feed(index, below_margin(rng))
        assert resumed.fed == index + 1  # applied at once: nothing waits for the lost ones
    assert index == 17
    assert checkpoints == sorted(checkpoints) and checkpoints[-1] == 18 // 4
    assert [i for i, _ in resumed.path] == [*range(9), *range(12, 18)]


def test_pruning_bounds_the_components_and_keeps_the_audit_and_the_newest() -> None:
    rng = np.random.default_rng(13)
    m = monitor(every=1, audited=[below_margin(rng) for _ in range(20)])
    feed_all(m, [below_margin(rng) for _ in range(3 * MAX_COMPONENTS)])
    assert len(m.components) == MAX_COMPONENTS
    assert {0, 3 * MAX_COMPONENTS - 1} <= set(m.components)
    assert m.e_value == pytest.approx(sum(weight(j) * m.wealth(j) for j in m.components), rel=1e-12)


def test_restore_from_a_state_with_nothing_applied_keeps_the_audit() -> None:
    audited = [Observation(0.01, 0.0)] * 30
    started = monitor(audited=audited)
    resumed = monitor(audited=audited)
    resumed.restore({"served": 5, "stopped": None})
    assert (resumed.served, resumed.fed, resumed.path) == (5, 5, [])
    assert np.array_equal(resumed.components[0], started.components[0])
    assert resumed.e_value == started.e_value


@pytest.mark.parametrize(
    ("saved_alpha", "now_alpha", "kept_alpha"), [(0.05 / 24, 0.05 / 8, 0.05 / 24), (0.05 / 8, 0.05 / 24, 0.05 / 24)]
)
def test_restore_keeps_the_stricter_threshold_when_the_split_changed(
    saved_alpha: float, now_alpha: float, kept_alpha: float
) -> None:
    """Fewer providers or datasets than when the monitor started would give it a larger
    share of alpha: the saved, stricter threshold stands; more of them tighten it."""
    rng = np.random.default_rng(14)
    audited = [below_margin(rng) for _ in range(24)]
    earlier = monitor(alpha=saved_alpha, audited=audited)
    assert feed_all(earlier, [below_margin(rng) for _ in range(10)]) is None
    resumed = monitor(alpha=now_alpha, audited=audited)
    resumed.restore(json.loads(json.dumps(earlier.state())))
    assert resumed.threshold == pytest.approx(1 / kept_alpha)
    assert resumed.state()["threshold"] == pytest.approx(1 / kept_alpha)
