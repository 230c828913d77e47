"""Measuring each provider against the reference, and deciding.

The probe set is drawn reproducibly from the prompt datasets, stratified across them.
Every provider is pinned (``only: [tag]``, no fallbacks, ``require_parameters``) and
audited in one of two modes:

- **logprob mode** (the endpoint returns logprobs): the provider samples a completion with
  its top-k logprobs; the reference scores the same tokens teacher-forced. Per position:
  ``Δ = provider logprob − reference logprob`` of the sampled token, KL(reference ‖
  provider) over the top-k union with a tail bucket, and top-1 agreement.
- **sample mode** (no logprobs): provider and reference each sample completions for the
  same prompts; the reference scores every completion (mean log-likelihood per token).

``decide`` turns the measurements of all providers into verdicts (see its docstring).
The I/O (HTTP, files, MLflow) lives in the stage; this module is pure computation plus
the async measurement loops over injected clients.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from quanthunt import stats
from quanthunt.gateway import TRANSIENT, ChatReply, Gateway, GatewayError, Routing, TokenLogprob, chat_body, same_provider
from quanthunt.params import Reasoning
from quanthunt.prompts import PromptRecord, skeleton
from quanthunt.reference import PARTIAL, Position, Reference, Scored, canonical_name, merge_by_name
from quanthunt.verdicts import Estimate, ProviderVerdict, TestResult, Verdict

T = TypeVar("T")
RETRYABLE = TRANSIENT | {"malformed", "unexpected_reply", "finish_error", "openrouter_in_flight_budget"}
"""Gateway failure kinds worth another attempt."""


# -- the probe set ------------------------------------------------------------------------


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


# -- measurements ------------------------------------------------------------------------


@dataclass
class LogprobCompletion:
    """One audited completion in logprob mode."""

    probe_id: str
    index: int
    tokens: int
    aligned: int
    """Positions where the reference's tokenization of the text matches the provider's tokens
    (all of them unless the provider's tokenization is non-canonical; we stop at the first
    mismatch)."""
    deltas: list[float]
    kls: list[float]
    top1_agree: list[bool]

    @property
    def mean_abs_delta(self) -> float:
        return statistics.fmean(abs(d) for d in self.deltas) if self.deltas else 0.0


@dataclass
class SampledText:
    """A completion scored at the reference (sample mode)."""

    probe_id: str
    index: int
    source: str  # "provider" | "reference"
    token_ids: list[int]
    mean_loglik: float
    rank_score: float = 0.0
    """Mean over tokens of the normal score ``Φ⁻¹(u_t)`` of the token's randomised
    probability-integral transform under the reference (``u_t`` = the reference's mass on
    tokens it ranks above the sampled one, plus a uniform share of the token's own mass;
    uniform over the tail beyond the top-k). For text the reference samples itself every
    ``u_t`` is exactly uniform, so the score is N(0, 1/tokens) with no calibration run;
    text from a coarser model picks tokens the reference ranks lower, and scores higher."""
    tokens: int = 0


@dataclass
class Audit:
    """Everything measured for one provider."""

    provider: str
    tag: str
    mode: str
    logprob: list[LogprobCompletion] = field(default_factory=list)
    sampled: list[SampledText] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    served_by: Counter[str] = field(default_factory=Counter)
    cost_usd: float = 0.0
    tokens: int = 0
    attempted: int = 0


async def with_retries(call: Callable[[], Awaitable[T]], *, attempts: int, errors: Counter[str]) -> T:
    """Retry transient gateway failures with exponential backoff, honouring Retry-After."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except GatewayError as exc:
            errors[exc.kind] += 1
            if exc.kind not in RETRYABLE or attempt == attempts:
                raise
            await asyncio.sleep(min(exc.retry_after_s if exc.retry_after_s is not None else 0.2 * 2**attempt, 10.0))
    raise AssertionError("unreachable")


