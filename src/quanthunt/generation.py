"""The generation engine: regenerate every assistant turn of a prompt dataset through
the gateway, thousands of requests in flight, under a hard dollar cap, resumable after
a crash at any instant without losing or duplicating a record or paying twice for a
finished request.

Shape of a run:

- a producer streams the dataset's records (skipping finished ones) into a bounded
  queue; ``concurrency`` workers take one record each and regenerate its turns in order
  (SpecForge-style: system and user turns kept, assistant turns dropped and regenerated on
  the regenerated history). Memory stays flat however large the dataset is.
- every request is reserved against the budget at its worst-case cost, marked
  ``in_flight`` in the ledger (committed) *before* it is sent, and settled from the
  reply's ``usage.cost``;
- a finished record is handed to the sink (``quanthunt.records``) and the worker moves
  on; the sink waits for the ledger to commit the record's replies, appends the line to
  the output (fsynced, in groups) and only then marks it done with its line's sha256. A
  restart repairs the gap either way.

What a run is asked to do (the ``Job``, its eligible endpoints) and its ``Progress`` are
in ``quanthunt.jobs``.

Routing: every request is pinned to one eligible endpoint (by tag; a provider may have
several), chosen with weights 1/price² as OpenRouter's own load balancing weighs them, so
each turn's provenance names the endpoint that served it. A reply naming another
provider is paid for, quarantined, and retires that endpoint for the run.

Failures: 408/429/5xx, timeouts, resets, malformed bodies and HTTP 200 with
``finish_reason: "error"`` or a top-level ``error`` are retried with exponential backoff
and full jitter, honouring ``Retry-After``; a 429 also pauses every worker (a shared
cooldown). An answer with no content (a reasoning model's thinking ate ``max_tokens``)
is paid for, counted as ``empty_answer``, never written, and asked again. 400 fails the
request; 401/403 and 404 ``constraint_filtered`` stop the run (``StopRun``, exit 2); any 402 but the in-flight
budget's (credits, key limit, or no ``limit_source`` at all), and the run's own cap, stop
dispatching (exit 75: top up and rerun).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import random
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from quanthunt.congestion import AdaptiveLimit
from quanthunt.defaults import GATEWAY_UNREACHABLE_S
from quanthunt.errors import EXIT_BAD_INPUT, EXIT_OUT_OF_BUDGET, QuanthuntError
from quanthunt.gateway import TRANSIENT, GatewayError, chat_body
from quanthunt.jobs import Eligible, Job, Progress
from quanthunt.ledger import Earlier, FinishAttempt, Ledger, LedgerWriter, RequestKey, StartAttempt
from quanthunt.monitoring import LOGPROB_TOP, Event, Monitoring
from quanthunt.prompts import PromptRecord, next_request, skeleton
from quanthunt.reconciliation import Lookup, look_up
from quanthunt.records import record_line
from quanthunt.replies import ChatReply, same_provider

BILLED_UNKNOWN = frozenset({"timeout", "disconnect", "malformed", "unexpected_reply", "transport"})
"""Failures after the request left: the gateway may have generated (and billed) it."""
RETRYABLE = BILLED_UNKNOWN | TRANSIENT | {"finish_error", "provider_error", "openrouter_in_flight_budget", "http_409", "http_425"}
STOPPING = {"http_401": "the API key was refused", "http_403": "the API key may not use this model", "constraint_filtered": ""}
OUT_OF_MONEY = {"openrouter_credits", "openrouter_key_limit"}
"""A 402 without a ``limit_source`` comes as ``openrouter_credits`` (``gateway.error_from``)."""


class StopRun(QuanthuntError):
    """The run stopped before finishing: ``exit_code`` 75 when it may resume later (money
    ran out: ``top_up``; or every provider was stopped), 2 when the configuration cannot
    work (bad key, no endpoint)."""

    def __init__(self, message: str, exit_code: int, *, top_up: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.top_up = top_up


class Fenced(Exception):
    """The shared ledger refused to start a request: another worker took the record over."""


class Sink(Protocol):
    """Where finished records go: the dataset's file (``records.RecordSink``) or, on a
    shared ledger, the ledger itself (``shared.ClaimSink``)."""

    @property
    def path(self) -> object: ...
    @property
    def backlog(self) -> int: ...
    def add(self, record_id: str, line: str, *, after: Iterable[asyncio.Future[Any]] = ()) -> asyncio.Future[Any]: ...
    def finished(self, record_id: str, state: str) -> None: ...
    async def drain(self) -> None: ...


class ChatClient(Protocol):
    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply: ...


def estimate_prompt_tokens(messages: Iterable[Mapping[str, str]]) -> int:
    """An upper estimate of a prompt's tokens without the provider's tokenizer: one token
    per 2 characters of UTF-8 (real BPE averages 3-4), plus 8 per message for the template."""
    return sum(len(m["content"].encode()) // 2 + 8 for m in messages) + 8


class Budget:
    """The run's hard cap: a request may go only if its worst case still fits."""

    def __init__(self, cap_usd: float) -> None:
        self.cap_usd = cap_usd
        self.settled_usd = 0.0
        self.unknown_usd = 0.0
        self.reserved_usd = 0.0

    @property
    def spent_usd(self) -> float:
        """Settled plus possibly billed (what the run may have cost so far)."""
        return self.settled_usd + self.unknown_usd

    @property
    def committed_usd(self) -> float:
        return self.settled_usd + self.unknown_usd + self.reserved_usd

    def reserve(self, usd: float) -> bool:
        if self.committed_usd + usd > self.cap_usd + 1e-12:
            return False
        self.reserved_usd += usd
        return True

    def settle(self, reserved: float, cost: float) -> None:
        self.reserved_usd -= reserved
        self.settled_usd += cost

    def unknown(self, reserved: float) -> None:
        """A reply was lost after the request left: count the reservation as spent."""
        self.reserved_usd -= reserved
        self.unknown_usd += reserved

    def reconciled(self, reserved: float, cost: float) -> None:
        self.unknown_usd -= reserved
        self.settled_usd += cost


