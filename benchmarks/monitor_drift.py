"""False stops, detection delay, quarantine and cost of the generate stage's monitor, on the
sandbox's real precisions.

Usage: ``.venv/bin/python benchmarks/monitor_drift.py [--runs 1000] [--replies 2000] [--seed 0]``

The monitor is :class:`quanthunt.monitor.ProviderMonitor` with the shipped defaults
(``generate.monitor`` in params.yaml; ``alpha`` split across the eligible providers and the
datasets as :func:`quanthunt.monitoring.monitors_for` splits it: 4 eligible providers in the
default roster, the README's verify table, times 6 datasets). Its observations come from the
``power_pools.py`` pools (cached; built once, ~1 hour): each pooled completion's mean |Δ
logprob| against the reference and its rank z at the reference's top 5, computed as the verify
stage computes them, on the completion's first 48 tokens (``generate.sampling.max_tokens``) for
monitored replies and on all 64 (``verify.probes.max_tokens``) for the audit. Every run first
replays a 72-completion faithful audit (the verify stage's typical faithful audit, from the
provider's T = 1 pool) into component 0, then feeds ``--replies`` monitored replies, each a
pooled completion drawn i.i.d. with a generator seeded by (seed, row, run).

- **False stops**: faithful streams, ``--runs`` runs each, in both modes: ``temperature -0.3``
  (the native model sampled at T = 0.7, the generate stage's default temperature) and
  ``int4-bf16act at T 0.7`` (bf16 compute noise at 0.7), ranked as the monitor ranks them there
  (``measurements.tempered_pit_normal_score``, by the reference's top 20), and ``int4-native`` /
  ``int4-bf16act`` at T = 1 (logprob mode). The share of runs ever stopped must be at most the
  per-provider alpha; Ville's inequality also bounds the share ever reaching any lower level c
  by 1/c, which this checks with far more resolution.
- **Detection**: the same runs drift, at a reply drawn uniformly from the checkpoint that
  starts after 30 % of their replies or after 1,000 (a long past), to NVFP4, MXFP4,
  INT4-g128, the substitute model, a sampler +0.3 hotter, or to routing a
  ``verify.decision.mixture_share`` share of the provider's traffic to NVFP4. Replies from the
  drift to the stop, the faithful replies quarantined with the drifted ones (the stop
  quarantines from checkpoint ``suspect_from``), and drifted replies that escape the
  quarantine (must be 0). At T = 0.7, NVFP4 (and the mixture's share) come from a pool sampled
  at 0.7 and the +0.3 drift is the native model at 1.0; MXFP4, INT4-g128 and the substitute have
  no pool at 0.7 and use their T = 1 completions.
- **Cost**: monitored requests per provider per 1M output tokens, and the reference's time
  to score one 48-token reply teacher-forced (timed on this machine with the sandbox's
  reference model).

The runs are vectorised: all runs of a row advance together on log wealth (the monitor's own
per-observation factors, weights, pruning and stop rule); ``--check`` runs of every row are
replayed through ``ProviderMonitor`` itself and must agree exactly on every stop and to 1e-9 on
the statistic. ~1 minute on 2 cores at the defaults (the reference timing included).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import textwrap
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from power_pools import Item, load_pools
from scipy.special import logsumexp
from scipy.stats import beta

from quanthunt import sequential
from quanthunt.measurements import RANK_TOP_K, rank
from quanthunt.monitor import MAX_COMPONENTS, Observation, ProviderMonitor, Stop, suspect_from
from quanthunt.monitoring import LOGPROB_TOP
from quanthunt.params import Margins, Params, load_params

ROOT = Path(__file__).resolve().parents[1]
ELIGIBLE = 4
"""Eligible providers of the default roster (Moonshot AI, Fireworks, Parasail, Novita: the
README's verify table; reports/verify/verdicts.json when a run left one)."""
AUDIT = 72
"""Completions of a faithful provider's audit (Fireworks' in the README's verify table)."""
POOL_TOKENS = 64
"""The pools' longest completion (most end at their stop token first: a median 25-32 tokens)."""
LONG_PAST = 1000
"""The second drift time: after this many faithful monitored replies."""
AT_T1 = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "int4-g128": "int4-g128", "substitute": "substitute", "mixture": "nvfp4",
         "temperature +0.3": "temperature +0.3"}  # fmt: skip
