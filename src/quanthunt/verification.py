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

Every measured completion also gets its rank z: the reference's randomised PIT of each
sampled token, as a normal score, summed and divided by √tokens (exactly N(0, 1) for text
the reference's own sampler produced). In sample mode it is the measurement; in logprob
mode it checks the provider's sampler, which the logprobs it reports say nothing about.

Probe requests go out under an adaptive in-flight limit (``quanthunt.congestion``): a
gateway that queues makes the audit slower, and a timed-out probe is sent again under the
lowered limit, never replaced by another. Every completion asked for is either measured or
counted in ``Audit.unusable`` with its reason.

The audit runs in rounds (``audit_rounds``): after each, the caller's ``settled`` says which
providers are decided, and the rest get the next probes of the same seeded order.
``quanthunt.decision`` turns the measurements into verdicts; this module holds the probe
set, the measurements and the async loops over injected clients.
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

import httpx
import numpy as np

from quanthunt import stats
from quanthunt.congestion import AdaptiveLimit
from quanthunt.defaults import GATEWAY_TIMEOUT
from quanthunt.gateway import TRANSIENT, ChatReply, Gateway, GatewayError, Routing, TokenLogprob, chat_body
from quanthunt.params import Params, Reasoning
from quanthunt.prompts import PromptRecord, skeleton
from quanthunt.reference import PARTIAL, Position, Reference, Scored, canonical_name, merge_by_name
from quanthunt.verdicts import ProviderVerdict

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
        )


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
    rank_z: float = 0.0
    """The sampler check: rank z of the paired tokens under the reference's top-k."""
    seq: int = 0
    """Position in the audit plan (probe order × completions + index): observations are
    tested in this order, so a later round never reorders an earlier one."""

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
    rank_z: float = 0.0
    """Sum over tokens of the normal score ``Φ⁻¹(u_t)`` of the token's randomised
    probability-integral transform under the reference, divided by √tokens (``u_t`` = the
    reference's mass on tokens it ranks above the sampled one, plus a uniform share of the
    token's own mass; uniform over the tail beyond the top-k). For text the reference
    samples itself every ``u_t`` is exactly uniform and independent of the past, so z is
    N(0, 1) with no calibration run; text from a coarser model or a hotter sampler picks
    tokens the reference ranks lower (z > 0), a colder or truncating sampler its favourites
    (z < 0)."""
    tokens: int = 0
    seq: int = 0
    """Position in the audit plan (see ``LogprobCompletion.seq``)."""


@dataclass
class Audit:
    """Everything measured for one provider."""

    provider: str
    tag: str
    mode: str
    logprob: list[LogprobCompletion] = field(default_factory=list)
    sampled: list[SampledText] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    """Failed attempts by kind (a retried request that then succeeded counts too)."""
    failed: int = 0
    """Completions asked for that gave nothing to measure (the sum of ``unusable``)."""
    unusable: Counter[str] = field(default_factory=Counter)
    """Each completion asked for and not measured, once, by why: the last error's kind
    (``timeout``, ``http_503``, ...), ``no_logprobs``, ``empty_completion``,
    ``unpaired_tokens``, ``reasoning_not_off``, ``unscored_tokens``. With the measured ones
    they add up to ``attempted``."""
    possibly_billed: int = 0
    """Requests that timed out after they were sent: the provider may have generated and
    billed them (their cost is not in ``cost_usd``)."""
    served_by: Counter[str] = field(default_factory=Counter)
    cost_usd: float = 0.0
    tokens: int = 0
    attempted: int = 0
    first_round_end: int = 0
    """Completions with ``seq`` below this came from the first round (the fixed-sample
    baselines' sample)."""

    def unusable_completion(self, reason: str) -> None:
        """A completion asked for that gives nothing to measure: counted, never dropped."""
        self.failed += 1
        self.unusable[reason] += 1


