"""Error rates of the verification tests, against the sandbox's real precisions.

Usage: ``.venv/bin/python benchmarks/verify_power.py [--seeds 60] [--prompts 25] [--pool 16] [--tokens 24]``

Builds, once, a pool of completions per precision (T=1, ``--tokens`` tokens, ``--pool``
per prompt for ``--prompts`` prompts drawn from the shipped datasets): the provider's
logprobs of its sampled tokens and the reference's teacher-forced scores of the same
tokens. A 20 % NVFP4 mixture draws each completion from the NVFP4 pool with probability
0.2, else from the faithful pool. Then, for every seed, it subsamples audits of several
sizes and runs the stage's own decision (``verification.decide``) and the MMD-Hamming
baseline on the *same* samples, and prints the share of seeds in which each precision
was found different (false-positive rate for faithful precisions, power otherwise) and
equivalent at alpha = 0.05. It also prints the faithful bf16 distribution the margins
are calibrated on. Building the pools takes ~40 minutes on 2 cores; they are cached
(``~/.cache/quanthunt/benchmarks``), so later runs take a few minutes.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quanthunt import stats
from quanthunt.params import load_params
from quanthunt.prompts import load_prompts
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import PrecisionStore, cache_root, load_reference
from quanthunt.sandbox.sampler import Sampler
from quanthunt.verification import (
    RANK_TOP_K,
    Audit,
    LogprobCompletion,
    Margins,
    Policy,
    SampledText,
    Subject,
    decide,
    probe_seed,
    rank_score,
    select_probes,
)

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Item:
    """One pooled completion: provider logprobs and reference scores of its tokens, and the
    reference's entropy (from its top-20) at each position."""

    probe: str
    token_ids: list[int]
    provider_logprobs: list[float]
    reference_logprobs: list[float]
    reference_tops: list[dict[str, float]]
    """The reference's top-20 at each position, plus the sampled token when not among them."""

    @property
    def mean_loglik(self) -> float:
        return statistics.fmean(self.reference_logprobs) if self.reference_logprobs else 0.0

    def rank_score(self, seed: str) -> float:
        return rank_score(self.reference_logprobs, self.reference_tops, listed=RANK_TOP_K, seed=seed)


def build_pool(
    sampler: Sampler, reference: Sampler, prompts: list[tuple[str, list[int]]], per_prompt: int, tokens: int, seed: int
) -> list[Item]:
    requests = [
        (probe, ids, SamplingRequest(tuple(ids), tokens, temperature=1.0, seed=probe_seed(seed, probe, j)))
        for probe, ids in prompts
        for j in range(per_prompt)
    ]
    items: list[Item] = []
    for start in range(0, len(requests), 32):
        chunk = requests[start : start + 32]
        samples = sampler.sample([r for _, _, r in chunk])
        jobs = [(list(ids) + sample.token_ids, RANK_TOP_K) for (_, ids, _), sample in zip(chunk, samples, strict=True)]
        for (probe, ids, _), sample, score in zip(chunk, samples, reference.score_many(jobs), strict=True):
            tail = [t for t in score[len(ids) :] if t is not None]
            tops = [{str(i): lp for i, lp in t.top} | {str(t.token_id): t.logprob} for t in tail]
            provider = [t.logprob for t in sample.logprobs]
            items.append(Item(probe, sample.token_ids, provider, [t.logprob for t in tail], tops))
    return items


def by_probe(pool: list[Item]) -> dict[str, list[Item]]:
    grouped: dict[str, list[Item]] = {}
    for item in pool:
        grouped.setdefault(item.probe, []).append(item)
    return grouped


def mixture(
    faithful: dict[str, list[Item]], lower: dict[str, list[Item]], share: float, rng: random.Random
) -> dict[str, list[Item]]:
    return {p: [lower[p][i] if rng.random() < share else item for i, item in enumerate(items)] for p, items in faithful.items()}


def logprob_audit(pool: dict[str, list[Item]], n: int, rng: random.Random) -> Audit:
    """``n`` completions spread over the prompts (round-robin, random picks)."""
    audit = Audit("p", "p/x", "logprob")
    probes = list(pool)
    rng.shuffle(probes)
    for i in range(n):
        probe = probes[i % len(probes)]
        item = rng.choice(pool[probe])
        deltas = [a - b for a, b in zip(item.provider_logprobs, item.reference_logprobs, strict=False)]
        audit.logprob.append(LogprobCompletion(probe, i, len(deltas), len(deltas), deltas, [], []))
    return audit


