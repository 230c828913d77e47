"""Re-verification during generation: each provider's difference e-process, continued from
the verify stage's audit on a share of its production requests. Pure: observations in,
alarms out; the generate stage sends the requests, scores them and saves the state.

A provider can change what it serves after it was audited (re-quantized, moved, or routing
part of its traffic elsewhere). The monitor tests, after every monitored reply, the null
"this provider has served the reference's distribution all along", against "from some
point on it does not". Its statistic is a mixture over change points (the e-detector idea
of Shin, Ramdas & Rinaldo, "E-detectors: a nonparametric framework for sequential change
detection", 2024), kept a test rather than a detector so its error is a probability:

- the observations are the verify stage's betting observations (:mod:`quanthunt.decision`),
  bet on by the same constant bets (:data:`quanthunt.sequential.BET_FRACTIONS`);
- component 0 continues the verify stage's audit (its observations replayed, then the
  monitored ones); component ``j ≥ 1`` starts fresh at checkpoint ``j``, every
  ``checkpoint_every`` monitored replies, so a change late in a long run is not paid for
  with the wealth a faithful past has cost the earlier components;
- the statistic is ``Σ_j w_j K_j`` with ``w_j = 1 / ((j + 1)(j + 2))`` (weights summing to 1).
  Under the null every ``K_j`` is a test supermartingale, so the mixture is one too, and by
  Ville's inequality it ever reaches ``1 / α`` with probability ≤ α however long the run.
  Dropping components (to bound memory) only lowers it, so that keeps the bound.

When it crosses, the components carrying nearly as much weighted wealth as the best one
(:data:`CHANGE_SET_RATIO`) say where the change may have begun; every record the provider
served from the checkpoint before the earliest of them on is suspect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quanthunt import sequential
from quanthunt.decision import Bet, Observations, sequential_tests
from quanthunt.params import Margins, Sampling

MAX_COMPONENTS = 16
"""Change-point components kept per provider; beyond it the one with the least weighted
wealth is dropped (valid: it only lowers the statistic), never component 0 (the audit's
continuation) nor the newest."""


def weight(checkpoint: int) -> float:
    """The prior weight of a change at ``checkpoint`` (0: before or during the audit)."""
    return 1.0 / ((checkpoint + 1) * (checkpoint + 2))


CHANGE_SET_RATIO = 1000.0
"""Checkpoints whose component holds at least 1/this of the best one's weighted wealth are
all taken as where the change may have begun. Measured (``benchmarks/monitor_drift.py``):
with the best component alone (and one checkpoint back), 8-9 % of 20 % NVFP4 mixtures left
drifted replies outside the quarantine; at 100, 0.5 %; at 1,000, none in the benchmark's runs
while only the logprob shift tests ran (~50-90 faithful monitored replies quarantined besides).
Not enough alone once the sampler's tests run at T 0.7 (:data:`DELAYS_BACK`)."""

DELAYS_BACK = 3
"""How many times the detection's own delay the quarantine reaches back before the change
set. Where a drift shows slowly (the sampler's tests at T 0.7: +0.3 temperature in logprob
mode, NVFP4 in sample mode, a median 52-80 monitored replies), the change set alone left
drifted replies outside the quarantine in up to 8 of 1,000 runs per row; reaching back once
the delay, in 3 runs of the ~6,000 in those rows; twice, in 1; three times, in none of the
benchmark's 1,000 runs of any row, for a median of ~59 faithful monitored replies quarantined
besides a coarse drift, ~105 besides a mixture and 210-295 besides the slow drifts."""


def suspect_from(weighted: Mapping[int, float], *, at: int, every: int) -> int:
    """The first suspect checkpoint, from each component's weighted wealth ``w_j K_j`` at the
    stop (monitored reply ``at``, checkpoints ``every`` replies apart): one before the
    earliest within :data:`CHANGE_SET_RATIO` of the best, then back :data:`DELAYS_BACK`
    times the checkpoints the best one took to cross."""
    top = max(weighted.values())
    best = max(weighted, key=weighted.__getitem__)
    first = min(j for j, w in weighted.items() if w * CHANGE_SET_RATIO >= top)
    took = max(at - best * every, 0) // every + 1
    return max(first - 1 - DELAYS_BACK * took, 0)


@dataclass(frozen=True)
class Observation:
    """One monitored reply as scored at the reference: its mean |Δ logprob| (logprob mode;
    None in sample mode), its rank z and its pit (``measurements.Rank``)."""

    shift: float | None
    z: float
    pit: float | None = None
    """None: Φ(z), what a verdicts file that kept no pits leaves (the pit itself for a text
    as long as the rank statistic's horizon)."""