async def with_retries(call: Callable[[], Awaitable[T]], *, attempts: int, errors: Counter[str]) -> T:
    """Retry transient gateway failures with exponential backoff, honouring Retry-After."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except GatewayError as exc:
            errors[exc.kind] += 1
            if exc.kind not in RETRYABLE or attempt == attempts:
                raise
            await asyncio.sleep(backoff_s(exc, attempt))
    raise AssertionError("unreachable")


def backoff_s(error: GatewayError, attempt: int) -> float:
    """The pause before retry ``attempt + 1``: Retry-After when given, else exponential, at most 10 s."""
    return min(error.retry_after_s if error.retry_after_s is not None else 0.2 * 2**attempt, 10.0)


def probe_timeout(request_timeout_s: float) -> httpx.Timeout:
    """The gateway timeouts of probe requests: ``request_timeout_s`` from the moment a request
    is sent (it grows with ``max_tokens``, see ``gateway.read_timeout_s``). No pool timeout:
    the auditor's own limit decides what is sent (``probe_limits`` leaves a connection for
    every request it admits), so waiting in our own queue never counts as the gateway's
    slowness."""
    return httpx.Timeout(connect=GATEWAY_TIMEOUT.connect, read=request_timeout_s, write=GATEWAY_TIMEOUT.write, pool=None)


def probe_limits(concurrency: int) -> httpx.Limits:
    """A connection for each probe request the auditor may have in flight."""
    return httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)


RANK_TOP_K = 20
"""Top logprobs asked of the reference when scoring sample-mode texts (the rank statistic)."""

_STANDARD_NORMAL = statistics.NormalDist()
"""Per-token quantiles: the stdlib's is ~1,000x faster than scipy's on scalars, equal to 1e-15."""


def pit_normal_score(position: Position, *, listed: int, u: float) -> float:
    """``Φ⁻¹`` of the randomised PIT of one token (see ``SampledText.rank_z``).

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


def rank_z(positions: Sequence[Position], *, listed: int, seed: str) -> float:
    """A completion's rank z: its tokens' normal scores summed, over √tokens (seeded
    jitter: the same text gives the same z)."""
    rng = np.random.default_rng(int(hashlib.sha256(seed.encode()).hexdigest()[:16], 16))
    scores = [pit_normal_score(position, listed=listed, u=float(rng.random())) for position in positions]
    return math.fsum(scores) / math.sqrt(len(scores)) if scores else 0.0


def names_pair(provider: str, reference: str) -> bool:
    """Whether a provider's token and the reference's re-tokenization may be the same token
    at a position: the same decoded text, or a partial UTF-8 piece on either side (its text
    is empty). ``compare_logprobs`` then checks the text both sides have named agrees."""
    provider, reference = canonical_name(provider), canonical_name(reference)
    return provider == reference or PARTIAL in (provider, reference)


def compare_logprobs(
    probe_id: str, index: int, provider: Sequence[TokenLogprob], scored: Scored, prompt_len: int, *, listed: int, seq: int = 0
) -> LogprobCompletion:
    """Pair the provider's tokens with the reference's teacher-forced scores, position by
    position, up to the first position where the two tokenizations disagree. A partial
    UTF-8 piece pairs with anything, but only pairs up to the last position where both
    sides had named the same text count: a provider that sampled a character in other
    pieces than the reference's re-tokenization would otherwise be compared position by
    position with the wrong tokens (measured: a faithful reply came out extreme).

    Per position both sides list the sampled token and the same number of alternatives
    besides it (vLLM's chat lists only the top k−1 when the sampled token is outside the
    top k; its echo lists k), compared by decoded name in context and merged alike
    (``merge_by_name``), so a provider identical to the reference has KL exactly 0."""
    deltas: list[float] = []
    kls: list[float] = []
    agree: list[bool] = []
    paired: list[Position] = []
    said = heard = ""  # the text the provider's and the reference's tokens have named so far
    synced = 0  # pairs up to the last position both sides named whole, with the same text
    for token, position in zip(provider, scored.positions[prompt_len:], strict=False):
        names = position.names if position is not None else None
        if position is None or names is None or not names_pair(token.token, names[position.key]):
            break
        said += canonical_name(token.token)
        heard += canonical_name(names[position.key])
        if PARTIAL not in (canonical_name(token.token), canonical_name(names[position.key])):
            if said != heard:  # a piece paired with a whole token: the tokenizations parted before here
                break
            synced = len(deltas) + 1
        deltas.append(token.logprob - position.logprob)
        paired.append(position)
        shown = [(t.token, t.logprob) for t in token.top_logprobs]
        sampled = (token.token, token.logprob)
        alternatives = [t for t in shown if t != sampled] if sampled in shown else shown[: max(len(shown) - 1, 0)]
        provider_top = merge_by_name([sampled, *alternatives])
        depth = len(alternatives)
        reference_top = merge_by_name(
            [(names[position.key], position.logprob), *((names[k], v) for k, v in position.others()[:depth])]
        )
        kls.append(stats.kl_topk_with_tail(reference_top, provider_top))
        agree.append(max(provider_top, key=provider_top.__getitem__) == max(reference_top, key=reference_top.__getitem__))
    if said != heard or len(deltas) > synced:  # pieces at the end that never came back in step
        del deltas[synced:], kls[synced:], agree[synced:], paired[synced:]
    z = rank_z(paired, listed=listed, seed=f"{probe_id}:{index}:provider:{[p.token_id for p in paired]}")
    return LogprobCompletion(probe_id, index, len(provider), len(deltas), deltas, kls, agree, z, seq)