"""Each drift's pool at generation T = 1 (a mixture routes its share to NVFP4)."""
AT_T07 = AT_T1 | {"nvfp4": "nvfp4 at T 0.7", "mixture": "nvfp4 at T 0.7", "temperature +0.3": "int4-native"}
"""... at T = 0.7: NVFP4 sampled at 0.7, a +0.3 drift is the native model at 1.0; MXFP4, INT4-g128
and the substitute have no pool at 0.7 and use their T = 1 completions (hotter than the drift)."""


@dataclass(frozen=True)
class Base:
    """A faithful provider at a generation temperature."""

    label: str
    mode: str
    stream: str
    """The pool its monitored replies come from."""
    audit: str
    """The pool its verify-stage audit came from (always T = 1)."""
    temperature: float
    drifts: dict[str, str]
    """The detection rows started from it: drift → its pool (none: false stops only)."""


BASES = (
    Base("T=0.7 (default)", "logprob", "temperature -0.3", "int4-native", 0.7, AT_T07),
    Base("T=0.7, bf16 compute", "logprob", "int4-bf16act at T 0.7", "int4-bf16act", 0.7, {}),
    Base("T=0.7, sample mode", "sample", "temperature -0.3", "int4-native", 0.7,
         {k: AT_T07[k] for k in ("nvfp4", "mixture", "temperature +0.3")}),
    Base("T=0.7, sample, bf16", "sample", "int4-bf16act at T 0.7", "int4-bf16act", 0.7, {}),
    Base("T=1", "logprob", "int4-native", "int4-native", 1.0, AT_T1),
    Base("T=1, bf16 compute", "logprob", "int4-bf16act", "int4-bf16act", 1.0, {}),
)  # fmt: skip


def observation(item: Item, tokens: int, mode: str, *, temperature: float, listed: int, horizon: int) -> Observation:
    """A reply's observation as the monitor's scoring makes it (the verify stage's, for the
    audit: its probes at T = 1, ranked by the top 5 in logprob mode)."""
    seed = f"{item.probe}:{item.token_ids[:tokens]}"
    ranks = rank(item.positions(listed)[:tokens], listed=listed, seed=seed, horizon=horizon, temperature=temperature)
    shift = statistics.fmean(abs(d) for d in item.deltas[:tokens]) if mode == "logprob" else None
    return Observation(shift, ranks.z, ranks.pit)


@dataclass
class Setup:
    """The monitor every run of a row starts as."""

    mode: str
    margin: Margins
    alpha: float
    every: int
    horizon: int
    """The rank statistics' tokens (``verify.decision.mixture_detection_tokens``)."""
    sampler: bool = True
    """Whether the sampler's tests run (``monitor.sampler_testable``)."""

    def monitor(self, audited: list[Observation]) -> ProviderMonitor:
        return ProviderMonitor.start("p", self.mode, sampler=self.sampler, margin=self.margin, alpha=self.alpha,
                                     checkpoint_every=self.every, audited=audited)  # fmt: skip


@dataclass
class Table:
    """A pool's observations and the monitor's log factors of each (rows: items)."""

    observations: list[Observation]
    factors: np.ndarray

    @classmethod
    def of(cls, items: list[Item], tokens: int, setup: Setup, *, temperature: float, listed: int) -> Table:
        template = setup.monitor([])
        observations = [
            observation(i, tokens, setup.mode, temperature=temperature, listed=listed, horizon=setup.horizon) for i in items
        ]
        return cls(observations, np.array([template._log_factors(o).ravel() for o in observations]))


@dataclass
class Stream:
    """Every run's monitored replies: faithful, or from ``at`` on the drift's wherever ``mask``
    says (each run's drift time, and a mixture's share)."""

    faithful: Table
    idx: np.ndarray
    drift: Table | None = None
    at: int = 0
    drift_idx: np.ndarray | None = None
    mask: np.ndarray | None = None

    def factors(self, runs: np.ndarray, t: int) -> np.ndarray:
        out = self.faithful.factors[self.idx[runs, t]]
        if self.drift is not None and t >= self.at:
            assert self.drift_idx is not None and self.mask is not None
            j = t - self.at
            out = np.where(self.mask[runs, j, None], self.drift.factors[self.drift_idx[runs, j]], out)
        return out

    def observations(self, run: int) -> list[Observation]:
        out = [self.faithful.observations[i] for i in self.idx[run]]
        if self.drift is not None:
            assert self.drift_idx is not None and self.mask is not None
            for j, (i, drifted) in enumerate(zip(self.drift_idx[run], self.mask[run], strict=True)):
                if drifted:
                    out[self.at + j] = self.drift.observations[i]
        return out


