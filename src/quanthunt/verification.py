"""Measuring each provider against the reference: the probe requests and their scoring.

Every provider is pinned (``only: [tag]``, no fallbacks, ``require_parameters``) and
audited on the plan's probes (``quanthunt.probes``) in logprob or sample mode; what is
measured of each completion is ``quanthunt.measurements``. This module holds the I/O: the
``Auditor``'s async loops over the injected gateway and reference clients, and the
``Scorer`` that has the reference score a completion teacher-forced (the generate stage's
monitor uses it too).

Probe requests go out under an adaptive in-flight limit per endpoint (``quanthunt.congestion``):
a provider that queues makes its own audit slower, not the others' (on OpenRouter each
provider is its own backend), and a timed-out probe is sent again under the lowered limit,
never replaced by another. Every completion asked for is either measured or counted in
``Audit.unusable`` with its reason.

The audit runs in rounds (``audit_rounds``): after each, the caller's ``settled`` says which
providers are decided, and the rest get the next probes of the same seeded order.
``quanthunt.decision`` turns the measurements into verdicts.
"""

from __future__ import annotations

import asyncio
import functools
import math
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import httpx

from quanthunt.congestion import AdaptiveLimit
from quanthunt.defaults import GATEWAY_TIMEOUT
from quanthunt.gateway import TRANSIENT, Gateway, GatewayError, Routing, backoff_s, chat_body
from quanthunt.measurements import RANK_TOP_K, Audit, LogprobCompletion, SampledText, compare_logprobs, rank
from quanthunt.params import Reasoning
from quanthunt.probes import Design, Probe, probe_seed
from quanthunt.reference import Reference
from quanthunt.replies import ChatReply
from quanthunt.survey import CONVENTION_PROBES

T = TypeVar("T")
RETRYABLE = TRANSIENT | {"malformed", "unexpected_reply", "finish_error", "openrouter_in_flight_budget"}
"""Gateway failure kinds worth another attempt."""


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


class PaidReplies(Protocol):
    """Where the probe replies bought are kept (``quanthunt.paid_replies.PaidReplies``, on
    the ledger: a protocol here, so the stages that only score, generate's monitor among
    them, do not depend on the ledger's verify tables)."""

    def earlier(self, body: Mapping[str, Any]) -> tuple[ChatReply, float] | None:
        """The reply an earlier run bought with exactly this request, and its cost."""

    async def keep(self, body: Mapping[str, Any], *, tag: str, probe_id: str, reply: ChatReply) -> None:
        """Store a reply just bought."""


def probe_timeout(request_timeout_s: float) -> httpx.Timeout:
    """The gateway timeouts of probe requests: ``request_timeout_s`` from the moment a request
    is sent (it grows with ``max_tokens``, see ``gateway.read_timeout_s``). No pool timeout:
    the auditor's own limit decides what is sent (``probe_limits`` leaves a connection for
    every request it admits), so waiting in our own queue never counts as the gateway's
    slowness."""
    return httpx.Timeout(connect=GATEWAY_TIMEOUT.connect, read=request_timeout_s, write=GATEWAY_TIMEOUT.write, pool=None)


def probe_limits(concurrency: int, *, endpoints: int = 1) -> httpx.Limits:
    """A connection for each probe request the auditor may have in flight: ``concurrency``
    at each of ``endpoints`` (``Auditor.limit``)."""
    return httpx.Limits(max_connections=concurrency * endpoints, max_keepalive_connections=concurrency * endpoints)


