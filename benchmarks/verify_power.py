"""Error rates, power and audit sizes of the verification, against the sandbox's real precisions.

Usage: ``.venv/bin/python benchmarks/verify_power.py [--seeds 60] [--providers 8]``

The pools (``power_pools.py``: 24 prompts × 12 completions of 64 tokens per served
distribution, each with the provider's logprobs and the reference's teacher-forced top-20)
take ~40 minutes to build once and are cached. An audit longer than a pool (sample mode
past 288 completions) reuses its completions in a new order. For every seed and every subject, this
script then replays the verify stage's sequential audit on them: rounds of the stage's
``verify.probes.prompts`` prompts (each prompt's completions drawn without replacement), up
to ``verify.max_probes_per_provider``, judged after every round by the stage's own
``decision.judge`` as one provider among ``--providers`` (Holm's worst case), stopping at
the first verdict. Side by side on the same samples:

- **fixed**: the one-shot tests the stage used before (t-test of the mean against its margin,
  binomial tail count; Holm over the two) on the first round only;
- **MMD**: MMD with a Hamming kernel (Gao et al., ICLR 2025) on the sample-mode provider
  completions the sequential audit used, against as many of the reference's own samples per
  prompt (in logprob mode one completion per prompt makes MMD blind, so it is not run).

It prints, per mode and subject, the share of seeds found different / equivalent /
inconclusive, the median completions to a verdict, and the calibration the params take:
the faithful bf16 shifts the margins must admit and the per-completion flag rates of NVFP4
(``verify.decision.mixture_detection_*``). Faithful rows are false-positive rates.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from power_pools import SERVED, Item, load_pools

from quanthunt import distances, stats
from quanthunt.calibration import Faithful, calibrate, detection
from quanthunt.decision import Subject, judge
from quanthunt.measurements import RANK_TOP_K, Audit, LogprobCompletion, Rank, SampledText, rank
from quanthunt.params import Margins, Params, load_params

ROOT = Path(__file__).resolve().parents[1]
FAITHFUL = ("int4-native", "int4-bf16act")
FAITHFUL_POOLS = (*FAITHFUL, "int4-fp8kv", "int4-bf16act-fp8kv")
"""The pools a calibrated design may take as its controls (``--calibrate-on``)."""
SUBJECTS = (
    *FAITHFUL,
    "nvfp4",
    "mxfp4",
    "int4-g128",
    "substitute",
    "10% nvfp4",
    "20% nvfp4",
    "temperature +0.3",
    "temperature -0.3",
    "temperature +0.1",
    "temperature -0.1",
    "forced top-p 0.9",
)
Pool = dict[str, list[Item]]
"""A pool's completions by probe."""

TOP_LOGPROBS = 5
"""Logprob mode's sampler check sees the reference's top 5 (``verify.probes.top_logprobs``)."""


class Scores:
    """Each pooled completion's observations, computed once: mean |Δ| and the rank
    statistics as the logprob-mode audit sees them (top 5), and as sample mode does (top 20)."""

    def __init__(self, horizon: int = 64) -> None:
        self._cache: dict[int, tuple[float, Rank, Rank]] = {}
        self.horizon = horizon
        """The rank statistic's tokens (``decision.mixture_detection_tokens``)."""

    def __call__(self, item: Item) -> tuple[float, Rank, Rank]:
        key = id(item)
        if key not in self._cache:
            seed = f"{item.probe}:{item.token_ids}"
            shift = statistics.fmean(abs(d) for d in item.deltas) if item.deltas else 0.0
            self._cache[key] = (
                shift,
                rank(item.positions(TOP_LOGPROBS), listed=TOP_LOGPROBS, seed=seed, horizon=self.horizon),
                rank(item.positions(RANK_TOP_K), listed=RANK_TOP_K, seed=seed, horizon=self.horizon),
            )
        return self._cache[key]


def split(pool: Pool, control: int) -> tuple[Pool, Pool]:
    """Each probe's first ``control`` completions (a control deployment's, measured once), and the rest."""
    return {p: items[:control] for p, items in pool.items()}, {p: items[control:] for p, items in pool.items()}


def faithful(name: str, pool: Pool, scores: Scores) -> Faithful:
    """A pool's completions as ``quanthunt.calibration`` takes a control's."""
    shift, r5, r20 = zip(*(scores(item) for group in pool.values() for item in group), strict=True)
    return Faithful(name, list(shift), [r.z for r in r5], [r.z for r in r20], [r.pit for r in r5], [r.pit for r in r20])


