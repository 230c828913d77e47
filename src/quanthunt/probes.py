"""The audit's plan: which prompts probe every provider, in which seeded order, and what
each probe request asks for (``Design``, from the ``verify`` params).

The probe set is drawn reproducibly from the prompt datasets, stratified across them: the
same params and prompt files give the same probes in the same order, and each completion
of a probe its own stable sampling seed. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from quanthunt.params import Params, Reasoning
from quanthunt.prompts import PromptRecord, skeleton


@dataclass(frozen=True)
class Probe:
    """A prompt to audit with: the first request of a dataset record (system + first user turn)."""

    id: str
    dataset: str
    messages: tuple[tuple[str, str], ...]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _rank(seed: int, dataset: str, record_id: str) -> str:
    return hashlib.sha256(f"{seed}:{dataset}:{record_id}".encode()).hexdigest()


def select_probes(datasets: Mapping[str, Sequence[PromptRecord]], *, count: int, seed: int) -> list[Probe]:
    """``count`` probes, taken round-robin across datasets (sorted by name), each dataset's
    records in a seeded hash order: the same params and inputs give the same probe set."""
    queues = {
        name: sorted(records, key=lambda r, name=name: _rank(seed, name, r.id))  # type: ignore[misc]
        for name, records in sorted(datasets.items())
    }
    probes: list[Probe] = []
    while len(probes) < count and any(queues.values()):
        for name, queue in queues.items():
            if queue and len(probes) < count:
                record = queue.pop(0)
                first = skeleton(record)[0]
                probes.append(Probe(f"{name}:{record.id}", name, tuple((t.role, t.content) for t in first)))
    return probes


def probe_seed(seed: int, probe_id: str, index: int) -> int:
    """The sampling seed of completion ``index`` of a probe (stable, 31-bit)."""
    return int(hashlib.sha256(f"{seed}:{probe_id}:{index}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def convention_temperature(temperature: float, top_p: float) -> float | None:
    """Where a provider's logprobs may read otherwise than the reference's: sampling at a
    temperature in (0, 1) with top-p 1 (``measurements.compare_logprobs``' ``processed_at``).
    At T 1 both conventions are the same numbers; under a nucleus cut, processed logprobs'
    normaliser needs the mass the reference does not list (read raw), and above 1 the
    unlisted mass has no bound."""
    return temperature if 0.0 < temperature < 1.0 and top_p == 1.0 else None


@dataclass(frozen=True)
class Design:
    """What the audit asks of each provider (from ``verify`` params)."""

    model: str
    seed: int
    completions_per_prompt: int
    sample_mode_completions_per_prompt: int
    max_tokens: int
    temperature: float
    top_logprobs: int
    max_attempts: int
    reasoning: Reasoning
    rank_tokens: int
    """The rank statistic's horizon (``measurements.rank``): the tokens the mixture
    detection rates were measured at, ``decision.mixture_detection_tokens``."""
    convention_temperature: float | None = None
    """The generation's temperature where a provider's logprobs may be reported after it
    (``convention_temperature``): each logprob-mode provider is also asked
    ``survey.CONVENTION_PROBES`` probes there, read for that only. None: not asked."""

    @classmethod
    def of(cls, params: Params) -> Design:
        """The design ``params.yaml`` asks for (``verify``, its ``probes``, ``reasoning``)."""
        v, p = params.verify, params.verify.probes
        return cls(
            model=params.survey.model,
            seed=v.seed,
            completions_per_prompt=p.completions_per_prompt,
            sample_mode_completions_per_prompt=p.sample_mode_completions_per_prompt,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_logprobs=p.top_logprobs,
            max_attempts=v.max_attempts,
            reasoning=params.reasoning,
            rank_tokens=v.decision.mixture_detection_tokens,
            convention_temperature=convention_temperature(params.generate.sampling.temperature,
                                                          params.generate.sampling.top_p),
        )  # fmt: skip