@dataclass
class Batch:
    """Runs of one monitor advanced in lockstep: the monitor's arithmetic vectorised.

    Every live component gets the same factors, so component ``j``'s log wealth is
    ``S − off_j`` (``S``: the factors summed so far; ``off_j``: ``S`` when it started, minus the
    audit for component 0), and the statistic is ``Σ_c cw_c exp(S_c) Σ_j w_j exp(−off_j,c)``:
    the inner sum (``log_a``, in logs) changes only when a component starts or is pruned.
    """

    setup: Setup
    names: list[str]
    cw: np.ndarray
    """Weight of each (bet, fraction) column in a component's wealth."""
    runs: np.ndarray
    s: np.ndarray
    off: np.ndarray
    ckpt: np.ndarray
    """Each slot's checkpoint (−1: free); MAX_COMPONENTS + 1 slots."""
    peak: np.ndarray
    last: np.ndarray
    t: int = 0
    stops: dict[int, Stop] = field(default_factory=dict)
    log_a: np.ndarray = field(init=False)

    @classmethod
    def start(cls, setup: Setup, audit: np.ndarray) -> Batch:
        template = setup.monitor([])
        fractions = len(sequential.BET_FRACTIONS)
        cw = np.repeat(template._bet_weights / fractions, fractions)
        runs, columns = audit.shape
        off = np.zeros((runs, MAX_COMPONENTS + 1, columns))
        off[:, 0] = -audit
        ckpt = np.full((runs, MAX_COMPONENTS + 1), -1)
        ckpt[:, 0] = 0
        batch = cls(setup, template.bet_names, cw, np.arange(runs), np.zeros((runs, columns)), off, ckpt,
                    np.zeros(runs), np.zeros(runs))  # fmt: skip
        batch._refresh()
        return batch

    def copy(self) -> Batch:
        new = Batch(self.setup, self.names, self.cw, self.runs.copy(), self.s.copy(), self.off.copy(), self.ckpt.copy(),
                    self.peak.copy(), self.last.copy(), self.t, dict(self.stops))  # fmt: skip
        new.log_a = self.log_a.copy()
        return new

    def _log_weights(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.where(self.ckpt >= 0, -np.log((self.ckpt + 1.0) * (self.ckpt + 2.0)), -np.inf)

    def _refresh(self) -> None:
        self.log_a = logsumexp(self._log_weights()[:, :, None] - self.off, axis=1)

    def _weighted(self, rows: np.ndarray) -> np.ndarray:
        """``w_j K_j`` of every slot of ``rows`` (NaN: free), as ``ProviderMonitor.wealth``."""
        log_wealth = np.minimum(self.s[rows, None, :] - self.off[rows], math.log(sequential.WEALTH_CAP))
        weighted = np.exp(self._log_weights()[rows]) * (np.exp(log_wealth) @ self.cw)
        return np.where(self.ckpt[rows] >= 0, weighted, np.nan)

    def step(self, stream: Stream) -> None:
        t, n = self.t, len(self.runs)
        self.t += 1
        if n == 0:
            return
        rows = np.arange(n)
        factors = stream.factors(self.runs, t)
        if t > 0 and t % self.setup.every == 0:  # the first observation of a checkpoint starts its component
            slot = np.argmax(self.ckpt < 0, axis=1)
            self.off[rows, slot] = self.s
            self.ckpt[rows, slot] = t // self.setup.every
            self.s += factors
            if (self.ckpt[0] >= 0).sum() > MAX_COMPONENTS:  # all runs hold the same number
                weighted = self._weighted(rows)
                weighted[rows, slot] = np.inf  # the newest is kept, and component 0 (the audit's continuation)
                weighted[self.ckpt == 0] = np.inf
                self.ckpt[rows, np.argmin(np.where(np.isnan(weighted), np.inf, weighted), axis=1)] = -1
            self._refresh()
        else:
            self.s += factors
        with np.errstate(over="ignore"):
            e = np.minimum(np.exp(logsumexp(np.log(self.cw) + self.s + self.log_a, axis=1)), sequential.WEALTH_CAP)
        self.last[self.runs] = e
        self.peak[self.runs] = np.maximum(self.peak[self.runs], e)
        crossed = e >= 1.0 / self.setup.alpha  # ProviderMonitor.threshold
        if crossed.any():
            for row in np.flatnonzero(crossed):
                weighted = self._weighted(np.array([row]))[0]
                slot = int(np.nanargmax(weighted))
                by_checkpoint = {int(c): float(w) for c, w in zip(self.ckpt[row], weighted, strict=True) if c >= 0}
                gained = (self.s[row] - self.off[row, slot]).reshape(len(self.names), -1).max(axis=1)
                value = min(float(np.nansum(weighted)), sequential.WEALTH_CAP)
                suspect = suspect_from(by_checkpoint, at=t, every=self.setup.every)
                self.stops[int(self.runs[row])] = Stop(t, value, suspect, self.names[int(np.argmax(gained))])
            keep = ~crossed
            self.runs, self.s, self.off = self.runs[keep], self.s[keep], self.off[keep]
            self.ckpt, self.log_a = self.ckpt[keep], self.log_a[keep]

    def advance(self, stream: Stream, until: int) -> None:
        while self.t < until:
            self.step(stream)


def note(text: str, indent: str = "") -> None:
    """A paragraph, wrapped."""
    print(textwrap.fill(text, width=120, initial_indent=indent, subsequent_indent=indent + "  "))


def rng_for(seed: int, row: str, run: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(row.encode()), run])