def calibrated_design(
    params: Params, pools: dict[str, Pool], scores: Scores, *, controls: list[str], control: int, confidence: float = 0.95
) -> tuple[Params, dict[str, Pool]]:
    """The design the calibrate stage would give: margins bounded on ``controls``' control
    halves (each probe's first ``control`` completions) and the mixture detection rates on
    NVFP4's, jointly at ``confidence`` (Bonferroni, as ``calibration_run.calibrated``); and
    every pool's other half to audit, so no row replays what it was calibrated on. Prints
    what every row then assumes."""
    halves = {name: split(pool, control) for name, pool in pools.items()}
    each = 1 - (1 - confidence) / (len(controls) + 1)
    margin, decision = params.verify.margin, params.verify.decision
    per_probe = len(next(iter(pools["nvfp4"].values())))
    print(f"\nCalibrated design (every row below assumes it): each pool split {control} / {per_probe - control} per probe "
          f"into a control half and an audited half; bounds jointly at {confidence}")  # fmt: skip
    for name in controls:
        margin, bounds = calibrate(margin, faithful(name, halves[name][0], scores), confidence=each)
        for b in bounds:
            print(f"  {name:<14} {b.margin:<28} measured {b.measured:<8.4g} bound {b.bound:<8.4g} shipped {b.shipped:<7.4g} "
                  f"used {b.used:.4g}")  # fmt: skip
    decision, bounds = detection(decision, margin, faithful("nvfp4", halves["nvfp4"][0], scores), confidence=each)
    for b in bounds:
        print(f"  {'nvfp4':<14} {b.margin:<28} measured {b.measured:<8.4g} lower bound {b.bound:.4g} (shipped {b.shipped:.4g})")
    print(f"  margins: {margin.model_dump()}")
    verify = params.verify.model_copy(update={"margin": margin, "decision": decision})
    audited = {name: half for name, (_, half) in halves.items()}
    audited["reference samples"] = pools["reference samples"]  # the MMD baseline's, never audited
    return params.model_copy(update={"verify": verify}), audited


def draws(pool: dict[str, list[Item]], mixed: dict[str, list[Item]] | None, share: float, rng: random.Random) -> list[list[Item]]:
    """Each probe's completions in a seeded order (drawn without replacement); a mixture
    takes each slot from ``mixed`` with probability ``share``."""
    out = []
    for probe in sorted(pool):
        items = list(pool[probe])
        rng.shuffle(items)
        if mixed is not None:
            other = list(mixed[probe])
            rng.shuffle(other)
            items = [o if rng.random() < share else i for i, o in zip(items, other, strict=True)]
        out.append(items)
    return out


def queues_of(name: str, pools: dict[str, dict[str, list[Item]]], rng: random.Random) -> list[list[Item]]:
    """The completions a replay of ``name`` draws: its pool, or for ``"<k>% nvfp4"`` the
    reference's with each slot NVFP4's with probability k %."""
    if name.endswith("% nvfp4"):
        return draws(pools["int4-native"], pools["nvfp4"], int(name.split("%", maxsplit=1)[0]) / 100, rng)
    return draws(pools[name], None, 0.0, rng)


def sequential(
    mode: str, queues: list[list[Item]], scores: Scores, params: Params, providers: int, rng: random.Random
) -> tuple[str, int, Audit, Audit]:
    """Replay the stage's rounds; the verdict, completions used, that audit and its first round."""
    v = params.verify
    k = v.probes.completions_per_prompt if mode == "logprob" else v.probes.sample_mode_completions_per_prompt
    order = list(range(len(queues)))
    rng.shuffle(order)
    taken = [0] * len(queues)
    audit = Audit("p", "p/x", mode)
    first = Audit("p", "p/x", mode)
    subject = Subject("p", "p/x", "unknown", "candidate")
    seq = 0
    for number, start in enumerate(range(0, v.max_probes_per_provider, v.probes.prompts)):
        for slot in range(start, min(start + v.probes.prompts, v.max_probes_per_provider)):
            probe = order[slot % len(order)]
            for _ in range(k):
                item = queues[probe][taken[probe] % len(queues[probe])]
                taken[probe] += 1
                _, r5, r20 = scores(item)
                audit.attempted += 1
                audit.served_by["p"] += 1
                if mode == "logprob":
                    deltas = item.deltas
                    audit.logprob.append(LogprobCompletion(item.probe, seq, len(deltas), len(deltas), deltas, [], [],
                                                           r5.z, r5.pit, seq))  # fmt: skip
                else:
                    tokens = len(item.token_ids)
                    audit.sampled.append(SampledText(item.probe, seq, "provider", item.token_ids, 0.0, r20.z, r20.pit,
                                                     tokens, seq))  # fmt: skip
                seq += 1
        if number == 0:
            first.logprob, first.sampled = list(audit.logprob), list(audit.sampled)
        (state,) = judge([subject], [audit], v.margin, v.decision, family=providers)
        if state.verdict is not None:
            return state.verdict, seq, audit, first
    return "inconclusive", seq, audit, first