class Scorer:
    """Scores completions at the reference, teacher-forced: the verify stage's probes and
    the generate stage's monitored replies alike."""

    def __init__(self, reference: Reference, reasoning: Reasoning, *, top_logprobs: int, attempts: int,
                 horizon: int, temperature: float = 1.0, rank_top: int | None = None,
                 processed_at: float | None = None) -> None:  # fmt: skip
        self.reference = reference
        self.reasoning = reasoning
        self.top_logprobs = top_logprobs
        self.rank_top = rank_top or top_logprobs
        """The reference's top tokens a logprob-mode completion's rank statistics read
        (``top_logprobs`` unless given; the provider's logprobs are compared at their own depth)."""
        self.attempts = attempts
        self.horizon = horizon
        """The rank statistic's tokens (``measurements.rank``): ``decision.mixture_detection_tokens``."""
        self.temperature = temperature
        """The temperature the scored texts were sampled at (``measurements.rank``)."""
        self.processed_at = processed_at
        """Where a reply's logprobs may be after temperature (``compare_logprobs``): the
        temperature it was sampled at, in (0, 1) with top-p 1; None: read as raw."""

    async def check(self) -> None:
        """Find the token that ends a turn (``Reference.end_of_turn``) before anything is
        bought: a reference whose template hides it stops the stage with ``ReferenceUnusable``."""
        await self.reference.end_of_turn(template_kwargs=self.reasoning.reference_kwargs())

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
        answer (the block's end only if the budget left room for an answer); then the token
        that ends the turn where the reply stopped (``finish_reason: stop``; the probes and
        generate send no stop strings), which the model sampled as it sampled the rest."""

        async def tokens(piece: str) -> list[int]:
            return (
                await with_retries(lambda: self.reference.tokenize_text(piece), attempts=self.attempts, errors=errors)
                if piece
                else []
            )

        if self.reasoning.mode != "on" or reasoning is None:
            ids = await tokens(text)
        else:
            ids = await tokens(reasoning)
            if text or finish_reason != "length":
                ids += await tokens(self.reasoning.end_marker) + await tokens(text)
        if finish_reason == "stop":
            kwargs = self.reasoning.reference_kwargs()
            ids.append(await with_retries(lambda: self.reference.end_of_turn(template_kwargs=kwargs),
                                          attempts=self.attempts, errors=errors))  # fmt: skip
        return ids

    async def logprobs(self, prompt: list[int], reply: ChatReply, errors: Counter[str], *, probe_id: str, index: int,
                       seq: int, ids: list[int] | None = None) -> LogprobCompletion:  # fmt: skip
        """Pair a reply's logprobs with the reference's scores of the same tokens (``ids``: the
        reply's ``completion_ids`` when the caller has them already)."""
        assert reply.logprobs is not None
        if ids is None:
            ids = await self.completion_ids(reply.content, reply.reasoning, reply.finish_reason, errors)
        scored = await with_retries(
            lambda: self.reference.score(prompt + ids, top_logprobs=max(self.top_logprobs, self.rank_top), names=True),
            attempts=self.attempts,
            errors=errors,
        )
        return compare_logprobs(probe_id, index, reply.logprobs, scored, len(prompt), listed=self.rank_top, seq=seq,
                                horizon=self.horizon, stopped=reply.finish_reason == "stop",
                                temperature=self.temperature, processed_at=self.processed_at)  # fmt: skip

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
        ranks = rank(positions, listed=RANK_TOP_K, seed=f"{probe_id}:{index}:{source}:{ids}", horizon=self.horizon,
                     temperature=self.temperature)  # fmt: skip
        mean = statistics.fmean(values) if values else 0.0
        return SampledText(probe_id, index, source, ids, mean, ranks.z, ranks.pit, len(values), seq)


def thought_while_off(reasoning: Reasoning, reply: ChatReply, errors: Counter[str]) -> bool:
    """A reply that carries reasoning although thinking was turned off (a provider that
    ignores the switch, or a model whose reasoning is mandatory) cannot be paired."""
    if reasoning.mode == "off" and reply.reasoning:
        errors["reasoning_not_off"] += 1
        return True
    return False


class Auditor:
    """Runs the probes of one stage: gateway and reference clients, an adaptive in-flight
    limit per endpoint, a bound on the work at the reference, and caches of what every
    provider shares (prompt token ids, reference samples).

    With ``paid``, a probe request an earlier run already bought is answered from the
    ledger (``quanthunt.paid_replies``) and every reply bought is kept there.
    ``on_cut(tag, before, after)`` hears of every cut of an endpoint's limit."""

    def __init__(
        self,
        gateway: Gateway,
        reference: Reference,
        design: Design,
        *,
        concurrency: int,
        siblings: Sequence[str] = (),
        paid: PaidReplies | None = None,
        on_cut: Callable[[str, int, int], None] = lambda *_: None,
    ) -> None:
        self.gateway = gateway
        self.paid = paid
        self.siblings = tuple(siblings)
        """Every endpoint tag the survey listed (a pin on a base slug ignores its variants)."""
        self.reference = reference
        self.design = design
        self.scorer = Scorer(reference, design.reasoning, top_logprobs=design.top_logprobs, attempts=design.max_attempts,
                             horizon=design.rank_tokens)  # fmt: skip
        at = design.convention_temperature
        self.convention_scorer = None if at is None else Scorer(
            reference, design.reasoning, top_logprobs=design.top_logprobs, attempts=design.max_attempts,
            horizon=design.rank_tokens, temperature=at, processed_at=at,
        )  # fmt: skip
        """Reads the replies asked at the generation's temperature (``convention_reply``)."""
        self.concurrency = concurrency
        self.limits: dict[str, AdaptiveLimit] = {}
        """Probe requests in flight at each endpoint, by tag (``limit``)."""
        self._on_cut = on_cut
        self._at_reference = asyncio.Semaphore(concurrency)
        """Completions being scored (and reference samples drawn) at once: the reference is
        the team's one server, shared by every provider's probes, so one bound for all. It
        is taken only once a reply is in: a probe waiting for its endpoint holds nothing
        here, and no provider's failure lowers it."""
        self.free_timeout_retries = math.ceil(math.log2(concurrency)) + 1
        """Timeout retries that use up no attempt: enough cuts to take the limit to 1."""
        self._prompt_ids: dict[str, list[int]] = {}
        self._reference_samples: dict[tuple[str, int], asyncio.Task[SampledText | None]] = {}

    def limit(self, tag: str) -> AdaptiveLimit:
        """The in-flight limit of endpoint ``tag`` (``quanthunt.congestion``), every one with
        the same ceiling, ``concurrency``.

        One per endpoint, because on OpenRouter each provider is its own backend: with one
        limit for all, a provider that queued cut it for every provider (issue 27: 24 → 2 →
        1) and the others' probes crawled behind it. Nor is any bound on requests shared by
        every endpoint: the queueing provider's requests hold it until they time out
        (``request_timeout_s``: minutes on OpenRouter) while the others' wait behind them.
        Measured by ``test_a_queueing_endpoint_slows_only_its_own_probes`` (ceiling 8, a
        provider serving 4 at a time listed first), two fast providers' probes finished in

        - one limit, and at most 8 completions at once (before): 1.2 s and 2.3 s alone, 6.4 s
          and 7.4 s beside it;
        - a limit each under that bound on completions: 1.2 s and 2.3 s, 5.6 s and 6.7 s;
        - a limit each under a total of 8 requests in flight: 1.6 s and 2.1 s, 3.3 s and 3.8 s;
        - a limit each, nothing shared at the gateway (now): 1.2 s and 1.2 s, both beside it too.

        So the total in flight is bounded only by the endpoints' ceilings together
        (``probe_limits`` sizes the connection pool for exactly that); what every provider
        does share, the reference, keeps its own bound (``_at_reference``)."""
        if tag not in self.limits:
            self.limits[tag] = AdaptiveLimit(self.concurrency, on_cut=functools.partial(self._on_cut, tag))
        return self.limits[tag]

    async def prompt_ids(self, probe: Probe, errors: Counter[str]) -> list[int]:
        if probe.id not in self._prompt_ids:
            self._prompt_ids[probe.id] = await self.scorer.prompt_ids(probe.as_messages(), errors)
        return self._prompt_ids[probe.id]

    async def _ask(
        self, audit: Audit, probe: Probe, index: int, *, logprobs: bool, temperature: float | None = None
    ) -> ChatReply:
        d = self.design
        body = chat_body(
            model=d.model,
            messages=probe.as_messages(),
            max_tokens=d.max_tokens,
            temperature=d.temperature if temperature is None else temperature,
            seed=probe_seed(d.seed, probe.id, index),
            logprobs=logprobs,
            top_logprobs=d.top_logprobs if logprobs else None,
            routing=Routing().pin(audit.tag, siblings=self.siblings),
            reasoning=d.reasoning.request(),
        )
        earlier = self.paid.earlier(body) if self.paid is not None else None
        if earlier is not None:
            reply, cost = earlier
            audit.reused += 1
            audit.reused_cost_usd += cost
        else:
            reply = await self.send(body, audit)
            if self.paid is not None:
                await self.paid.keep(body, tag=audit.tag, probe_id=probe.id, reply=reply)
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
        limit = self.limit(audit.tag)
        attempts = free = 0
        while True:
            async with limit.slot() as ticket:
                try:
                    reply = await self.gateway.chat(body)
                except GatewayError as exc:
                    audit.errors[exc.kind] += 1
                    error, lowered = exc, False
                    if exc.kind == "timeout":
                        audit.possibly_billed += 1
                        lowered = limit.timed_out(ticket)
                else:
                    limit.succeeded(ticket)
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
            async with self._at_reference:
                prompt = await self.prompt_ids(probe, audit.errors)
                completion = await self.scorer.logprobs(prompt, reply, audit.errors, probe_id=probe.id, index=index, seq=seq)
            if not completion.deltas:  # the first token already tokenizes otherwise: counted, not hidden
                audit.unusable_completion("unpaired_tokens")
                audit.errors["unpaired_tokens"] += 1
                return
            audit.logprob.append(completion)
        except GatewayError as exc:
            audit.unusable_completion(exc.kind)

    async def convention_reply(self, audit: Audit, probe: Probe) -> None:
        """One reply sampled at the generation's temperature, read only for how the provider
        reports logprobs there (``Audit.convention``; paid and counted like any probe reply).
        One that fails or cannot be paired is left unread: the audit's tests do not use it,
        and its errors are counted with the audit's."""
        assert self.convention_scorer is not None
        audit.convention_asked += 1
        try:
            reply = await self._ask(audit, probe, 0, logprobs=True, temperature=self.design.convention_temperature)
            if not reply.logprobs or thought_while_off(self.design.reasoning, reply, audit.errors):
                return
            async with self._at_reference:
                prompt = await self.prompt_ids(probe, audit.errors)
                read = await self.convention_scorer.logprobs(prompt, reply, audit.errors, probe_id=probe.id, index=0, seq=0)
            if read.deltas:
                audit.convention.append(read)
        except GatewayError:
            return

    async def reference_sample(self, probe: Probe, index: int, seq: int) -> SampledText | None:
        key = (probe.id, index)
        if key not in self._reference_samples:
            self._reference_samples[key] = asyncio.ensure_future(self._reference_sample(probe, index, seq))
        return await self._reference_samples[key]

    async def _reference_sample(self, probe: Probe, index: int, seq: int) -> SampledText | None:
        d = self.design
        errors: Counter[str] = Counter()
        async with self._at_reference:
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
        audit.attempted += 1
        try:
            reply = await self._ask(audit, probe, index, logprobs=False)
            if thought_while_off(self.design.reasoning, reply, audit.errors):
                audit.unusable_completion("reasoning_not_off")
                return
            async with self._at_reference:
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
        jobs: list[Coroutine[Any, Any, None]] = []
        if start == 0:
            audit.first_round_end = len(probes) * k
            if logprobs and self.convention_scorer is not None:
                audit.convention_temperature = self.design.convention_temperature
                jobs.extend(self.convention_reply(audit, probe) for probe in probes[:CONVENTION_PROBES])
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