RANK_TOP_K = 20
"""Top logprobs asked of the reference when scoring sample-mode texts (the rank statistic)."""

_STANDARD_NORMAL = statistics.NormalDist()
"""Per-token quantiles: the stdlib's is ~1,000x faster than scipy's on scalars, equal to 1e-15."""


def pit_normal_score(position: Position, *, listed: int, u: float) -> float:
    """``Φ⁻¹`` of the randomised PIT of one token (see ``SampledText.rank_score``).

    ``position`` holds the reference's top-``listed`` alternatives, with or without the
    scored token (vLLM adds it, SGLang does not): membership in the top is decided by value
    (``Position.in_top``), never by the list's length. ``u`` is a uniform draw in [0, 1)."""
    p = math.exp(position.logprob)
    others = position.outranked_by()
    if position.in_top(listed):
        above = sum(math.exp(v) for v in others if v > position.logprob)
        ties = sum(math.exp(v) for v in others if v == position.logprob)
        value = above + u * (p + ties)
    else:
        listed_mass = min(sum(math.exp(v) for v in others[:listed]), 1.0)
        value = listed_mass + u * (1.0 - listed_mass)
    return _STANDARD_NORMAL.inv_cdf(min(max(value, 1e-12), 1 - 1e-12))


def rank_score(positions: Sequence[Position], *, listed: int, seed: str) -> float:
    """Mean normal score of a completion's tokens (seeded jitter: same text, same score)."""
    rng = np.random.default_rng(int(hashlib.sha256(seed.encode()).hexdigest()[:16], 16))
    scores = [pit_normal_score(position, listed=listed, u=float(rng.random())) for position in positions]
    return statistics.fmean(scores) if scores else 0.0


def names_pair(provider: str, reference: str) -> bool:
    """Whether a provider's token and the reference's re-tokenization agree at a position:
    the same decoded text, or a partial UTF-8 piece on either side (its text is empty)."""
    provider, reference = canonical_name(provider), canonical_name(reference)
    return provider == reference or PARTIAL in (provider, reference)


def compare_logprobs(
    probe_id: str, index: int, provider: Sequence[TokenLogprob], scored: Scored, prompt_len: int
) -> LogprobCompletion:
    """Pair the provider's tokens with the reference's teacher-forced scores, position by
    position, up to the first position where the two tokenizations disagree.

    Per position both sides list the sampled token and the same number of alternatives
    besides it (vLLM's chat lists only the top k−1 when the sampled token is outside the
    top k; its echo lists k), compared by decoded name in context and merged alike
    (``merge_by_name``), so a provider identical to the reference has KL exactly 0."""
    deltas: list[float] = []
    kls: list[float] = []
    agree: list[bool] = []
    for token, position in zip(provider, scored.positions[prompt_len:], strict=False):
        names = position.names if position is not None else None
        if position is None or names is None or not names_pair(token.token, names[position.key]):
            break
        deltas.append(token.logprob - position.logprob)
        listed = [(t.token, t.logprob) for t in token.top_logprobs]
        sampled = (token.token, token.logprob)
        alternatives = [t for t in listed if t != sampled] if sampled in listed else listed[: max(len(listed) - 1, 0)]
        provider_top = merge_by_name([sampled, *alternatives])
        depth = len(alternatives)
        reference_top = merge_by_name(
            [(names[position.key], position.logprob), *((names[k], v) for k, v in position.others()[:depth])]
        )
        kls.append(stats.kl_topk_with_tail(reference_top, provider_top))
        agree.append(max(provider_top, key=provider_top.__getitem__) == max(reference_top, key=reference_top.__getitem__))
    return LogprobCompletion(probe_id, index, len(provider), len(deltas), deltas, kls, agree)


