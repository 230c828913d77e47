"""Verify on faithful deployments noisier than the shipped margins assume: shipped against calibrated margins.

Usage: ``.venv/bin/python benchmarks/noisy_faithful.py [--seeds 200] [--providers 8] [--replies 2000]``

Every level serves the reference's own weights, so a right verdict is never ``different``;
what changes is the arithmetic of the deployment, each a real serving option:

- ``int4-native``: the reference itself (fp32 compute): no noise at all;
- ``int4-bf16act``: bf16 compute, the noise the shipped margins were set to admit;
- ``int4-fp8kv``: fp32 compute, keys and values stored as vLLM's ``--kv-cache-dtype fp8``
  stores them with its default scales (1.0);
- ``int4-bf16act-fp8kv``: both.

Pools come from ``power_pools.py`` (24 probes x 12 completions of 64 tokens, cached). Each
is split by completion: the first ``--control`` of every probe are the *control* (a second
deployment the team trusts, measured once), the rest the *provider*, independent draws of
the same deployment. ``quanthunt.calibration.calibrate`` turns the control's completions
into margins; the verify stage's sequential audit is then replayed ``--seeds`` times per
mode on the provider's, with the shipped margins (measured on the sandbox's SmolLM2 pools)
and with the calibrated ones, and against NVFP4, a 20 % NVFP4 mixture and temperature ±0.1
with the calibrated ones (their power). The calibrated runs also take their mixture
detection rates from NVFP4's control half (``calibration.detection``) instead of the
shipped SmolLM2 ones. It prints the
per-completion observations, each level's calibrated margins, per row the shares found
different / equivalent / inconclusive and the median completions used, and then the
generate stage's monitor on each level's provider half (``--replies`` monitored replies a
run, shipped against calibrated margins): the share of faithful runs it stops.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
from monitor_drift import AUDIT, Batch, Setup, Stream, Table, rng_for
from power_pools import SERVED, load_pools
from scipy.stats import beta
from verify_power import OBSERVATIONS_HEADER, Pool, Scores, faithful, observations, queues_of, sequential, split

from quanthunt.calibration import Sampled, at_generation, calibrate, detection
from quanthunt.measurements import RANK_TOP_K, rank
from quanthunt.params import Margins, Params, load_params

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("int4-native", "int4-bf16act", "int4-fp8kv", "int4-bf16act-fp8kv")
COARSE = ("nvfp4", "20% nvfp4", "temperature +0.1", "temperature -0.1")
CONFIDENCE = 0.95
POOLS = ("int4-native", "int4-fp8kv", "nvfp4", "int4-bf16act", "int4-bf16act-fp8kv", "temperature +0.1", "temperature -0.1",
         "int4-fp8kv at T 0.7", "int4-bf16act at T 0.7")  # fmt: skip
"""Built in this order (the most telling first: each takes minutes on 2 cores)."""
GENERATION_T = 0.7
"""The generate stage's default temperature, where the monitor ranks under the tempered distribution."""


def replay(
    name: str, pools: dict[str, Pool], scores: Scores, params: Params, args: argparse.Namespace
) -> dict[str, tuple[Counter[str], list[int]]]:
    """Per mode: the verdicts of ``--seeds`` replays of the audit of ``name`` and the completions each used."""
    out = {}
    for mode in ("logprob", "sample"):
        tally: Counter[str] = Counter()
        used = []
        for seed in range(args.seeds):
            rng = random.Random(f"{seed}:{name}:{mode}")
            verdict, n, _, _ = sequential(mode, queues_of(name, pools, rng), scores, params, args.providers, rng)
            tally[verdict] += 1
            used.append(n)
        out[mode] = (tally, used)
    return out


def false_stops(label: str, pool: Pool, margin: Margins, *, sampler: bool, alpha: float, every: int, horizon: int,
                args: argparse.Namespace, temperature: float = 1.0) -> tuple[int, float]:  # fmt: skip
    """Runs (of ``--seeds``) whose generate-stage monitor stopped a faithful provider within
    ``--replies`` monitored replies, and the share whose statistic ever reached 10 (Ville: at
    most 1/10 under the null, a finer look than the stops). Each run replays a faithful audit
    of the monitor_drift benchmark's size into component 0, then replies drawn i.i.d. from the
    provider half (monitor_drift.py's vectorised monitor, checked there against ProviderMonitor)."""
    items = [item for group in pool.values() for item in group]
    setup = Setup("logprob", margin, alpha, every, horizon, sampler=sampler)
    table = Table.of(items, args.tokens, setup, temperature=temperature, listed=RANK_TOP_K)  # as the monitor scores
    audits = np.empty((args.seeds, table.factors.shape[1]))
    idx = np.empty((args.seeds, args.replies), dtype=np.int64)
    for run in range(args.seeds):
        rng = rng_for(0, label, run)
        audits[run] = table.factors[rng.choice(len(items), size=min(AUDIT, len(items)), replace=False)].sum(axis=0)
        idx[run] = rng.integers(0, len(items), size=args.replies)
    batch = Batch.start(setup, audits)
    batch.advance(Stream(table, idx), args.replies)
    return len(batch.stops), float(np.mean(batch.peak >= 10))