class Scorer:
    """Scores completions at the reference, teacher-forced: the verify stage's probes and
    the generate stage's monitored replies alike."""

    def __init__(self, reference: Reference, reasoning: Reasoning, *, top_logprobs: int, attempts: int) -> None:
        self.reference = reference
        self.reasoning = reasoning
        self.top_logprobs = top_logprobs
        self.attempts = attempts

    async def prompt_ids(self, messages: Sequence[Mapping[str, str]], errors: Counter[str]) -> list[int]:
        kwargs = self.reasoning.reference_kwargs()
        return await with_retries(
            lambda: self.reference.tokenize_chat(messages, template_kwargs=kwargs), attempts=self.attempts, errors=errors
        )

    async def completion_ids(
        self, text: str, reasoning: str | None, finish_reason: str | None, errors: Counter[str]
    ) -> list[int]:
        """The reference's tokens of what the model generated after the prompt: the answer,
        or with ``reasoning.mode: on`` the reasoning, the end of the thinking block and the
        answer (the block's end only if the budget left room for an answer)."""

        async def tokens(piece: str) -> list[int]:
            return (
                await with_retries(lambda: self.reference.tokenize_text(piece), attempts=self.attempts, errors=errors)
                if piece
                else []
            )

        if self.reasoning.mode != "on" or reasoning is None:
            return await tokens(text)
        ids = await tokens(reasoning)
        if text or finish_reason != "length":
            ids += await tokens(self.reasoning.end_marker) + await tokens(text)
        return ids

    async def logprobs(self, prompt: list[int], reply: ChatReply, errors: Counter[str], *, probe_id: str, index: int,
                       seq: int) -> LogprobCompletion:  # fmt: skip
        """Pair a reply's logprobs with the reference's scores of the same tokens."""
        assert reply.logprobs is not None
        ids = await self.completion_ids(reply.content, reply.reasoning, reply.finish_reason, errors)
        scored = await with_retries(
            lambda: self.reference.score(prompt + ids, top_logprobs=self.top_logprobs, names=True),
            attempts=self.attempts,
            errors=errors,
        )
        return compare_logprobs(probe_id, index, reply.logprobs, scored, len(prompt), listed=self.top_logprobs, seq=seq)

    async def text(self, prompt: list[int], ids: list[int], errors: Counter[str], *, probe_id: str, index: int,
                   source: str, seq: int) -> SampledText:  # fmt: skip
        """Score a text's tokens ``ids`` (its rank z and mean log-likelihood)."""
        if not ids:
            return SampledText(probe_id, index, source, [], 0.0, seq=seq)
        scored = await with_retries(
            lambda: self.reference.score(prompt + ids, top_logprobs=RANK_TOP_K), attempts=self.attempts, errors=errors
        )
        positions = [p for p in scored.positions[len(prompt) :] if p is not None]
        values = [p.logprob for p in positions]
        z = rank_z(positions, listed=RANK_TOP_K, seed=f"{probe_id}:{index}:{source}:{ids}")
        return SampledText(probe_id, index, source, ids, statistics.fmean(values) if values else 0.0, z, len(values), seq)


def thought_while_off(reasoning: Reasoning, reply: ChatReply, errors: Counter[str]) -> bool:
    """A reply that carries reasoning although thinking was turned off (a provider that
    ignores the switch, or a model whose reasoning is mandatory) cannot be paired."""
    if reasoning.mode == "off" and reply.reasoning:
        errors["reasoning_not_off"] += 1
        return True
    return False