class Auditor:
    """Runs the probes of one stage: gateway and reference clients, a concurrency limit,
    and caches of what every provider shares (prompt token ids, reference samples)."""

    def __init__(
        self, gateway: Gateway, reference: Reference, design: Design, *, concurrency: int, siblings: Sequence[str] = ()
    ) -> None:
        self.gateway = gateway
        self.siblings = tuple(siblings)
        """Every endpoint tag the survey listed (a pin on a base slug ignores its variants)."""
        self.reference = reference
        self.design = design
        self._gate = asyncio.Semaphore(concurrency)
        self._prompt_ids: dict[str, list[int]] = {}
        self._reference_samples: dict[tuple[str, int], asyncio.Task[SampledText | None]] = {}

    async def prompt_ids(self, probe: Probe, errors: Counter[str]) -> list[int]:
        if probe.id not in self._prompt_ids:
            kwargs = self.design.reasoning.reference_kwargs()
            ids = await with_retries(
                lambda: self.reference.tokenize_chat(probe.as_messages(), template_kwargs=kwargs),
                attempts=self.design.max_attempts,
                errors=errors,
            )
            self._prompt_ids[probe.id] = ids
        return self._prompt_ids[probe.id]

    async def _ask(self, audit: Audit, probe: Probe, index: int, *, logprobs: bool) -> ChatReply:
        d = self.design
        body = chat_body(
            model=d.model,
            messages=probe.as_messages(),
            max_tokens=d.max_tokens,
            temperature=d.temperature,
            seed=probe_seed(d.seed, probe.id, index),
            logprobs=logprobs,
            top_logprobs=d.top_logprobs if logprobs else None,
            routing=Routing().pin(audit.tag, siblings=self.siblings),
            reasoning=d.reasoning.request(),
        )
        reply = await with_retries(lambda: self.gateway.chat(body), attempts=d.max_attempts, errors=audit.errors)
        audit.served_by[reply.provider or "(not named)"] += 1
        if reply.usage is not None:
            audit.cost_usd += reply.usage.cost or 0.0
            audit.tokens += reply.usage.completion_tokens
        return reply

    async def completion_ids(
        self, text: str, reasoning: str | None, finish_reason: str | None, errors: Counter[str]
    ) -> list[int]:
        """The reference's tokens of what the model generated after the prompt: the answer,
        or with ``reasoning.mode: on`` the reasoning, the end of the thinking block and the
        answer (the block's end only if the budget left room for an answer)."""
        attempts = self.design.max_attempts

        async def tokens(piece: str) -> list[int]:
            return (
                await with_retries(lambda: self.reference.tokenize_text(piece), attempts=attempts, errors=errors) if piece else []
            )

        if self.design.reasoning.mode != "on" or reasoning is None:
            return await tokens(text)
        ids = await tokens(reasoning)
        if text or finish_reason != "length":
            ids += await tokens(self.design.reasoning.end_marker) + await tokens(text)
        return ids

    def thought_while_off(self, audit: Audit, reply: ChatReply) -> bool:
        """A reply that carries reasoning although thinking was turned off (a provider that
        ignores the switch, or a model whose reasoning is mandatory) cannot be paired."""
        if self.design.reasoning.mode == "off" and reply.reasoning:
            audit.errors["reasoning_not_off"] += 1
            return True
        return False

    async def _score_text(self, probe: Probe, index: int, source: str, ids: list[int], errors: Counter[str]) -> SampledText:
        prompt = await self.prompt_ids(probe, errors)
        if not ids:
            return SampledText(probe.id, index, source, [], 0.0)
        scored = await with_retries(
            lambda: self.reference.score(prompt + ids, top_logprobs=RANK_TOP_K), attempts=self.design.max_attempts, errors=errors
        )
        positions = [p for p in scored.positions[len(prompt) :] if p is not None]
        values = [p.logprob for p in positions]
        score = rank_score(positions, listed=RANK_TOP_K, seed=f"{probe.id}:{index}:{source}:{ids}")
        return SampledText(probe.id, index, source, ids, statistics.fmean(values) if values else 0.0, score, len(values))

    async def logprob_completion(self, audit: Audit, probe: Probe, index: int) -> None:
        async with self._gate:
            audit.attempted += 1
            try:
                reply = await self._ask(audit, probe, index, logprobs=True)
                if not reply.logprobs and not (reply.content or reply.reasoning):
                    audit.failed += 1  # nothing generated (the model stopped at once): nothing to pair
                    audit.errors["empty_completion"] += 1
                    return
                if not reply.logprobs:
                    raise GatewayError("the provider returned no logprobs", kind="no_logprobs")
                if self.thought_while_off(audit, reply):
                    audit.failed += 1
                    return
                prompt = await self.prompt_ids(probe, audit.errors)
                ids = await self.completion_ids(reply.content, reply.reasoning, reply.finish_reason, audit.errors)
                scored = await with_retries(
                    lambda: self.reference.score(prompt + ids, top_logprobs=self.design.top_logprobs, names=True),
                    attempts=self.design.max_attempts,
                    errors=audit.errors,
                )
                audit.logprob.append(compare_logprobs(probe.id, index, reply.logprobs, scored, len(prompt)))
            except GatewayError as exc:
                audit.failed += 1
                if exc.kind == "no_logprobs":
                    audit.errors[exc.kind] += 1

    async def reference_sample(self, probe: Probe, index: int) -> SampledText | None:
        key = (probe.id, index)
        if key not in self._reference_samples:
            self._reference_samples[key] = asyncio.ensure_future(self._reference_sample(probe, index))
        return await self._reference_samples[key]

    async def _reference_sample(self, probe: Probe, index: int) -> SampledText | None:
        d = self.design
        errors: Counter[str] = Counter()
        async with self._gate:
            try:
                sampled = await with_retries(
                    lambda: self.reference.sample(
                        probe.as_messages(),
                        max_tokens=d.max_tokens,
                        temperature=d.temperature,
                        seed=probe_seed(d.seed + 1, probe.id, index),
                        template_kwargs=d.reasoning.reference_kwargs(),
                    ),
                    attempts=d.max_attempts,
                    errors=errors,
                )
                ids = await self.completion_ids(sampled.text, sampled.reasoning, sampled.finish_reason, errors)
                return await self._score_text(probe, index, "reference", ids, errors)
            except GatewayError:
                return None

    async def sampled_completion(self, audit: Audit, probe: Probe, index: int) -> None:
        async with self._gate:
            audit.attempted += 1
            try:
                reply = await self._ask(audit, probe, index, logprobs=False)
                if self.thought_while_off(audit, reply):
                    audit.failed += 1
                    return
                ids = await self.completion_ids(reply.content, reply.reasoning, reply.finish_reason, audit.errors)
                audit.sampled.append(await self._score_text(probe, index, "provider", ids, audit.errors))
            except GatewayError:
                audit.failed += 1
                return
        reference = await self.reference_sample(probe, index)
        if reference is not None:
            audit.sampled.append(reference)

    async def audit(self, provider: str, tag: str, *, logprobs: bool, probes: Sequence[Probe]) -> Audit:
        audit = Audit(provider, tag, "logprob" if logprobs else "sample")
        k = self.design.completions_per_prompt if logprobs else self.design.sample_mode_completions_per_prompt
        work = self.logprob_completion if logprobs else self.sampled_completion
        await asyncio.gather(*(work(audit, probe, i) for probe in probes for i in range(k)))
        audit.logprob.sort(key=lambda c: (c.probe_id, c.index))
        audit.sampled.sort(key=lambda s: (s.source, s.probe_id, s.index))
        return audit


