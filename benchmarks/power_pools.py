"""Pools of audited completions, one per served distribution, for ``verify_power.py``.

Each pool holds ``per_prompt`` completions for each of ``prompts`` probe prompts (drawn
from the shipped datasets with the verify stage's own ``select_probes``), sampled by the
sandbox's real precisions at T = 1 (or with a misconfigured sampler), ending where they
sample the stop token (kept as their last token, as vLLM keeps it) or at ``tokens``, with:

- the provider's reported logprob of every sampled token (the raw distribution, as vLLM
  reports it), and
- the reference's teacher-forced score of the same tokens with its top 20 alternatives,
  from which both modes' observations are computed exactly as the stage computes them.

A pool takes ~2-4 minutes on 2 cores; each is cached on its own under
``~/.cache/quanthunt/benchmarks`` (keyed by its settings), so an interrupted build resumes.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quanthunt.measurements import RANK_TOP_K
from quanthunt.probes import probe_seed, select_probes
from quanthunt.prompts import load_prompts
from quanthunt.reference import Position
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import PrecisionStore, cache_root, kv_format, load_reference
from quanthunt.sandbox.sampler import Sampler

ROOT = Path(__file__).resolve().parents[1]
VERSION = 5


@dataclass(frozen=True)
class Served:
    """What a provider really serves: a precision and its sampler."""

    precision: str
    temperature: float = 1.0
    """The temperature actually used when 1.0 was asked (a misconfigured sampler), or the
    generation's (the ``at T 0.7`` pools: the generate stage's default, for the monitor)."""
    top_p: float = 1.0
    """The nucleus actually used when 1.0 was asked (a forced top-p)."""
    seed: int = 0


SERVED = {
    "reference samples": Served("int4-native", seed=101),
    "int4-native": Served("int4-native"),
    "int4-bf16act": Served("int4-bf16act"),
    "int4-fp8kv": Served("int4-fp8kv"),
    "int4-bf16act-fp8kv": Served("int4-bf16act-fp8kv"),
    "nvfp4": Served("nvfp4"),
    "mxfp4": Served("mxfp4"),
    "int4-g128": Served("int4-g128"),
    "substitute": Served("substitute"),
    "temperature +0.3": Served("int4-native", temperature=1.3),
    "temperature -0.3": Served("int4-native", temperature=0.7),
    "temperature +0.1": Served("int4-native", temperature=1.1),
    "temperature -0.1": Served("int4-native", temperature=0.9),
    "forced top-p 0.9": Served("int4-native", top_p=0.9),
    "nvfp4 at T 0.7": Served("nvfp4", temperature=0.7),
    "int4-bf16act at T 0.7": Served("int4-bf16act", temperature=0.7),
    "int4-fp8kv at T 0.7": Served("int4-fp8kv", temperature=0.7),
}
"""Every pool: ``reference samples`` is the reference's own text (another seed), for the
MMD baseline; the rest are providers."""


@dataclass
class Item:
    """One pooled completion."""

    probe: str
    token_ids: list[int]
    provider_logprobs: list[float]
    reference: list[tuple[float, list[tuple[int, float]]]]
    """Per token: the reference's logprob of it and its top-20 alternatives."""

    def positions(self, listed: int = RANK_TOP_K) -> list[Position]:
        """The reference's view as the stage's client builds it (the token plus ``listed``)."""
        out = []
        for token, (logprob, top) in zip(self.token_ids, self.reference, strict=True):
            shown: dict[int | str, float] = dict(top[:listed])
            shown[token] = logprob
            out.append(Position(token, logprob, shown, token))
        return out

    @property
    def deltas(self) -> list[float]:
        return [p - r for p, (r, _) in zip(self.provider_logprobs, self.reference, strict=True)]


def _build(sampler: Sampler, reference: Sampler, prompts: list[tuple[str, list[int]]], served: Served,
           per_prompt: int, tokens: int) -> list[Item]:  # fmt: skip
    def request(probe: str, ids: list[int], j: int) -> SamplingRequest:
        seed = probe_seed(served.seed, probe, j)
        return SamplingRequest(tuple(ids), tokens, temperature=served.temperature, top_p=served.top_p, seed=seed)

    requests = [(probe, ids, request(probe, ids, j)) for probe, ids in prompts for j in range(per_prompt)]
    items: list[Item] = []
    for start in range(0, len(requests), 32):
        chunk = requests[start : start + 32]
        samples = sampler.sample([r for _, _, r in chunk])
        jobs = [(list(ids) + sample.token_ids, RANK_TOP_K) for (_, ids, _), sample in zip(chunk, samples, strict=True)]
        for (probe, ids, _), sample, score in zip(chunk, samples, reference.score_many(jobs), strict=True):
            tail = [t for t in score[len(ids) :] if t is not None]
            items.append(Item(probe, sample.token_ids, [t.logprob for t in sample.logprobs], [(t.logprob, t.top) for t in tail]))
    return items


def load_pools(
    *, prompts: int, per_prompt: int, tokens: int, rebuild: bool = False, served: Mapping[str, Served] = SERVED
) -> dict[str, dict[str, list[Item]]]:
    """The pools of ``served`` (every one of :data:`SERVED` by default), grouped by probe:
    from the cache (by name and settings), else built."""
    from quanthunt.params import load_params

    folder = cache_root() / "benchmarks"
    folder.mkdir(parents=True, exist_ok=True)
    pools: dict[str, dict[str, list[Item]]] = {}
    built: dict[str, Any] = {}
    for name, serves in served.items():
        slug = name.replace(" ", "_").replace("+", "p").replace("%", "")
        cached = folder / f"verify-pool-{slug}-p{prompts}-n{per_prompt}-t{tokens}-v{VERSION}.pkl"
        if cached.exists() and not rebuild:
            items = [Item(*row) for row in pickle.loads(cached.read_bytes())]
        else:
            if not built:
                params = load_params(ROOT / "params.yaml")
                model, tokenizer = load_reference()
                datasets = {n: load_prompts(params.paths.prompt_file(ROOT, n)) for n in params.datasets}
                probes = select_probes(datasets, count=prompts, seed=0)
                template = tokenizer.apply_chat_template
                built = {
                    "store": PrecisionStore(model),
                    "tokenizer": tokenizer,
                    "reference": Sampler(model, tokenizer, stop_token_ids=[]),  # scores only
                    "prompts": [
                        (p.id, list(template(p.as_messages(), add_generation_prompt=True, return_dict=True)["input_ids"]))
                        for p in probes
                    ],
                }
            started = time.perf_counter()
            model = built["store"].get(serves.precision)
            stops = [int(built["tokenizer"].eos_token_id)]  # as the sandbox serves: a reply ends at <|im_end|>
            sampler = Sampler(model, built["tokenizer"], stop_token_ids=stops, kv_format=kv_format(serves.precision))
            items = _build(sampler, built["reference"], built["prompts"], serves, per_prompt, tokens)
            cached.write_bytes(pickle.dumps([(i.probe, i.token_ids, i.provider_logprobs, i.reference) for i in items]))
            print(f"pool {name}: {len(items)} completions in {time.perf_counter() - started:.0f} s", flush=True)
        grouped: dict[str, list[Item]] = {}
        for item in items:
            grouped.setdefault(item.probe, []).append(item)
        pools[name] = grouped
    return pools


if __name__ == "__main__":
    import argparse

    import torch

    torch.set_num_threads(2)
    parser = argparse.ArgumentParser(description="build the verify_power.py pools")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--pool", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    load_pools(prompts=args.prompts, per_prompt=args.pool, tokens=args.tokens)