def row(label: str, mode: str, tally: Counter[str], used: list[int]) -> str:
    n = sum(tally.values())
    return (
        f"{mode:<9}{label:<47}{tally['different'] / n:>10.3f}{tally['equivalent'] / n:>11.3f}"
        f"{tally['inconclusive'] / n:>9.3f}{statistics.median(used):>9.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--providers", type=int, default=8, help="providers in the correction family (the default roster's 8)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--pool", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--control", type=int, default=6, help="completions of each probe that are the control's")
    parser.add_argument("--replies", type=int, default=2000, help="monitored replies per monitor run")
    parser.add_argument("--eligible", type=int, default=4, help="eligible providers the monitor's alpha is split across")
    parser.add_argument("--pools", nargs="+", choices=POOLS, default=list(POOLS), help="build and use only these (nvfp4 needed)")
    args = parser.parse_args()
    params = load_params(ROOT / "params.yaml")
    shipped = params.verify.margin
    if "nvfp4" not in args.pools:
        parser.error("--pools needs nvfp4: the calibrated rows take their detection rates from it")
    built = load_pools(prompts=args.prompts, per_prompt=args.pool, tokens=args.tokens, served={n: SERVED[n] for n in args.pools})
    levels = [level for level in LEVELS if level in built]
    subjects = [c for c in COARSE if c in built or (c.endswith("% nvfp4") and "int4-native" in built)]
    pools: dict[str, Pool] = {}
    controls: dict[str, Pool] = {}
    for name, pool in built.items():
        controls[name], pools[name] = split(pool, args.control)
    scores = Scores()

    print(f"\nPer-completion observations ({args.prompts} probes x {args.control} control / {args.pool - args.control} "
          f"provider completions of {args.tokens} tokens):")  # fmt: skip
    print(f"{'pool':<28}{OBSERVATIONS_HEADER}")
    for name in (*levels, "nvfp4"):
        for half, halves in (("provider", pools), ("control", controls)):
            print(f"{f'{name} {half}':<28}{observations(halves[name], scores, shipped)}")

    calibrated: dict[str, Params] = {}
    coarse = faithful("nvfp4 control", controls["nvfp4"], scores)
    fields = ("mean_abs_dlogprob", "tail_dlogprob", "tail_p0", "sample_tail_p0", "sampler_shift")
    rates = ("mixture_detection_logprob", "mixture_detection_sample")
    print("\nMargins, shipped and calibrated on each level's control half, and the mixture detection rates at them,")
    print(f"measured on NVFP4's control half (every bound jointly at {CONFIDENCE}; a rate's measured share in brackets):")
    print(f"{'':<20}" + "".join(f"{f:>19}" for f in fields) + "".join(f"{r.removeprefix('mixture_'):>26}" for r in rates))
    d = params.verify.decision
    print(f"{'shipped':<20}" + "".join(f"{getattr(shipped, f):>19.4g}" for f in fields)
          + "".join(f"{getattr(d, r):>26.4g}" for r in rates))  # fmt: skip
    for level in levels:
        margins, _ = calibrate(shipped, faithful(level, controls[level], scores), confidence=CONFIDENCE)
        try:
            decision, bounds = detection(d, margins, coarse, confidence=CONFIDENCE)
            shown = "".join(f"{f'{b.bound:.4g} ({b.measured:.3f})':>26}" for b in bounds)
        except ValueError as exc:  # a pool too small to flag any coarse completion: keep the shipped rates, say so
            decision, shown = d, f"  shipped rates kept: {exc}"
        verify = params.verify.model_copy(update={"margin": margins, "decision": decision})
        calibrated[level] = params.model_copy(update={"verify": verify})
        print(f"{level:<20}" + "".join(f"{getattr(margins, f):>19.4g}" for f in fields) + shown)

    started = time.perf_counter()
    lines = []
    for level in levels:
        for label, p in (("shipped", params), ("calibrated", calibrated[level])):
            for mode, (tally, used) in replay(level, pools, scores, p, args).items():
                lines.append(row(f"{level}, {label} margins", mode, tally, used))
    for level in levels:
        for subject in subjects:
            for mode, (tally, used) in replay(subject, pools, scores, calibrated[level], args).items():
                lines.append(row(f"{subject}, margins of {level}", mode, tally, used))
    v = params.verify
    print(
        f"\nVerify replayed {args.seeds} times a row (alpha {v.decision.alpha}, Holm across {args.providers} providers; "
        f"rounds of {v.probes.prompts} prompts up to {v.max_probes_per_provider}; {time.perf_counter() - started:.0f} s). "
        "The levels are faithful ('different' is a false positive); the rest should be found different (power)."
    )
    print(f"{'mode':<9}{'audited':<47}{'different':>10}{'equivalent':>11}{'inconcl.':>9}{'median n':>9}")
    print("\n".join(lines))
    print(
        "  (a replay draws each probe's completions from its provider half in a new order, so a row measures that half as much "
        "as the deployment; the int4-native and int4-bf16act pools are the ones the shipped margins were set on)"
    )

    settings = params.generate.monitor
    alpha = settings.alpha / (args.eligible * len(params.datasets))
    started = time.perf_counter()
    print(
        f"\nThe generate stage's monitor on each faithful level's provider half: {args.seeds} runs of {args.replies} monitored "
        f"replies after a {AUDIT}-completion audit; alpha {settings.alpha} / ({args.eligible} eligible x {len(params.datasets)} "
        f"datasets) = {alpha:.5f} per provider, checkpoint every {settings.checkpoint_every}. 'shift': the logprob-shift "
        "tests alone (generation under a nucleus cut or above T 1); '+sampler': with the rank-z tests (the pools' T = 1; "
        "at the shipped 0.7 the monitor ranks under the tempered distribution: monitor_drift.py). Stopped: share of "
        "runs (Clopper-Pearson 95 % upper end); >= 10: share whose statistic ever reached 10 (at most 0.1 under the null)."
    )
    print(f"{'level':<22}{'margins':<12}{'shift: stopped':>16}{'CP up':>8}{'>= 10':>7}{'+sampler: stopped':>19}{'CP up':>8}"
          f"{'>= 10':>7}")  # fmt: skip
    for level in levels:
        for label, margin in (("shipped", shipped), ("calibrated", calibrated[level].verify.margin)):
            cells = ""
            for sampler in (False, True):
                stopped, ten = false_stops(f"{level}:{label}:{sampler}", pools[level], margin, sampler=sampler, alpha=alpha,
                                           every=settings.checkpoint_every,
                                           horizon=params.verify.decision.mixture_detection_tokens, args=args)  # fmt: skip
                upper = float(beta.ppf(0.975, stopped + 1, args.seeds - stopped))
                cells += f"{stopped / args.seeds:>{16 if not sampler else 19}.3f}{upper:>8.3f}{ten:>7.3f}"
            print(f"{level:<22}{label:<12}{cells}")
    print(f"  ({time.perf_counter() - started:.0f} s; monitored replies are the pools' {args.tokens}-token completions at T = 1)")
    at_generation_rows(built, calibrated, shipped, args, params, alpha)


def sampled(name: str, pool: Pool, horizon: int) -> Sampled:
    """A pool's completions at the generation's temperature as the calibrate stage ranks a
    control's there (``calibration_run.measure_at_generation``): under the reference's top 20 at T 0.7."""
    ranks = [rank(i.positions(RANK_TOP_K), listed=RANK_TOP_K, seed=f"{i.probe}:{i.token_ids}", horizon=horizon,
                  temperature=GENERATION_T) for group in pool.values() for i in group]  # fmt: skip
    return Sampled(name, [r.z for r in ranks], [r.pit for r in ranks])


def at_generation_rows(built: dict[str, Pool], calibrated: dict[str, Params], shipped: Margins, args: argparse.Namespace,
                       params: Params, alpha: float) -> None:  # fmt: skip
    """The monitor at the generation's T 0.7 on each faithful level with a pool there: its
    false stops with the shipped margins, verify's calibrated ones (bounded at the audit's
    T 1), and those widened by the level's control half at T 0.7 (``calibration.at_generation``,
    as the calibrate stage now does), each run on the other half."""
    levels = [level for level in LEVELS if f"{level} at T {GENERATION_T}" in built and level in calibrated]
    if not levels:
        return
    horizon = params.verify.decision.mixture_detection_tokens
    settings = params.generate.monitor
    print(f"\nThe monitor at the generation's T {GENERATION_T} (the shipped default), shift and rank tests, on each level's "
          f"T {GENERATION_T} pool split {args.control} / {args.pool - args.control} per probe: {args.seeds} runs of "
          f"{args.replies} replies, the audit replayed from the same half (ranked at {GENERATION_T}: exact under the "
          "null too)")  # fmt: skip
    print(f"{'level':<22}{'margins':<34}{'sample_tail_p0':>15}{'sampler_shift':>14}{'stopped':>9}{'CP up':>8}{'>= 10':>7}")
    for level in levels:
        control, provider = split(built[f"{level} at T {GENERATION_T}"], args.control)
        audit_margin = calibrated[level].verify.margin
        widened, _ = at_generation(audit_margin, sampled(level, control, horizon), confidence=CONFIDENCE)
        for label, margin in (("shipped", shipped), ("calibrated at T 1 (verify's)", audit_margin),
                              (f"+ control at T {GENERATION_T} (monitor's)", widened)):  # fmt: skip
            stopped, ten = false_stops(f"{level}:{label}:T{GENERATION_T}", provider, margin, sampler=True, alpha=alpha,
                                       every=settings.checkpoint_every, horizon=horizon, args=args,
                                       temperature=GENERATION_T)  # fmt: skip
            upper = float(beta.ppf(0.975, stopped + 1, args.seeds - stopped))
            print(f"{level:<22}{label:<34}{margin.sample_tail_p0:>15.4g}{margin.sampler_shift:>14.4g}"
                  f"{stopped / args.seeds:>9.3f}{upper:>8.3f}{ten:>7.3f}")  # fmt: skip


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    main()