# -- decisions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Margins:
    """Tolerances (from ``verify.margin``), calibrated on a faithful provider with other numerics."""

    mean_abs_dlogprob: float
    tail_dlogprob: float
    tail_p0: float
    sample_mean_z: float
    sample_tail_z: float
    sample_tail_p0: float
    sample_equivalence_z: float


@dataclass(frozen=True)
class Policy:
    alpha: float
    correction: str
    min_power: float
    mixture_share: float
    max_failed_share: float


@dataclass
class _Tests:
    """A provider's tests before correction."""

    difference: list[tuple[str, float, float, str]]  # (name, statistic, p, null)
    equivalence: list[tuple[str, float, float, str]]
    baseline: list[tuple[str, float, float, str]]
    effects: dict[str, Estimate]
    power: dict[str, float]
    probes_needed: int | None
    completions: int


def _estimate(values: Sequence[float], clusters: Sequence[str], rng: np.random.Generator) -> Estimate:
    if not values:
        return Estimate(value=0.0, ci_low=0.0, ci_high=0.0)
    if len(values) < 2:
        return Estimate(value=float(values[0]), ci_low=float(values[0]), ci_high=float(values[0]))
    low, high = stats.bootstrap_ci(values, rng=rng, clusters=list(clusters), n_resamples=1000)
    return Estimate(value=float(np.mean(values)), ci_low=float(low), ci_high=float(high))