@dataclass(frozen=True)
class Stop:
    """Why and where a provider's monitor stopped it."""

    at: int
    """The monitored reply (index) whose observation crossed the threshold."""
    e_value: float
    suspect_from: int
    """Records the provider served at this checkpoint or later are suspect."""
    test: str
    """The difference test that gained most since the estimated change."""


@dataclass
class ProviderMonitor:
    """One provider's monitor for one dataset (see the module docstring)."""

    tag: str
    mode: str
    sampler: bool
    """Whether the sampler's tests run: only where generation samples a distribution the
    rank statistics are exact under (:func:`sampler_testable`)."""
    margin: Margins
    threshold: float
    checkpoint_every: int
    served: int = 0
    """Monitored replies so far (each gets the next index; checkpoints count these)."""
    fed: int = 0
    """Indices whose observation (or loss) has been applied, in index order."""
    components: dict[int, np.ndarray] = field(default_factory=dict)
    """Checkpoint → log wealth of each bet (rows) at each fraction (columns)."""
    path: list[tuple[int, float]] = field(default_factory=list)
    """(index, statistic) after each applied observation, for the plot."""
    stopped: Stop | None = None
    _pending: dict[int, Observation | None] = field(default_factory=dict)
    bet_names: list[str] = field(init=False)
    """Each bet's test (a two-sided test has two bets)."""
    _bet_weights: np.ndarray = field(init=False)
    _e_value: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        bets = self._bets(Observation(0.0 if self.mode == "logprob" else None, 0.0))
        self.bet_names = [name for name, _, _ in bets]
        self._bet_weights = np.array([w for _, _, w in bets])
        if not self.components:
            self.components[0] = self._zeros()
        self._refresh()

    def _zeros(self) -> np.ndarray:
        return np.zeros((len(self.bet_names), len(sequential.BET_FRACTIONS)))

    @classmethod
    def start(cls, tag: str, mode: str, *, sampler: bool, margin: Margins, alpha: float, checkpoint_every: int,
              audited: Sequence[Observation]) -> ProviderMonitor:  # fmt: skip
        """A monitor whose component 0 has already bet on the verify stage's ``audited``
        observations (no change point can precede them: they were the audit)."""
        monitor = cls(tag, mode, sampler, margin, 1.0 / alpha, checkpoint_every)
        for observation in audited:
            monitor.components[0] += monitor._log_factors(observation)
        monitor._refresh()
        return monitor

    @property
    def monitored(self) -> bool:
        """Whether any test runs (a sample-mode provider sampled hot or cold has none)."""
        return bool(self.bet_names)

    @property
    def checkpoint(self) -> int:
        """The checkpoint a record served now belongs to."""
        return self.served // self.checkpoint_every

    def next_index(self) -> int:
        """Index for a new monitored reply."""
        self.served += 1
        return self.served - 1

    def _bets(self, observation: Observation) -> list[tuple[str, Bet, float]]:
        """Each flat bet with its test's name and its weight in the averaged statistic."""
        shift = [] if observation.shift is None else [observation.shift]
        pits = None if observation.pit is None else [observation.pit]
        tests = sequential_tests(Observations(self.mode, shift, [observation.z], [""], 0, pits), self.margin,
                                 sampler=self.sampler).difference_bets  # fmt: skip
        return [(name, bet, 1.0 / (len(tests) * len(bets))) for name, bets in tests.items() for bet in bets]

    def _log_factors(self, observation: Observation) -> np.ndarray:
        rows = [
            sequential.log_bet_factors(np.array(x), np.array([m0]), side, sequential.BET_FRACTIONS)[:, 0, 0]
            for _, (x, m0, side), _ in self._bets(observation)
        ]
        return np.array(rows).reshape(len(rows), len(sequential.BET_FRACTIONS))

    def wealth(self, checkpoint: int) -> float:
        """``K_j``: the averaged wealth of the component started at ``checkpoint``."""
        log_wealth = np.minimum(self.components[checkpoint], math.log(sequential.WEALTH_CAP))
        return float(self._bet_weights @ np.exp(log_wealth).mean(axis=1))

    @property
    def e_value(self) -> float:
        """The statistic ``Σ_j w_j K_j`` now (kept up to date by every change: records'
        provenance reads it on the hot path)."""
        return self._e_value

    def _refresh(self) -> float:
        self._e_value = min(sum(weight(j) * self.wealth(j) for j in self.components), sequential.WEALTH_CAP)
        return self._e_value

    def feed(self, index: int, observation: Observation | None) -> Stop | None:
        """Apply the observation of monitored reply ``index`` (None: it could not be scored)
        once every earlier index is in, in index order. Returns the stop if it crosses now."""
        if self.stopped is not None or index < self.fed:
            return None
        self._pending[index] = observation
        while self.fed in self._pending and self.stopped is None:
            self._apply(self._pending.pop(self.fed))
        return self.stopped

    def _apply(self, observation: Observation | None) -> None:
        index = self.fed
        self.fed += 1
        if observation is None:
            return
        checkpoint = index // self.checkpoint_every
        if checkpoint not in self.components:
            self.components[checkpoint] = self._zeros()
        factors = self._log_factors(observation)
        for j in self.components:
            self.components[j] = self.components[j] + factors
        self._prune()
        e_value = self._refresh()
        self.path.append((index, e_value))
        if e_value >= self.threshold:
            self.stopped = self._stop(index, e_value)

    def _prune(self) -> None:
        while len(self.components) > MAX_COMPONENTS:
            newest = max(self.components)
            kept = (0, newest)  # the audit's continuation and the latest start always stay
            weakest = min((j for j in self.components if j not in kept), key=lambda j: weight(j) * self.wealth(j))
            del self.components[weakest]

    def _stop(self, index: int, e_value: float) -> Stop:
        weighted = {j: weight(j) * self.wealth(j) for j in self.components}
        best = max(weighted, key=weighted.__getitem__)
        test = self.bet_names[int(np.argmax(self.components[best].max(axis=1)))]
        suspect = suspect_from(weighted, at=index, every=self.checkpoint_every)
        return Stop(at=index, e_value=e_value, suspect_from=suspect, test=test)

    # -- persistence (the ledger's ``monitors`` table holds this as JSON) ------------------

    def state(self, *, with_path: bool = True) -> dict[str, Any]:
        """What a resumed run needs: counters, components, the stop and (unless the caller
        keeps it apart, as the ledger does) the path."""
        state = {
            "served": self.served,
            "fed": self.fed,
            "threshold": self.threshold,
            "components": {str(j): w.round(12).tolist() for j, w in self.components.items()},
            "stopped": None if self.stopped is None else self.stopped.__dict__,
        }
        if with_path:
            state["path"] = [[i, e] for i, e in self.path]
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. Replies that were monitored but not yet scored when the
        earlier run ended are lost: their indices count as unscored (the order stays).
        A state with only ``served`` (nothing applied yet) keeps the start's components.

        The threshold is the stricter of the saved one and this run's: when datasets or
        providers changed since, the error budget's even split gives another share, and a
        stream may raise its threshold at any time (Ville's bound at the lower α still holds)
        but never lower it after seeing data."""
        if "threshold" in state:
            self.threshold = max(self.threshold, float(state["threshold"]))
        self.served = int(state["served"])
        self.fed = self.served
        if "components" in state:  # else no observation was applied yet: the start's components stand
            self.components = {int(j): np.array(w, dtype=np.float64) for j, w in state["components"].items()}
        self.path = [(int(i), float(e)) for i, e in state.get("path", [])]
        self.stopped = None if state["stopped"] is None else Stop(**state["stopped"])
        self._pending.clear()
        self._refresh()


def sampler_testable(sampling: Sampling) -> bool:
    """Whether the monitor can test the providers' sampler at generation's settings: at a
    temperature in (0, 1] with top-p 1, where the rank statistics under the tempered
    distribution are exact from the reference's top logprobs
    (``measurements.tempered_pit_normal_score``). A nucleus cut or a temperature above 1
    would need the mass the reference does not list."""
    return 0.0 < sampling.temperature <= 1.0 and sampling.top_p == 1.0


def generation_settings(sampling: Sampling) -> dict[str, float | int] | None:
    """The generation settings the monitor's sampler margins hold at, where it tests the
    sampler (``calibration_run.Key.generation``, ``verdicts.Calibration.monitor_settings``)."""
    if not sampler_testable(sampling):
        return None
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}


def rank_temperature(sampling: Sampling) -> float:
    """The temperature the monitor's scorer ranks replies at: generation's where the sampler
    is testable, else 1 (the rank statistics then go unused)."""
    return sampling.temperature if sampler_testable(sampling) else 1.0


def suspect_turn(turn: Mapping[str, Any], suspect: Mapping[str, int]) -> bool:
    """Whether a record's turn came from a stopped provider at or after its first suspect
    checkpoint (``suspect``: tag → checkpoint, ``monitoring.suspect_checkpoints``; a turn
    without a monitor stamp counts as after): what validate quarantines and generate makes
    again (``quanthunt.refill``)."""
    start = suspect.get(str(turn.get("endpoint_tag")))
    return start is not None and int((turn.get("monitor") or {}).get("checkpoint", start)) >= start