class Cooldown:
    """Shared by all workers: a 429 pauses everyone, not just the one that got it."""

    def __init__(self) -> None:
        self.until = 0.0

    def extend(self, seconds: float) -> None:
        self.until = max(self.until, time.monotonic() + seconds)

    async def wait(self) -> None:
        if not self.until:
            return
        while (left := self.until - time.monotonic()) > 0:
            await asyncio.sleep(left)


@contextlib.contextmanager
def quiet_collector(young_threshold: int = 50_000) -> Iterator[None]:
    """Keep Python's cyclic garbage collector from eating the run.

    At 2,000 requests in flight a run holds hundreds of thousands of live objects
    (connections, futures, buffers), and with the default thresholds the collector walked
    them ~2,000 times in a 20,000-request run: 3.4 s of a 17 s run, with pauses up to
    170 ms that stall every request (benchmarks/generation_throughput.py). Objects alive at
    the start (modules, params) are frozen out of its passes, and it runs a young-generation
    pass every ``young_threshold`` net allocations instead of every 700; cyclic garbage
    is still collected, so memory stays bounded."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(young_threshold, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class Engine:
    """One dataset's run. ``await engine.run(records)`` returns when every record is done,
    failed, or the run had to stop (then ``progress.stop_reason`` says why)."""

    def __init__(self, job: Job, chat: ChatClient, ledger: Ledger, writer: LedgerWriter, sink: Sink, *,
                 done_turns: dict[tuple[str, int], dict[str, Any]], seed: int = 0,
                 monitoring: Monitoring | None = None,
                 lease: Callable[[float], Awaitable[float]] | None = None) -> None:  # fmt: skip
        self.job, self.chat, self.ledger, self.writer, self.sink = job, chat, ledger, writer, sink
        self.monitoring = monitoring
        if monitoring is not None:
            monitoring.on_stop = self._stopped_by_monitor
        self.done_turns = done_turns
        self.lease = lease
        """On a shared ledger: asks for more budget (``shared.Worker.lease``); the run's cap
        and the team's are then the ledger's, and ``budget`` holds what was leased."""
        self.budget = Budget(0.0 if lease is not None else job.max_usd)
        self._leasing = asyncio.Lock()
        self.cooldown = Cooldown()
        self.progress = Progress()
        self.rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._fatal: StopRun | None = None
        self._endpoints = {p.tag: p for p in job.providers}
        self._active = list(job.providers)
        self._routing = {p.tag: job.routing.pin(p.tag, siblings=p.siblings) for p in job.providers}
        self.limits = {p.tag: AdaptiveLimit(job.concurrency, on_cut=functools.partial(self._cut, p.tag)) for p in job.providers}
        """Requests in flight at each endpoint (``quanthunt.congestion``): a timeout halves
        its limit, successes grow it back. Each endpoint is its own backend, so one that
        queues slows only its own requests; without it every request queued behind a slow
        one timed out, was possibly billed and was bought again."""
        self._unknown_with_id: list[tuple[int, str, float]] = []
        self._record_costs = ledger.unwritten_record_costs(job.dataset, job.params_hash)
        """Settled spend of each record not yet written (all its attempts, earlier runs' too)."""
        self._attempts = ledger.unwritten_attempts(job.dataset, job.params_hash)
        """Finished attempts of each turn not yet written, by billing (earlier runs' too)."""
        self._unreachable_since: float | None = None
        """When the current unbroken run of connection failures began (None: the gateway answers)."""
        self._unreachable: GatewayError | None = None
        """The latest connection failure of that run."""
        self._write_error: BaseException | None = None

    def _cut(self, tag: str, before: int, after: int) -> None:
        self.progress.limit_cuts[tag] = self.progress.limit_cuts.get(tag, 0) + 1

    def stop(self, reason: str, *, fatal: StopRun | None = None) -> None:
        if not self._stop.is_set():
            self.progress.stop_reason = reason
            self._stop.set()
        if fatal is not None and self._fatal is None:
            self._fatal = fatal

    @property
    def fatal(self) -> StopRun | None:
        return self._fatal

    def _token_budget_left(self) -> bool:
        limit = self.job.max_output_tokens
        return limit is None or self.progress.output_tokens_before + self.progress.output_tokens < limit

    def resume(self, earlier: Earlier) -> None:
        """Take over what earlier owners of some records finished and spent (done turns,
        costs, attempts by billing: ``shared.Worker.resume``) before they are worked."""
        turns, costs, attempts = earlier
        self.done_turns.update(turns)
        self._record_costs.update(costs)
        self._attempts.update(attempts)

    async def run(self, records: Iterable[PromptRecord] | AsyncIterable[PromptRecord]) -> Progress:
        queue: asyncio.Queue[PromptRecord | None] = asyncio.Queue(maxsize=max(2 * self.job.concurrency, 16))

        async def produce() -> None:
            async for record in _aiter(records):
                if self._stop.is_set():
                    break
                if not self._token_budget_left():
                    self.stop("the dataset's output-token budget is reached")
                    break
                await queue.put(record)
            for _ in range(self.job.concurrency):
                await queue.put(None)

        async def work(delay: float) -> None:
            if delay:  # the ramp: a stop ends the wait early
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            while (record := await queue.get()) is not None:
                if self._stop.is_set():
                    continue
                await self._record(record)

        # A slow start: no burst of `concurrency` new connections at the gateway, and
        # replies that don't come back in lock-step (in bursts that queue behind each
        # other on the event loop; measured in benchmarks/generation_throughput.py).
        step = self.job.ramp_up_s / self.job.concurrency
        workers = [asyncio.ensure_future(work(k * step)) for k in range(self.job.concurrency)]
        producer = asyncio.ensure_future(produce())
        try:
            with quiet_collector():
                await asyncio.gather(producer, *workers)
                await self.sink.drain()
        finally:
            for task in (producer, *workers):
                task.cancel()
        if self._write_error is not None:
            raise self._write_error
        if self.progress.records_failed and self._unreachable is not None:
            self._stop_unreachable()  # records gave up on their retries before the 5 s were up
        return self.progress

    def _stop_unreachable(self) -> None:
        hint = "the gateway cannot be reached"
        self.stop(hint, fatal=StopRun(f"{hint} ({self._unreachable}); nothing more was sent", EXIT_BAD_INPUT))

    async def _record(self, record: PromptRecord) -> None:
        try:
            await self._regenerate(record)
        finally:  # written, failed or skipped: nothing about it needs to stay in memory
            self._record_costs.pop(record.id, None)
            for turn in range(len(record.conversations)):
                self.done_turns.pop((record.id, turn), None)
                self._attempts.pop((record.id, turn), None)

    async def _regenerate(self, record: PromptRecord) -> None:
        segments = skeleton(record)
        replies: list[dict[str, Any]] = []
        committing: list[asyncio.Future[Any]] = []
        started = time.time()
        for turn in range(len(segments)):
            done = self.done_turns.get((record.id, turn))
            if done is None:
                messages = [{"role": t.role, "content": t.content} for t in next_request(record, [r["content"] for r in replies])]
                if estimate_prompt_tokens(messages) + self.job.sampling.max_tokens > self.job.context_length:
                    self.progress.records_skipped += 1
                    self.progress.skipped_reasons["prompt over the context length"] += 1
                    self.sink.finished(record.id, "skipped")
                    return
                key = RequestKey(self.job.dataset, record.id, turn, self.job.params_hash)
                try:
                    done = await self._request(key, messages, committing)
                except Fenced:
                    self.progress.errors["fenced"] += 1
                    return
                if done is None:
                    if not self._stop.is_set():
                        self.progress.records_failed += 1
                        self.sink.finished(record.id, "failed")
                    return
            replies.append(done)
        written = self.sink.add(record.id, self._line(record, replies, started), after=committing)
        written.add_done_callback(self._written)
        if self.sink.backlog > self.job.concurrency:  # the disk is behind: wait rather than pile up lines
            await asyncio.wait([written])

    def _written(self, future: asyncio.Future[None]) -> None:
        if future.cancelled():
            return
        if (error := future.exception()) is None:
            if future.result() is not False:  # False: a shared ledger's fence refused the line
                self.progress.records_done += 1
            return
        if self._write_error is None:
            self._write_error = error
        self.stop(f"writing {self.sink.path} failed: {error}")

    def _committed(self, future: asyncio.Future[Any]) -> None:
        """A ledger write nobody awaits failed: stop (the run's bookkeeping is no longer sound)."""
        if not future.cancelled() and (error := future.exception()) is not None:
            if self._write_error is None:
                self._write_error = error
            self.stop(f"writing the ledger {self.ledger.where} failed: {error}")

    def _line(self, record: PromptRecord, replies: list[dict[str, Any]], started: float) -> str:
        return record_line(
            self.job,
            record,
            replies,
            endpoints=self._endpoints,
            cost_usd=self._record_costs.get(record.id, 0.0),
            attempts=[self._attempts.get((record.id, turn), Counter()) for turn in range(len(replies))],
            started=started,
        )

    async def _request(
        self, key: RequestKey, messages: list[dict[str, str]], committing: list[asyncio.Future[Any]]
    ) -> dict[str, Any] | None:
        """Send one turn until it succeeds, fails for good or the run stops. On success the
        ledger write of its reply is queued and its future appended to ``committing``."""
        job = self.job
        max_tokens = job.sampling.max_tokens
        worst = estimate_prompt_tokens(messages) * job.worst_prompt_rate + max_tokens * job.worst_completion_rate
        for attempt in range(1, job.retry.max_attempts + 1):
            await self.cooldown.wait()
            if self._stop.is_set():
                return None
            endpoint = await self._endpoint()
            if endpoint is None:
                return None
            monitored = self.monitoring is not None and self.monitoring.wants(key, endpoint.tag)
            logprobs = monitored and self.monitoring is not None and self.monitoring.asks_logprobs(endpoint.tag)
            body = chat_body(
                model=job.model, messages=messages, max_tokens=max_tokens,
                temperature=job.sampling.temperature, top_p=job.sampling.top_p,
                seed=job.sampling.request_seed(key.record_id, key.turn), routing=self._routing[endpoint.tag],
                reasoning=job.reasoning, logprobs=logprobs, top_logprobs=LOGPROB_TOP if logprobs else None,
            )  # fmt: skip
            limit = self.limits[endpoint.tag]
            async with limit.slot() as ticket:  # nothing is reserved or marked in flight while it waits
                if self._stop.is_set():
                    return None
                if not self.budget.reserve(worst) and not await self._leased(worst):
                    cap = f"the run's spending cap (generate.max_usd_per_run ${job.max_usd:g})"
                    if self.lease is not None:
                        cap += " or the team's (survey.budget.usd, in the shared ledger)"
                    self.stop(f"{cap} would be exceeded")
                    return None
                attempt_id: int | None = await self.writer.write(StartAttempt(key, run_id=job.run_id, reserved_usd=worst))
                if attempt_id is None:
                    self.budget.settle(worst, 0.0)
                    raise Fenced(key.record_id)
                self.progress.in_flight += 1

                def note(generation_id: str, attempt_id: int = attempt_id) -> None:
                    # Saved as soon as the headers arrive, so a reply lost mid-body can be reconciled.
                    self.writer.note_generation_id(attempt_id, generation_id)

                try:
                    reply = await self.chat.chat(body, on_headers=note)
                except GatewayError as error:
                    self.progress.in_flight -= 1
                    if error.kind == "timeout":
                        limit.timed_out(ticket)
                    failed: GatewayError | None = error
                else:
                    self.progress.in_flight -= 1
                    limit.succeeded(ticket)
                    failed = None
            if failed is not None:
                outcome = await self._failed(key, attempt_id, worst, failed)
                if outcome == "stop" or attempt == job.retry.max_attempts:
                    return None
                await asyncio.sleep(
                    failed.retry_after_s if failed.retry_after_s is not None else job.retry.delay(attempt, self.rng)
                )
                continue
            result = await self._succeeded(key, attempt_id, worst, reply, endpoint, committing=committing,
                                           monitored=messages if monitored else None)  # fmt: skip
            if result is not None:
                return result
            if not reply.content.strip() and (larger := job.retry.empty_answer_max_tokens) and larger > max_tokens:
                worst += (larger - max_tokens) * job.worst_completion_rate
                max_tokens = larger
        return None

    async def _leased(self, worst: float) -> bool:
        """Reserve ``worst`` out of a new budget lease (one lease at a time); False when the
        ledger's caps grant none."""
        if self.lease is None:
            return False
        async with self._leasing:
            if self.budget.reserve(worst):
                return True
            self.budget.cap_usd += await self.lease(worst)
            return self.budget.reserve(worst)

    def _count(self, key: RequestKey, billing: str) -> None:
        self._attempts.setdefault((key.record_id, key.turn), Counter())[billing] += 1

    async def _endpoint(self) -> Eligible | None:
        """An active endpoint, drawn by weight among those whose monitor is not behind
        (waiting while every one is); None when the run stops meanwhile."""
        waited = False
        while True:
            ready = [p for p in self._active if self.monitoring is None or not self.monitoring.lagging(p.tag)]
            # endpoints with room under their limit first: a worker does not queue for a cut one while others are free
            roomy = [p for p in ready if self.limits[p.tag].in_flight < self.limits[p.tag].allowed] or ready
            if roomy:
                return self.rng.choices(roomy, weights=[p.weight for p in roomy])[0]
            if self._stop.is_set() or not self._active:
                return None
            if not waited and self.monitoring is not None:
                self.monitoring.counts["requests_waited_for_scores"] += 1
                waited = True
            await asyncio.sleep(0.05)

    async def _failed(self, key: RequestKey, attempt_id: int, worst: float, error: GatewayError) -> str:
        kind = error.kind
        self.progress.errors[kind] += 1
        possibly_billed = kind in BILLED_UNKNOWN
        self._count(key, "possibly_billed" if possibly_billed else "unbilled")
        if possibly_billed:
            self.budget.unknown(worst)
            if error.generation_id:
                self._unknown_with_id.append((attempt_id, error.generation_id, worst))
        else:
            self.budget.settle(worst, 0.0)
        retry = kind in RETRYABLE
        state = "unknown_outcome" if possibly_billed else ("pending" if retry else "failed")
        await self.writer.write(
            FinishAttempt(
                key,
                attempt_id,
                state=state,
                outcome="unknown" if possibly_billed else "failed_unbilled",
                cost_usd=0.0,
                http_status=error.status or None,
                error_kind=kind,
                generation_id=error.generation_id,
                error=str(error)[:500],
            )
        )
        if kind in OUT_OF_MONEY:
            self.stop(f"the gateway refused for lack of money ({kind})", fatal=StopRun("", EXIT_OUT_OF_BUDGET, top_up=True))
            return "stop"
        if kind in STOPPING:
            hint = STOPPING[kind] or "no eligible endpoint serves these requests (provider filters left nothing)"
            self.stop(hint, fatal=StopRun(f"{hint}: {error}", EXIT_BAD_INPUT))
            return "stop"
        if kind != "connect":
            self._unreachable_since, self._unreachable = None, None
        else:
            self._unreachable = error
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            elif time.monotonic() - self._unreachable_since >= GATEWAY_UNREACHABLE_S:
                self._stop_unreachable()
                return "stop"
        if kind == "http_429":
            self.cooldown.extend(error.retry_after_s if error.retry_after_s is not None else 1.0)
        if retry:
            self.progress.retries[kind] += 1
            return "retry"
        return "stop"

    async def _succeeded(
        self, key: RequestKey, attempt_id: int, worst: float, reply: ChatReply, endpoint: Eligible, *,
        committing: list[asyncio.Future[Any]], monitored: list[dict[str, str]] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """Settle a reply. Returns the turn, or None when the reply is paid for but not
        usable: served by another provider (the endpoint is retired) or without an answer.
        ``monitored``: the request's messages when its reply goes to the monitor."""
        usage = reply.usage
        cost = usage.cost if usage is not None and usage.cost is not None else worst
        self.budget.settle(worst, cost)
        self._unreachable_since, self._unreachable = None, None
        self._count(key, "billed")
        self._record_costs[key.record_id] = self._record_costs.get(key.record_id, 0.0) + cost
        prompt_tokens = usage.prompt_tokens if usage else 0
        completion_tokens = usage.completion_tokens if usage else 0
        finish = functools.partial(
            FinishAttempt, key, attempt_id, cost_usd=cost, provider=endpoint.tag, generation_id=reply.generation_id,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        )  # fmt: skip
        if not same_provider(reply.provider, endpoint.name, endpoint.tag):
            named = reply.provider or "no provider"
            self.progress.quarantined += 1
            self.progress.errors["quarantined"] += 1
            await self.writer.write(finish(
                state="quarantined", outcome="quarantined", error_kind="quarantined",
                error=f"pinned to {endpoint.tag} ({endpoint.name}), the reply named {named}",
            ))  # fmt: skip
            self._retire(endpoint, f"a reply named {named}, not {endpoint.name}")
            return None
        if not reply.content.strip():  # a reasoning model's thinking ate max_tokens, or nothing at all
            self.progress.errors["empty_answer"] += 1
            self.progress.retries["empty_answer"] += 1
            await self.writer.write(finish(
                state="pending", outcome="failed_billed", error_kind="empty_answer",
                error=f"no answer (finish_reason {reply.finish_reason}, {completion_tokens} completion tokens)",
            ))  # fmt: skip
            return None
        result = {
            "content": reply.content,
            "reasoning": reply.reasoning,
            "provider": endpoint.name,
            "endpoint_tag": endpoint.tag,
            "generation_id": reply.generation_id,
            "finish_reason": reply.finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cost_usd": cost,
            "monitor": self.monitoring.stamp(endpoint.tag) if self.monitoring is not None else None,
        }
        if monitored is not None and self.monitoring is not None:
            self.monitoring.served(endpoint.tag, key, monitored, reply)
        # Not awaited: the worker goes on while it commits; the record's line waits for it.
        committed = self.writer.submit(finish(state="done", outcome="ok", reply=result))
        committed.add_done_callback(self._committed)
        committing.append(committed)
        self.progress.requests_ok += 1
        self.progress.output_tokens += completion_tokens
        self.progress.providers[endpoint.tag] += 1
        if not self._token_budget_left():
            self.stop("the dataset's output-token budget is reached")
        return result

    def _retire(self, endpoint: Eligible, why: str) -> None:
        """Send nothing more to ``endpoint`` this run; with none left, stop: exit 75 when
        every one was stopped by its monitor (verify again, then resume), else exit 2."""
        if endpoint not in self._active:
            return
        self._active.remove(endpoint)
        self.progress.retired[endpoint.tag] = why
        if not self._active:
            reasons = "; ".join(f"{tag}: {why}" for tag, why in self.progress.retired.items())
            if all(tag in self.progress.monitor_stops for tag in self.progress.retired):
                hint = "every eligible provider was stopped by its monitor"
                self.stop(hint, fatal=StopRun(f"{hint} ({reasons}); rerun verify, then generate", EXIT_OUT_OF_BUDGET))
                return
            hint = "every eligible endpoint answered as another provider"
            self.stop(hint, fatal=StopRun(f"{hint} ({reasons}); rerun verify", EXIT_BAD_INPUT))

    def _stopped_by_monitor(self, event: Event) -> None:
        """The provider's monitor crossed: route nothing more to it (in-flight requests finish)."""
        self.progress.monitor_stops[event.tag] = {**event.stop.__dict__, "replies_before": self.progress.providers[event.tag]}
        endpoint = self._endpoints.get(event.tag)
        if endpoint is not None:
            self._retire(endpoint, f"stopped by its monitor (e-value {event.stop.e_value:.3g}, {event.stop.test})")

    async def reconcile(self, lookup: Lookup) -> int:
        """Settle this run's unknown-outcome attempts whose generation id is known, from the
        gateway's generation records. Returns how many were reconciled."""
        records = await look_up([generation_id for _, generation_id, _ in self._unknown_with_id], lookup)
        done = 0
        for (attempt_id, _, reserved), record in zip(self._unknown_with_id, records, strict=True):
            if record is not None:
                self.ledger.reconcile(attempt_id, record.total_cost)
                self.budget.reconciled(reserved, record.total_cost)
                done += 1
        return done


async def _aiter(records: Iterable[PromptRecord] | AsyncIterable[PromptRecord]) -> AsyncIterator[PromptRecord]:
    if isinstance(records, AsyncIterable):
        async for record in records:
            yield record
    else:
        for record in records:
            yield record