def _per_probe(values: Sequence[float], probes: Sequence[str]) -> list[float]:
    grouped: dict[str, list[float]] = {}
    for value, probe in zip(values, probes, strict=True):
        grouped.setdefault(probe, []).append(value)
    return [statistics.fmean(v) for _, v in sorted(grouped.items())]


def _needed(fn: Callable[[], int]) -> int | None:
    try:
        return fn()
    except ValueError:
        return None


def logprob_tests(audit: Audit, margins: Margins, policy: Policy, rng: np.random.Generator) -> _Tests:
    completions = [c for c in audit.logprob if c.deltas]
    means = [c.mean_abs_delta for c in completions]
    probes = [c.probe_id for c in completions]
    per_probe = _per_probe(means, probes)
    flagged = sum(1 for m in means if m > margins.tail_dlogprob)
    n = len(completions)
    tests = _Tests([], [], [], {}, {}, None, n)
    if n < 2:
        return tests
    above = stats.one_sided_mean_test(per_probe, threshold=margins.mean_abs_dlogprob, alternative="greater")
    below = stats.one_sided_mean_test(per_probe, threshold=margins.mean_abs_dlogprob, alternative="less")
    tail_p = stats.binomial_tail_test(flagged, n, p0=margins.tail_p0)
    tests.difference = [
        ("mean |Δ logprob| above margin", above.statistic, above.pvalue, f"mean |Δ| ≤ {margins.mean_abs_dlogprob}"),
        (
            "extreme completions (tail)",
            float(flagged),
            tail_p,
            f"share of completions with mean |Δ| > {margins.tail_dlogprob} ≤ {margins.tail_p0}",
        ),
    ]
    tests.equivalence = [
        ("mean |Δ logprob| below margin", below.statistic, below.pvalue, f"mean |Δ| ≥ {margins.mean_abs_dlogprob}")
    ]
    tokens_kl = [statistics.fmean(c.kls) for c in completions if c.kls]
    agree = [statistics.fmean(1.0 if a else 0.0 for a in c.top1_agree) for c in completions if c.top1_agree]
    low, high = _binomial_ci(flagged, n)
    tests.effects = {
        "mean_abs_dlogprob": _estimate(means, probes, rng),
        "max_abs_dlogprob": _estimate([max(abs(d) for d in c.deltas) for c in completions], probes, rng),
        "mean_kl_topk": _estimate(tokens_kl, probes[: len(tokens_kl)], rng),
        "top1_agreement": _estimate(agree, probes[: len(agree)], rng),
        "extreme_share": Estimate(value=flagged / n, ci_low=low, ci_high=high),
    }
    sd = below.sd if below.sd > 0 and math.isfinite(below.sd) else 1e-9
    effect = (margins.mean_abs_dlogprob - below.mean) / sd
    tests.power = {
        "tail": stats.tail_power(policy.mixture_share, n, p0=margins.tail_p0, alpha=policy.alpha),
        "equivalence": stats.mean_shift_power(effect, len(per_probe), alpha=policy.alpha) if effect > 0 else 0.0,
    }
    need_tail = _needed(lambda: stats.probes_for_tail(policy.mixture_share, p0=margins.tail_p0, alpha=policy.alpha, max_n=5000))
    need_mean = _needed(lambda: stats.probes_for_mean_shift(effect, alpha=policy.alpha, max_n=5000)) if effect > 0 else None
    tests.probes_needed = max(v for v in (need_tail, need_mean, 2) if v is not None)
    return tests