def sample_audit(pool: dict[str, list[Item]], reference: dict[str, list[Item]], k: int, rng: random.Random) -> Audit:
    audit = Audit("p", "p/x", "sample")
    for probe, provided in pool.items():
        for source, items in (("provider", provided), ("reference", reference[probe])):
            for j, item in enumerate(rng.sample(items, k)):
                score = item.rank_score(f"{probe}:{j}:{source}:{item.token_ids}")
                audit.sampled.append(
                    SampledText(probe, j, source, item.token_ids, item.mean_loglik, score, len(item.reference_logprobs))
                )
    return audit


def verdict(audit: Audit, margins: Margins, policy: Policy, seed: int) -> str:
    """The stage's own decision for one provider."""
    (judged,) = decide([Subject("p", "p/x", "unknown", "candidate")], [audit], margins, policy, seed=seed)
    return judged.verdict


def load_or_build_pools(args: argparse.Namespace, params: object) -> dict[str, dict[str, list[Item]]]:
    """The pools take most of the time: they are cached on disk by their settings."""
    key = f"verify-pools-p{args.prompts}-n{args.pool}-t{args.tokens}-v3.pkl"
    cached = cache_root() / "benchmarks" / key
    if cached.exists() and not args.rebuild:
        print(f"pools from {cached}", flush=True)
        return pickle.loads(cached.read_bytes())
    model, tokenizer = load_reference()
    store = PrecisionStore(model)
    datasets = {name: load_prompts(params.paths.prompt_file(ROOT, name)) for name in params.datasets}  # type: ignore[attr-defined]
    probes = select_probes(datasets, count=args.prompts, seed=0)
    prompts = [
        (p.id, list(tokenizer.apply_chat_template(p.as_messages(), add_generation_prompt=True, return_dict=True)["input_ids"]))
        for p in probes
    ]
    reference = Sampler(model, tokenizer, stop_token_ids=[])
    pools: dict[str, dict[str, list[Item]]] = {}
    started = time.perf_counter()
    for name, precision, seed in (
        ("reference samples", "int4-native", 101),
        ("int4-native", "int4-native", 0),
        ("int4-bf16act", "int4-bf16act", 0),
        ("nvfp4", "nvfp4", 0),
    ):
        sampler = Sampler(store.get(precision), tokenizer, stop_token_ids=[])
        pools[name] = by_probe(build_pool(sampler, reference, prompts, args.pool, args.tokens, seed))
        print(f"pool {name}: {args.prompts * args.pool} completions ({time.perf_counter() - started:.0f} s)", flush=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(pickle.dumps(pools))
    return pools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=25)
    parser.add_argument("--pool", type=int, default=16, help="completions per prompt in each precision's pool")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached pools")
    parser.add_argument("--sample-margin", type=float, default=None, help="override verify.margin.sample_mean_z")
    args = parser.parse_args()
    params = load_params(ROOT / "params.yaml")
    m, d = params.verify.margin, params.verify.decision
    margins = Margins(
        m.mean_abs_dlogprob,
        m.tail_dlogprob,
        m.tail_p0,
        args.sample_margin or m.sample_mean_z,
        m.sample_tail_z,
        m.sample_tail_p0,
        m.sample_equivalence_z,
    )
    policy = Policy(d.alpha, d.correction, d.min_power, d.mixture_share, d.max_failed_share)
    pools = load_or_build_pools(args, params)

    bf16 = [
        statistics.fmean(abs(a - b) for a, b in zip(i.provider_logprobs, i.reference_logprobs, strict=False))
        for items in pools["int4-bf16act"].values()
        for i in items
    ]
    nv = [
        statistics.fmean(abs(a - b) for a, b in zip(i.provider_logprobs, i.reference_logprobs, strict=False))
        for items in pools["nvfp4"].values()
        for i in items
    ]
    print(f"\nper-completion mean |Δ logprob| (calibration; margin {m.mean_abs_dlogprob}, extreme above {m.tail_dlogprob}):")
    for name, values in (("int4-bf16act", bf16), ("nvfp4", nv)):
        q = np.quantile(values, [0.5, 0.99, 1.0] if name != "nvfp4" else [0.0, 0.01, 0.5])
        above = sum(v > m.tail_dlogprob for v in values)
        mean = statistics.fmean(values)
        print(f"  {name:<13} mean {mean:.4f}  quantiles {np.round(q, 4).tolist()}  above threshold {above}/{len(values)}")

    subjects = ("int4-native", "int4-bf16act", "nvfp4", "mix-20%-nvfp4")
    budgets = (1, 2, 3, 5, 8, 11, 15, 20)
    ks = tuple(k for k in (1, 2, 3, 5, 10) if k <= args.pool)
    lp_rate: Counter[tuple[str, int]] = Counter()
    lp_equiv: Counter[tuple[str, int]] = Counter()
    sm_rate: Counter[tuple[str, int, str]] = Counter()
    for seed in range(args.seeds):
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        mix = mixture(pools["int4-native"], pools["nvfp4"], 0.2, rng)
        subject_pools = {
            "int4-native": pools["int4-native"],
            "int4-bf16act": pools["int4-bf16act"],
            "nvfp4": pools["nvfp4"],
            "mix-20%-nvfp4": mix,
        }
        for name in subjects:
            for n in budgets:
                judged = verdict(logprob_audit(subject_pools[name], n, rng), margins, policy, seed)
                lp_rate[(name, n)] += judged == "different"
                lp_equiv[(name, n)] += judged == "equivalent"
            for k in ks:
                audit = sample_audit(subject_pools[name], pools["reference samples"], k, rng)
                judged = verdict(audit, margins, policy, seed)
                sm_rate[(name, k, "ours")] += judged == "different"
                sm_rate[(name, k, "equivalent")] += judged == "equivalent"
                provider = [s for s in audit.sampled if s.source == "provider"]
                ref = [s for s in audit.sampled if s.source == "reference"]
                mmd = stats.mmd_hamming_test(
                    [s.token_ids for s in provider],
                    [s.token_ids for s in ref],
                    [s.probe_id for s in provider],
                    [s.probe_id for s in ref],
                    n_permutations=500,
                    rng=nrng,
                )
                sm_rate[(name, k, "mmd")] += mmd.pvalue < policy.alpha
    s = args.seeds
    print(f"\nLogprob mode: share of {s} seeds found DIFFERENT (alpha {policy.alpha}; faithful rows are false-positive rates)")
    print("audited completions  " + "".join(f"{n:>7}" for n in budgets))
    for name in subjects:
        print(f"{name:<21}" + "".join(f"{lp_rate[(name, n)] / s:>7.2f}" for n in budgets))
    print("share found EQUIVALENT")
    for name in subjects:
        print(f"{name:<21}" + "".join(f"{lp_equiv[(name, n)] / s:>7.2f}" for n in budgets))
    print(f"\nSample mode ({args.prompts} prompts): share of {s} seeds found DIFFERENT, ours vs MMD-Hamming on the same samples")
    print("samples per prompt   " + "".join(f"{k:>12}" for k in ks))
    for name in subjects:
        cells = "".join(f"{sm_rate[(name, k, 'ours')] / s:>6.2f}/{sm_rate[(name, k, 'mmd')] / s:<5.2f}" for k in ks)
        print(f"{name:<21}{cells}")
    print("share found EQUIVALENT (ours)")
    for name in subjects:
        print(f"{name:<21}" + "".join(f"{sm_rate[(name, k, 'equivalent')] / s:>12.2f}" for k in ks))
    print("\nsample-mode rank score per completion (0 ± 1/√tokens for the reference's own text), and z above the tail threshold:")
    for name in ("reference samples", "int4-native", "int4-bf16act", "nvfp4"):
        scored = [
            (i.rank_score(f"calibration:{j}"), len(i.reference_logprobs))
            for items in pools[name].values()
            for j, i in enumerate(items)
        ]
        values = [v for v, _ in scored]
        extreme = sum(v * n**0.5 > m.sample_tail_z for v, n in scored)
        spread = f"{statistics.fmean(values):+.4f} ± {statistics.stdev(values):.4f}"
        print(f"  {name:<18} {spread}   z > {m.sample_tail_z}: {extreme}/{len(values)}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