def fixed_verdict(mode: str, first: Audit, params: Params, providers: int) -> bool:
    """The one-shot tests on the first round: different if Holm over the mean and tail tests
    (and over ``providers``, worst case) rejects."""
    m = params.verify.margin
    alpha = params.verify.decision.alpha
    if mode == "logprob":
        shifts = [c.mean_abs_delta for c in first.logprob]
        mean_p = stats.one_sided_mean_test(shifts, threshold=m.mean_abs_dlogprob, alternative="greater").pvalue
        tail_p = stats.binomial_tail_test(sum(s > m.tail_dlogprob for s in shifts), len(shifts), p0=m.tail_p0)
    else:
        zs = [s.rank_z for s in first.sampled]
        mean_p = stats.one_sided_mean_test(zs, threshold=0.0, alternative="greater").pvalue
        tail_p = stats.binomial_tail_test(sum(z > m.sample_tail_z for z in zs), len(zs), p0=m.sample_tail_p0)
    pvalues = [mean_p, tail_p]  # the old stage had no sampler check in logprob mode
    adjusted = stats.holm(pvalues + [1.0] * (2 * providers - len(pvalues)))
    return min(adjusted[: len(pvalues)]) < alpha


def mmd_rejects(audit: Audit, reference: dict[str, list[Item]], params: Params, providers: int, rng: np.random.Generator) -> bool:
    """MMD on the audit's distinct completions (past the pool's size the replay reuses them,
    and a duplicate would look like self-similarity) against as many reference samples."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    per_probe: Counter[str] = Counter()
    provider = []
    for s in audit.sampled:
        key = (s.probe_id, tuple(s.token_ids))
        if key not in seen and per_probe[s.probe_id] < len(reference[s.probe_id]):
            seen.add(key)
            per_probe[s.probe_id] += 1
            provider.append(s)
    ref = [(probe, item) for probe, count in per_probe.items() for item in reference[probe][:count]]
    test = distances.mmd_hamming_test(
        [s.token_ids for s in provider], [i.token_ids for _, i in ref], [s.probe_id for s in provider], [p for p, _ in ref],
        n_permutations=500, rng=rng,
    )  # fmt: skip
    return test.pvalue * providers < params.verify.decision.alpha


OBSERVATIONS_HEADER = f"{'mean |Δ|':>10}{'|Δ|>tail':>10}{'pit top5':>10}{'z5>2':>7}{'pit top20':>11}{'z20>2':>7}"


def observations(pool: dict[str, list[Item]], scores: Scores, m: Margins) -> str:
    """A pool's per-completion observations, as columns under :data:`OBSERVATIONS_HEADER`
    (pit: ``Rank.pit``, what the sampler's mean tests bet on; z: the padded rank z)."""
    items = [i for group in pool.values() for i in group]
    shift, r5, r20 = zip(*(scores(i) for i in items), strict=True)
    shift = np.array(shift)
    z5, z20 = (np.array([r.z for r in ranks]) for ranks in (r5, r20))
    pit5, pit20 = (np.array([r.pit for r in ranks]) for ranks in (r5, r20))
    return (
        f"{shift.mean():>10.4f}{np.mean(shift > m.tail_dlogprob):>10.3f}"
        f"{pit5.mean():>10.3f}{np.mean(z5 > m.sample_tail_z):>7.3f}"
        f"{pit20.mean():>11.3f}{np.mean(z20 > m.sample_tail_z):>7.3f}"
    )


def calibration(pools: dict[str, dict[str, list[Item]]], scores: Scores, params: Params) -> None:
    m = params.verify.margin
    print("\nPer-completion observations (all 288 pooled completions of each; 64 tokens):")
    print(f"{'served':<20}{OBSERVATIONS_HEADER}")
    for name in SERVED:
        print(f"{name:<20}{observations(pools[name], scores, m)}")
    print(
        "  (margins: mean |Δ| ≤ "
        f"{m.mean_abs_dlogprob}, extreme beyond {m.tail_dlogprob}; |pit − ½| ≤ {m.sampler_shift}, equivalence within "
        f"½ ± {m.sampler_equivalence}; extreme z > {m.sample_tail_z}. NVFP4's extreme shares are "
        "verify.decision.mixture_detection_logprob / _sample.)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument(
        "--providers", type=int, default=8, help="providers in the correction family (the default roster audits 8)"
    )
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--pool", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calibrate-on", nargs="+", choices=sorted(FAITHFUL_POOLS), metavar="POOL",
                        help="decide with margins calibrated on these faithful pools' control halves and NVFP4's detection "
                             f"rates, auditing the other halves (one of {', '.join(sorted(FAITHFUL_POOLS))})")  # fmt: skip
    parser.add_argument(
        "--control", type=int, default=6, help="with --calibrate-on: completions of each probe that are the control's"
    )
    args = parser.parse_args()
    params = load_params(ROOT / "params.yaml")
    pools = load_pools(prompts=args.prompts, per_prompt=args.pool, tokens=args.tokens)
    scores = Scores()
    started = time.perf_counter()
    calibration(pools, scores, params)
    if args.calibrate_on:
        params, pools = calibrated_design(params, pools, scores, controls=args.calibrate_on, control=args.control)

    tally: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    sizes: dict[tuple[str, str], list[int]] = defaultdict(list)
    for seed in range(args.seeds):
        for name in SUBJECTS:
            for mode in ("logprob", "sample"):
                rng = random.Random(f"{seed}:{name}:{mode}")
                queues = queues_of(name, pools, rng)
                verdict, used, audit, first = sequential(mode, queues, scores, params, args.providers, rng)
                key = (mode, name)
                tally[key][verdict] += 1
                sizes[key].append(used)
                tally[key]["fixed different"] += fixed_verdict(mode, first, params, args.providers)
                if mode == "sample":
                    reference = {p: list(items) for p, items in pools["reference samples"].items()}
                    for items in reference.values():
                        rng.shuffle(items)
                    for label, sample in (("mmd fixed", first), ("mmd same", audit)):
                        tally[key][label] += mmd_rejects(sample, reference, params, args.providers, np.random.default_rng(seed))
    n = args.seeds
    v = params.verify
    print(f"\n{n} seeds per row; alpha {v.decision.alpha}, Holm across {args.providers} providers (worst case); rounds of "
          f"{v.probes.prompts} prompts up to {v.max_probes_per_provider} ({time.perf_counter() - started:.0f} s)")  # fmt: skip
    for mode in ("logprob", "sample"):
        k = v.probes.completions_per_prompt if mode == "logprob" else v.probes.sample_mode_completions_per_prompt
        print(f"\n{mode} mode ({k} completion(s) per prompt): sequential verdict shares, completions to a verdict, and")
        print(f"the baselines' share found different (fixed: first round of {v.probes.prompts * k}"
              + ("; MMD on the first round / on the sequential audit's samples)" if mode == "sample" else ")"))  # fmt: skip
        header = f"{'subject':<19}{'different':>10}{'equivalent':>11}{'inconcl.':>9}{'median n':>9}{'p90 n':>7}{'fixed':>7}"
        print(header + (f"{'MMD 1st':>9}{'MMD same':>9}" if mode == "sample" else ""))
        for name in SUBJECTS:
            t = tally[(mode, name)]
            used = sorted(sizes[(mode, name)])
            row = (
                f"{name:<19}{t['different'] / n:>10.2f}{t['equivalent'] / n:>11.2f}{t['inconclusive'] / n:>9.2f}"
                f"{statistics.median(used):>9.0f}{used[int(0.9 * (len(used) - 1))]:>7}{t['fixed different'] / n:>7.2f}"
            )
            if mode == "sample":
                row += f"{t['mmd fixed'] / n:>9.2f}{t['mmd same'] / n:>9.2f}"
            print(row)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    main()