def sample_tests(audit: Audit, margins: Margins, policy: Policy, rng: np.random.Generator) -> _Tests:
    """Sample mode, on each provider completion's ``rank_score`` (mean normal score of its
    tokens' PIT under the reference), whose null distribution is known exactly: N(0, 1/n)
    for n tokens, no reference samples needed to calibrate it.

    - mean test: the mean score over completions above ``sample_mean_z`` → different (a
      faithful provider on other numerics shifts it by ~0.01, NVFP4 by ~0.23); below the
      wider ``sample_equivalence_z`` → equivalent;
    - tail test: completions whose z (score × √n) exceeds ``sample_tail_z`` are extreme; more
      of them than a faithful provider's ``sample_tail_p0`` share → different (a mixture);
    - reported for comparison on the same samples: the reference's own samples scored the same
      way (a check that the scoring path is sound: they should centre on 0), a stratified
      permutation test of mean log-likelihood, and MMD with a Hamming kernel (Gao et al. 2025).
    """
    provider = [s for s in audit.sampled if s.source == "provider" and s.tokens]
    reference = [s for s in audit.sampled if s.source == "reference" and s.tokens]
    tests = _Tests([], [], [], {}, {}, None, len(provider))
    if len(provider) < 2:
        return tests
    scores = [s.rank_score for s in provider]
    zs = [s.rank_score * math.sqrt(s.tokens) for s in provider]
    flagged = sum(1 for z in zs if z > margins.sample_tail_z)
    above = stats.one_sided_mean_test(scores, threshold=margins.sample_mean_z, alternative="greater")
    below = stats.one_sided_mean_test(scores, threshold=margins.sample_equivalence_z, alternative="less")
    tail_p = stats.binomial_tail_test(flagged, len(zs), p0=margins.sample_tail_p0)
    tests.difference = [
        ("rank score above margin", above.statistic, above.pvalue, f"mean rank score ≤ {margins.sample_mean_z}"),
        (
            "extreme completions (tail of rank z)",
            float(flagged),
            tail_p,
            f"share of completions with z > {margins.sample_tail_z} ≤ {margins.sample_tail_p0}",
        ),
    ]
    tests.equivalence = [
        ("rank score below margin", below.statistic, below.pvalue, f"mean rank score ≥ {margins.sample_equivalence_z}")
    ]
    sx = [s.probe_id for s in provider]
    if len(reference) >= 2 and len({s.probe_id for s in reference} & set(sx)) >= 2:
        sy = [s.probe_id for s in reference]
        x, y = [s.mean_loglik for s in provider], [s.mean_loglik for s in reference]
        loglik = stats.stratified_permutation_test(
            x, y, sx, sy, statistic="mean", alternative="less", n_permutations=2000, rng=rng
        )
        mmd = stats.mmd_hamming_test(
            [s.token_ids for s in provider], [s.token_ids for s in reference], sx, sy, n_permutations=1000, rng=rng
        )
        tests.baseline = [
            (
                "mean log-likelihood, stratified permutation (no margin)",
                loglik.statistic,
                loglik.pvalue,
                "exchangeable within prompt",
            ),
            ("MMD, Hamming kernel (Gao et al. 2025)", mmd.statistic, mmd.pvalue, "same distribution"),
        ]
        tests.effects["reference_rank_score"] = _estimate([s.rank_score for s in reference], sy, rng)
    low, high = _binomial_ci(flagged, len(zs))
    tests.effects |= {
        "rank_score": _estimate(scores, sx, rng),
        "extreme_share": Estimate(value=flagged / len(zs), ci_low=low, ci_high=high),
        "provider_mean_loglik": _estimate([s.mean_loglik for s in provider], sx, rng),
    }
    sd = below.sd if below.sd > 0 and math.isfinite(below.sd) else 1e-9
    effect = (margins.sample_equivalence_z - below.mean) / sd
    n = len(scores)
    tests.power = {
        "tail": stats.tail_power(policy.mixture_share, n, p0=margins.sample_tail_p0, alpha=policy.alpha),
        "equivalence": stats.mean_shift_power(effect, n, alpha=policy.alpha) if effect > 0 else 0.0,
    }
    need_tail = _needed(
        lambda: stats.probes_for_tail(policy.mixture_share, p0=margins.sample_tail_p0, alpha=policy.alpha, max_n=5000)
    )
    need_mean = _needed(lambda: stats.probes_for_mean_shift(effect, alpha=policy.alpha, max_n=5000)) if effect > 0 else None
    tests.probes_needed = max(v for v in (need_tail, need_mean, 2) if v is not None)
    return tests