class Auditor:
    """Runs the probes of one stage: gateway and reference clients, a concurrency limit,
    and caches of what every provider shares (prompt token ids, reference samples)."""

    def __init__(
        self,
        gateway: Gateway,
        reference: Reference,
        design: Design,
        *,
        concurrency: int,
        siblings: Sequence[str] = (),
        on_cut: Callable[[int, int], None] = lambda *_: None,
    ) -> None:
        self.gateway = gateway
        self.siblings = tuple(siblings)
        """Every endpoint tag the survey listed (a pin on a base slug ignores its variants)."""
        self.reference = reference
        self.design = design
        self.scorer = Scorer(reference, design.reasoning, top_logprobs=design.top_logprobs, attempts=design.max_attempts)
        self._gate = asyncio.Semaphore(concurrency)
        self.limit = AdaptiveLimit(concurrency, on_cut=on_cut)
        """Probe requests in flight at the gateway (``quanthunt.congestion``)."""
        self.free_timeout_retries = math.ceil(math.log2(concurrency)) + 1
        """Timeout retries that use up no attempt: enough cuts to take the limit to 1."""
        self._prompt_ids: dict[str, list[int]] = {}
        self._reference_samples: dict[tuple[str, int], asyncio.Task[SampledText | None]] = {}

    async def prompt_ids(self, probe: Probe, errors: Counter[str]) -> list[int]:
        if probe.id not in self._prompt_ids:
            self._prompt_ids[probe.id] = await self.scorer.prompt_ids(probe.as_messages(), errors)
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
        reply = await self.send(body, audit)
        audit.served_by[reply.provider or "(not named)"] += 1
        if reply.usage is not None:
            audit.cost_usd += reply.usage.cost or 0.0
            audit.tokens += reply.usage.completion_tokens
        return reply

    async def send(self, body: Mapping[str, Any], audit: Audit) -> ChatReply:
        """One probe request under the adaptive limit, retried as ``with_retries`` does.

        A timeout also cuts the limit, and the request is sent again (the same body, the
        same seed: the probe keeps its place in the seeded order and is never swapped for
        a luckier one). While the retry runs under a lower limit than the request was sent
        under, it uses up no attempt (at most ``free_timeout_retries`` times); a request
        that times out with the gateway to itself (limit 1) does.

        Why retry rather than move on: a long answer takes longer, so which requests time
        out depends on what was sampled, and dropping them would bias the measurements
        toward short answers. The retried request keeps its ``seq``, and one that still
        fails is reported (``Audit.unusable``), where ``decision.max_failed_share`` bounds
        how many there may be."""
        attempts = free = 0
        while True:
            async with self.limit.slot() as ticket:
                try:
                    reply = await self.gateway.chat(body)
                except GatewayError as exc:
                    audit.errors[exc.kind] += 1
                    error, lowered = exc, False
                    if exc.kind == "timeout":
                        audit.possibly_billed += 1
                        lowered = self.limit.timed_out(ticket)
                else:
                    self.limit.succeeded(ticket)
                    return reply
            if lowered and free < self.free_timeout_retries:
                free += 1
                continue
            attempts += 1
            if error.kind not in RETRYABLE or attempts >= self.design.max_attempts:
                raise error
            await asyncio.sleep(backoff_s(error, attempts))

    async def _score_text(
        self, probe: Probe, index: int, source: str, ids: list[int], errors: Counter[str], *, seq: int
    ) -> SampledText:
        prompt = await self.prompt_ids(probe, errors)
        return await self.scorer.text(prompt, ids, errors, probe_id=probe.id, index=index, source=source, seq=seq)

    async def logprob_completion(self, audit: Audit, probe: Probe, index: int, seq: int) -> None:
        async with self._gate:
            audit.attempted += 1
            try:
                reply = await self._ask(audit, probe, index, logprobs=True)
                if not reply.logprobs and not (reply.content or reply.reasoning):
                    audit.unusable_completion("empty_completion")  # the model stopped at once: nothing to pair
                    audit.errors["empty_completion"] += 1
                    return
                if not reply.logprobs:
                    audit.unusable_completion("no_logprobs")
                    audit.errors["no_logprobs"] += 1
                    return
                if thought_while_off(self.design.reasoning, reply, audit.errors):
                    audit.unusable_completion("reasoning_not_off")
                    return
                prompt = await self.prompt_ids(probe, audit.errors)
                completion = await self.scorer.logprobs(prompt, reply, audit.errors, probe_id=probe.id, index=index, seq=seq)
                if not completion.deltas:  # the first token already tokenizes otherwise: counted, not hidden
                    audit.unusable_completion("unpaired_tokens")
                    audit.errors["unpaired_tokens"] += 1
                    return
                audit.logprob.append(completion)
            except GatewayError as exc:
                audit.unusable_completion(exc.kind)

    async def reference_sample(self, probe: Probe, index: int, seq: int) -> SampledText | None:
        key = (probe.id, index)
        if key not in self._reference_samples:
            self._reference_samples[key] = asyncio.ensure_future(self._reference_sample(probe, index, seq))
        return await self._reference_samples[key]

    async def _reference_sample(self, probe: Probe, index: int, seq: int) -> SampledText | None:
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
                ids = await self.scorer.completion_ids(sampled.text, sampled.reasoning, sampled.finish_reason, errors)
                return await self._score_text(probe, index, "reference", ids, errors, seq=seq)
            except GatewayError:
                return None

    async def sampled_completion(self, audit: Audit, probe: Probe, index: int, seq: int, *, with_reference: bool) -> None:
        async with self._gate:
            audit.attempted += 1
            try:
                reply = await self._ask(audit, probe, index, logprobs=False)
                if thought_while_off(self.design.reasoning, reply, audit.errors):
                    audit.unusable_completion("reasoning_not_off")
                    return
                ids = await self.scorer.completion_ids(reply.content, reply.reasoning, reply.finish_reason, audit.errors)
                scored = await self._score_text(probe, index, "provider", ids, audit.errors, seq=seq)
                if not scored.tokens:  # no text (or none the reference scored): no rank z to measure
                    audit.unusable_completion("unscored_tokens" if ids else "empty_completion")
                    return
                audit.sampled.append(scored)
            except GatewayError as exc:
                audit.unusable_completion(exc.kind)
                return
        if with_reference:  # the reference's own samples feed only the first round's baselines
            reference = await self.reference_sample(probe, index, seq)
            if reference is not None:
                audit.sampled.append(reference)

    async def audit_round(self, audit: Audit, probes: Sequence[Probe], *, start: int) -> None:
        """Audit ``probes`` (the plan's probes ``start``, ``start + 1``, ...) and keep the
        audit's completions in plan order."""
        logprobs = audit.mode == "logprob"
        k = self.design.completions_per_prompt if logprobs else self.design.sample_mode_completions_per_prompt
        if start == 0:
            audit.first_round_end = len(probes) * k
        jobs = []
        for offset, probe in enumerate(probes):
            for i in range(k):
                seq = (start + offset) * k + i
                if logprobs:
                    jobs.append(self.logprob_completion(audit, probe, i, seq))
                else:
                    jobs.append(self.sampled_completion(audit, probe, i, seq, with_reference=start == 0))
        await asyncio.gather(*jobs)
        audit.logprob.sort(key=lambda c: c.seq)
        audit.sampled.sort(key=lambda s: (s.source, s.seq))

    async def audit_rounds(
        self,
        audits: Sequence[Audit],
        plan: Sequence[Probe],
        *,
        round_size: int,
        settled: Callable[[Sequence[Audit]], Sequence[bool]],
        on_round: Callable[[int, Sequence[Audit], Sequence[bool]], None] = lambda *_: None,
    ) -> list[int]:
        """Audit in rounds of ``round_size`` probes from ``plan`` until ``settled`` says every
        provider is decided or the plan runs out; returns each provider's number of rounds."""
        rounds = [0] * len(audits)
        done = [False] * len(audits)
        for number, start in enumerate(range(0, len(plan), round_size), start=1):
            todo = [i for i, d in enumerate(done) if not d]
            if not todo:
                break
            batch = plan[start : start + round_size]
            await asyncio.gather(*(self.audit_round(audits[i], batch, start=start) for i in todo))
            for i in todo:
                rounds[i] += 1
            done = list(settled(audits))
            on_round(number, audits, done)
        return rounds


def accounted(verdict: ProviderVerdict, audit: Audit) -> ProviderVerdict:
    """``verdict`` with its audit's accounting: every completion it could not use, by why,
    and the requests that timed out after they were sent (possibly billed)."""
    return verdict.model_copy(update={"unusable": dict(audit.unusable), "possibly_billed": audit.possibly_billed})


def summary_values(audit: Audit) -> dict[str, Any]:
    """Per-provider raw series for plots: per-token Δ (logprob mode) or per-completion
    rank z by source (sample mode)."""
    if audit.mode == "logprob":
        return {
            "deltas": [d for c in audit.logprob for d in c.deltas],
            "completion_means": [c.mean_abs_delta for c in audit.logprob],
        }
    return {
        "provider": [s.rank_z for s in audit.sampled if s.source == "provider"],
        "reference": [s.rank_z for s in audit.sampled if s.source == "reference"],
    }