def percentile(values: list[int], q: float) -> int:
    return int(np.quantile(values, q, method="higher"))


@dataclass
class Check:
    """The batch against ``ProviderMonitor`` itself on a few runs."""

    runs: int = 0
    stops: int = 0
    worst: float = 0.0
    failures: list[str] = field(default_factory=list)

    def run(self, setup: Setup, audited: list[Observation], replies: list[Observation], expected: Stop | None,
            last: float, label: str) -> None:  # fmt: skip
        monitor = setup.monitor(audited)
        stop = None
        for obs in replies:
            stop = monitor.feed(monitor.next_index(), obs)
            if stop is not None:
                break
        self.runs += 1
        self.stops += stop is not None
        got = stop.e_value if stop is not None else monitor.e_value
        want = expected.e_value if expected is not None else last
        self.worst = max(self.worst, abs(got - want) / max(abs(want), 1e-300))
        same = (stop is None) == (expected is None)
        if stop is not None and expected is not None:
            same = (stop.at, stop.suspect_from, stop.test) == (expected.at, expected.suspect_from, expected.test)
        if not same or not math.isclose(got, want, rel_tol=1e-9):
            self.failures.append(f"{label}: monitor {stop} / e {got:.6g}, batch {expected} / e {want:.6g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--replies", type=int, default=2000, help="monitored replies per run (N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--providers", type=int, default=ELIGIBLE, help="eligible providers alpha is split across")
    parser.add_argument("--audit", type=int, default=AUDIT, help="faithful audit completions replayed into component 0")
    parser.add_argument(
        "--drift-at",
        type=int,
        nargs="*",
        default=None,
        help="monitored replies before each drift row's checkpoint (default: 30 %% of N and 1,000)",
    )
    parser.add_argument("--datasets", type=int, default=None, help="datasets alpha is split across (default: params.yaml's)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per monitored reply (generate.sampling.max_tokens)")
    parser.add_argument("--check", type=int, default=2, help="runs per row replayed through ProviderMonitor itself")
    parser.add_argument("--scorings", type=int, default=50, help="reference scorings timed (0: skip)")
    args = parser.parse_args()
    started = time.perf_counter()
    params = load_params(ROOT / "params.yaml")
    settings = params.generate.monitor
    datasets = args.datasets or len(params.datasets)
    # a reply is its first max_tokens tokens, and the pools' completions end at their stop token or at POOL_TOKENS
    tokens = min(args.tokens or params.generate.sampling.max_tokens, POOL_TOKENS)
    audit_tokens = params.verify.probes.max_tokens
    alpha = settings.alpha / max(args.providers * datasets, 1)
    n, runs, every = args.replies, args.runs, settings.checkpoint_every
    drift_times = sorted(set(args.drift_at or {round(0.3 * n), LONG_PAST}) & set(range(n)))
    share = params.verify.decision.mixture_share
    pools = load_pools(prompts=24, per_prompt=12, tokens=POOL_TOKENS)
    flat = {name: [i for group in pool.values() for i in group] for name, pool in pools.items()}

    print(f"Monitor: generate.monitor share {settings.share}, alpha {settings.alpha} / ({args.providers} providers × {datasets} "
          f"datasets) = {alpha:.5f} per provider (threshold {1 / alpha:.0f}), checkpoint every {every} monitored replies, "
          f"at most {MAX_COMPONENTS} components")  # fmt: skip
    print(f"Runs: {runs} per row, seed {args.seed}; each replays a faithful audit of {args.audit} "
          f"completions ({audit_tokens} tokens) into component 0, then N = {n} monitored replies of up to {tokens} tokens "
          f"(≤ ~{n * tokens / settings.share / 1e6:.1f}M "
          f"output tokens of the provider at share {settings.share})")  # fmt: skip

    check = Check()
    false_rows, detect_rows = [], []
    for base in BASES:
        setup = Setup(base.mode, params.verify.margin, alpha, every, params.verify.decision.mixture_detection_tokens)
        stream_table = Table.of(flat[base.stream], tokens, setup, temperature=base.temperature, listed=RANK_TOP_K)
        audit_top = params.verify.probes.top_logprobs if base.mode == "logprob" else RANK_TOP_K
        audit_table = Table.of(flat[base.audit], audit_tokens, setup, temperature=1.0, listed=audit_top)
        audits, idx = [], np.empty((runs, n), dtype=np.int64)
        for r in range(runs):
            rng = rng_for(args.seed, base.label, r)
            audits.append(rng.choice(len(audit_table.observations), size=args.audit, replace=False))
            idx[r] = rng.integers(0, len(stream_table.observations), size=n)
        audit_sums = np.array([audit_table.factors[a].sum(axis=0) for a in audits])
        stream = Stream(stream_table, idx)
        batch = Batch.start(setup, audit_sums)
        snapshots = {}
        for at in drift_times:
            batch.advance(stream, at)
            snapshots[at] = batch.copy()
        batch.advance(stream, n)
        false_rows.append((base, batch))
        for r in range(min(args.check, runs)):
            audited = [audit_table.observations[i] for i in audits[r]]
            check.run(setup, audited, stream.observations(r), batch.stops.get(r), float(batch.last[r]), base.label)
        for drift, pool in base.drifts.items():
            drift_table = Table.of(flat[pool], tokens, setup, temperature=base.temperature, listed=RANK_TOP_K)
            for at in drift_times:
                label = f"{base.label}:{drift}:{at}"
                drift_idx = np.empty((runs, n - at), dtype=np.int64)
                mask = np.empty((runs, n - at), dtype=bool)
                starts = np.empty(runs, dtype=np.int64)
                for r in range(runs):
                    rng = rng_for(args.seed, label, r)
                    offset = int(rng.integers(0, every))  # anywhere in the checkpoint starting at `at`
                    starts[r] = at + offset
                    drift_idx[r] = rng.integers(0, len(drift_table.observations), size=n - at)
                    mask[r] = np.arange(n - at) >= offset
                    if drift == "mixture":
                        mask[r] &= rng.random(n - at) < share
                drifting = Stream(stream_table, idx, drift_table, at, drift_idx, mask)
                branch = snapshots[at].copy()
                branch.advance(drifting, n)
                before = {r for r, stop in branch.stops.items() if stop.at < starts[r]}
                detect_rows.append((base, drift, at, branch, starts, before, mask))
                for r in [r for r in range(runs) if r not in before][: args.check]:
                    audited = [audit_table.observations[i] for i in audits[r]]
                    check.run(setup, audited, drifting.observations(r), branch.stops.get(r), float(branch.last[r]), label)
    simulated = time.perf_counter() - started

    print()
    note(f"False stops: faithful streams, {runs} runs of N = {n} monitored replies; share of runs ever stopped (must be "
         f"≤ alpha {alpha:.5f}) with its Clopper-Pearson 95 % interval's upper end; the statistic's peak over each run; and "
         "Ville's bound at lower levels (share ever reaching c ≤ 1/c)")  # fmt: skip
    print(f"{'generation':<22}{'stream':<23}{'mode':<9}{'stopped':>8}{'share':>8}{'CP 95% up':>11}{'≤ α':>5}"
          f"{'median peak':>13}{'p99 peak':>10}{'max peak':>10}{'≥ 2':>7}{'≥ 10':>7}{'≥ 100':>7}")  # fmt: skip
    for base, batch in false_rows:
        stopped = len(batch.stops)
        upper = float(beta.ppf(0.975, stopped + 1, runs - stopped))
        peaks = batch.peak
        ville = [f"{np.mean(peaks >= c):.3f}" for c in (2, 10, 100)]
        print(f"{base.label:<22}{base.stream:<23}{base.mode:<9}{stopped:>8}{stopped / runs:>8.4f}"
              f"{upper:>11.4f}{'yes' if stopped / runs <= alpha else 'NO':>5}{np.median(peaks):>13.3g}"
              f"{np.quantile(peaks, 0.99):>10.3g}{peaks.max():>10.3g}{ville[0]:>7}{ville[1]:>7}{ville[2]:>7}")  # fmt: skip
    note(f"(every row runs the sampler's rank tests, at T = 0.7 on the tempered rank; logprob mode adds the two shift tests. "
         f"With 0 stops in {runs} runs the interval's upper end is {float(beta.ppf(0.975, 1, runs)):.4f}: --runs "
         f"{math.ceil(math.log(0.025) / math.log(1 - alpha))} would bring it under alpha. The sandbox's faithful shifts "
         "are far inside the margin (native: exactly 0, the reference is the same model; bf16 compute: mean 0.034, max "
         f"0.064 against {params.verify.margin.mean_abs_dlogprob}), so the shift tests only lose there: the peaks come "
         "from the rank-z tests.)", indent="  ")  # fmt: skip

    print()
    note(f"Detection: each faithful run drifts at a monitored reply drawn uniformly from the checkpoint starting at "
         f"`at` (`at` to `at` + {every - 1}; a {share:.0%} mixture routes that share of replies to NVFP4); delay = drifted "
         "monitored replies up to and including the one that stopped it; quarantined faithful = monitored replies before "
         "the drift inside the quarantine; escaped = drifted replies before the quarantine (must be 0)")  # fmt: skip
    print(f"{'generation':<22}{'drift':<17}{'at':>6}{'runs':>6}{'detected':>9}{'median':>7}{'p90':>6}{'p99':>6}{'max':>6}"
          f"{'quar. faithful med/max':>24}{'escaped runs/max':>18}  test")  # fmt: skip
    prediction, hidden = None, []
    for base, drift, at, branch, starts, before, mask in detect_rows:
        entered = runs - len(before)
        stops = [(branch.stops[r], int(starts[r])) for r in range(runs) if r in branch.stops and r not in before]
        delays = [s.at - start + 1 for s, start in stops]
        faithful = [max(0, start - s.suspect_from * every) for s, start in stops]
        escaped = [max(0, s.suspect_from * every - start) for s, start in stops]
        test = Counter(s.test for s, _ in stops).most_common(1)[0][0] if stops else "-"
        name = f"{share:.0%} nvfp4" if drift == "mixture" else drift
        outside = [  # escaped runs where a reply the drifted model served was itself monitored before the quarantine
            r for r in range(runs) if r in branch.stops and r not in before
            and mask[r, : max(0, branch.stops[r].suspect_from * every - at)].any()
        ]  # fmt: skip
        if outside:
            hidden.append(f"{base.label}, {name}, {at}+: {len(outside)} (runs {', '.join(map(str, outside[:5]))}"
                          + (", ..." if len(outside) > 5 else "") + ")")  # fmt: skip
        row = f"{base.label:<22}{name:<17}{f'{at}+':>6}{entered:>6}{len(stops) / max(entered, 1):>9.3f}"
        if delays:
            row += (f"{statistics.median(delays):>7.0f}{percentile(delays, 0.9):>6}{percentile(delays, 0.99):>6}{max(delays):>6}"
                    f"{statistics.median(faithful):>18.0f} / {max(faithful):<3}{sum(e > 0 for e in escaped):>12} / "
                    f"{max(escaped):<3}  {test}")  # fmt: skip
        print(row)
        if base is BASES[0] and drift == "nvfp4" and at == drift_times[0] and delays:
            prediction = (percentile(delays, 0.99), len(delays))
    if hidden:
        note("Escaped runs in which a monitored reply served by the drifted model lay before the quarantine: "
             + "; ".join(hidden), indent="  ")  # fmt: skip
    if prediction is not None:
        k, count = prediction
        print(f"\npredicted: a drift to nvfp4 is stopped within {k} monitored replies (p99 over {count} runs), i.e. within "
              f"~{k / settings.share:.0f} requests to the provider at share {settings.share} (generation at T = "
              f"{params.generate.sampling.temperature}, default monitor)")  # fmt: skip

    print(f"\nCross-check: {check.runs} runs replayed through ProviderMonitor ({check.stops} stopped): "
          + (f"all agree (largest relative difference in the statistic {check.worst:.1e})" if not check.failures else
             f"{len(check.failures)} DISAGREE"))  # fmt: skip
    for failure in check.failures:
        print(f"  {failure}")
    print(f"(simulation {simulated:.0f} s)")
    cost(params, pools, tokens, args.scorings)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