def _binomial_ci(k: int, n: int) -> tuple[float, float]:
    from scipy.stats import binomtest

    interval = binomtest(k, n).proportion_ci(confidence_level=0.95)
    return float(interval.low), float(interval.high)


@dataclass(frozen=True)
class Subject:
    """A provider to judge, as the survey described it."""

    provider: str
    tag: str
    declared_quantization: str
    survey_decision: str


def decide(
    subjects: Sequence[Subject], audits: Sequence[Audit], margins: Margins, policy: Policy, *, seed: int
) -> list[ProviderVerdict]:
    """Verdicts for every provider, with multiple-testing correction across providers.

    - ``different``: a difference test rejects after correction (Holm or BH over every
      provider's difference tests): the mean shift exceeds the margin, or there are more
      extreme completions than a faithful provider produces (a mixture).
    - ``equivalent``: no difference test rejects, the equivalence test rejects after
      correction (the mean is shown to be inside the margin, never inferred from a
      non-significant difference), every power figure reaches ``min_power``, and the
      responses all named this provider.
    - ``inconclusive``: otherwise: too many failed requests, too little power (with the
      probes the tests would need), or responses served by another provider.
    """
    rng = np.random.default_rng(seed)
    all_tests = [
        logprob_tests(a, margins, policy, rng) if a.mode == "logprob" else sample_tests(a, margins, policy, rng) for a in audits
    ]
    method = "holm" if policy.correction == "holm" else "bh"
    diff_p = [p for t in all_tests for (_, _, p, _) in t.difference]
    equiv_p = [p for t in all_tests for (_, _, p, _) in t.equivalence]
    diff_adj = iter(stats.adjust(diff_p, method) if diff_p else [])  # type: ignore[arg-type]
    equiv_adj = iter(stats.adjust(equiv_p, method) if equiv_p else [])  # type: ignore[arg-type]
    verdicts = []
    for subject, audit, tests in zip(subjects, audits, all_tests, strict=True):
        results: list[TestResult] = []
        for name, statistic, p, null in tests.difference:
            results.append(
                TestResult(
                    name=name, kind="difference", statistic=_finite(statistic), p_value=p, p_adjusted=next(diff_adj), null=null
                )
            )
        for name, statistic, p, null in tests.equivalence:
            results.append(
                TestResult(
                    name=name, kind="equivalence", statistic=_finite(statistic), p_value=p, p_adjusted=next(equiv_adj), null=null
                )
            )
        for name, statistic, p, null in tests.baseline:
            results.append(
                TestResult(name=name, kind="baseline", statistic=_finite(statistic), p_value=p, p_adjusted=None, null=null)
            )
        verdict, reason = _judge(subject, audit, tests, results, policy)
        verdicts.append(
            ProviderVerdict(
                provider=subject.provider,
                tag=subject.tag,
                declared_quantization=subject.declared_quantization,
                survey_decision=subject.survey_decision,
                eligible=verdict == "equivalent" and subject.survey_decision == "candidate",
                mode=audit.mode,  # type: ignore[arg-type]
                verdict=verdict,
                reason=reason,
                tests=results,
                effects=tests.effects,
                power={k: round(v, 4) for k, v in tests.power.items()},
                probes_needed=tests.probes_needed if verdict == "inconclusive" else None,
                probes=len({c.probe_id for c in audit.logprob} | {s.probe_id for s in audit.sampled}),
                completions=tests.completions,
                failed_requests=audit.failed,
                errors=dict(audit.errors),
                tokens=audit.tokens,
                served_by=dict(audit.served_by),
                cost_usd=round(audit.cost_usd, 8),
            )
        )
    return verdicts


def _finite(value: float) -> float:
    if math.isnan(value):
        return 0.0
    return max(min(value, 1e300), -1e300)


def _judge(subject: Subject, audit: Audit, tests: _Tests, results: Sequence[TestResult], policy: Policy) -> tuple[Verdict, str]:
    others = {name: n for name, n in audit.served_by.items() if not same_provider(name, subject.provider, subject.tag)}
    if audit.attempted and audit.failed / audit.attempted > policy.max_failed_share:
        kinds = ", ".join(f"{k} ×{n}" for k, n in audit.errors.most_common(3)) or "errors"
        return "inconclusive", f"{audit.failed} of {audit.attempted} probe requests failed ({kinds})"
    if others:
        return "inconclusive", "responses named another provider: " + ", ".join(f"{k} ×{n}" for k, n in others.items())
    if tests.completions < 2:
        return "inconclusive", "too few completions were measured"
    rejected = [r for r in results if r.kind == "difference" and r.p_adjusted is not None and r.p_adjusted < policy.alpha]
    if rejected:
        return "different", "; ".join(f"{r.name} (p_adj={r.p_adjusted:.2g})" for r in rejected)
    equivalence = [r for r in results if r.kind == "equivalence"]
    shown = equivalence and all(r.p_adjusted is not None and r.p_adjusted < policy.alpha for r in equivalence)
    weak = {k: v for k, v in tests.power.items() if v < policy.min_power and not (k == "equivalence" and shown)}
    if shown and not weak:
        return "equivalent", "within the margin (" + "; ".join(f"{r.name}, p_adj={r.p_adjusted:.2g}" for r in equivalence) + ")"
    if weak:
        needed = f"; about {tests.probes_needed} completions would be needed" if tests.probes_needed else ""
        return "inconclusive", "power too low at this budget (" + ", ".join(
            f"{k} {v:.2f}" for k, v in weak.items()
        ) + ")" + needed
    needed = f"; about {tests.probes_needed} completions would be needed" if tests.probes_needed else ""
    return "inconclusive", "no difference found, but equivalence within the margin was not shown" + needed


def summary_values(audit: Audit) -> dict[str, Any]:
    """Per-provider raw series for plots: per-token Δ (logprob mode) or per-completion
    log-likelihoods by source (sample mode)."""
    if audit.mode == "logprob":
        return {
            "deltas": [d for c in audit.logprob for d in c.deltas],
            "completion_means": [c.mean_abs_delta for c in audit.logprob],
        }
    return {
        "provider": [s.rank_score for s in audit.sampled if s.source == "provider"],
        "reference": [s.rank_score for s in audit.sampled if s.source == "reference"],
    }