def cost(params: Params, pools: dict[str, dict[str, list[Item]]], tokens: int, scorings: int) -> None:
    settings = params.generate.monitor
    monitored = settings.share * 1e6 / tokens
    print(f"\nMonitoring cost per provider per 1M output tokens (share {settings.share}, {tokens} tokens per reply): "
          f"{monitored:.0f} monitored requests")  # fmt: skip
    note("gateway: $0 extra in logprob mode: the monitored requests are requests the run buys anyway, with "
         f"logprobs=true and top_logprobs={LOGPROB_TOP} added. OpenRouter's PublicPricing schema (shared/reference/"
         "openrouter-openapi.yaml) has no logprob price, only prompt/completion/request/image/... keys, and the "
         "reference notes say nothing else about billing logprobs (nothing in them says logprobs are free, either). "
         "Sample mode asks nothing extra.", indent="  ")  # fmt: skip
    if scorings <= 0:
        return
    import torch

    from quanthunt.probes import select_probes
    from quanthunt.prompts import load_prompts
    from quanthunt.sandbox.model import load_reference
    from quanthunt.sandbox.sampler import Sampler

    loaded = time.perf_counter()
    model, tokenizer = load_reference()
    records = {name: load_prompts(params.paths.prompt_file(ROOT, name)) for name in params.datasets}
    probes = {p.id: p for p in select_probes(records, count=24, seed=0)}
    reference = Sampler(model, tokenizer, stop_token_ids=[])
    items = [i for group in pools["temperature -0.3"].values() for i in group]
    jobs: list[list[int]] = []
    for item in items[:: max(1, len(items) // (scorings + 2))][: scorings + 2]:
        prompt: Any = tokenizer.apply_chat_template(probes[item.probe].as_messages(), add_generation_prompt=True,
                                                    return_dict=True)  # fmt: skip
        jobs.append(list(prompt["input_ids"]) + item.token_ids[:tokens])
    wall, cpu = [], []
    load = os.getloadavg()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time is what is asked; one thread keeps it free of spin-waits
    for number, ids in enumerate(jobs):
        w, c = time.perf_counter(), time.process_time()
        reference.score(ids, top_logprobs=RANK_TOP_K)
        if number >= 2:  # two warm-ups
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    torch.set_num_threads(threads)
    length = statistics.mean(len(ids) for ids in jobs)
    per = statistics.median(cpu)
    note(f"reference: the sandbox's fp32 reference (SmolLM2-135M, torch {torch.__version__}, one "
         f"thread) scoring prompt + {tokens}-token reply teacher-forced with top {RANK_TOP_K}, {len(wall)} scorings "
         f"serially (mean {length:.0f} tokens each; model loaded in {time.perf_counter() - loaded - sum(wall):.0f} s; "
         f"load average {load:.1f} on {os.cpu_count()} CPUs when timing started): median "
         f"{statistics.median(wall) * 1e3:.0f} ms wall, {per * 1e3:.0f} ms CPU per scoring (p90 "
         f"{float(np.quantile(cpu, 0.9)) * 1e3:.0f} ms CPU) → {per * monitored:.0f} CPU-s per provider per 1M output "
         f"tokens ({per * monitored / 60:.1f} CPU-minutes), in the background, off the requests' path", indent="  ")  # fmt: skip


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    main()
