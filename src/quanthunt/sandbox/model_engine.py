"""The real model behind the sandbox: requests from the event loop are queued to one
compute thread, which batches continuously. Each precision has a ``sampler.Lane``: between
any two decode steps, waiting requests join their precision's running batch and finished
ones leave it, and every lane with running rows takes a step, so no request waits for
another's whole completion and every precision advances in the same loop. Teacher-forced
scoring runs between steps, several sequences per forward pass."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quanthunt.defaults import SANDBOX_MAX_BATCH
from quanthunt.errors import SandboxError
from quanthunt.sandbox.decoder import Decoder
from quanthunt.sandbox.engine import REFERENCE_PRECISION, Completion, OutToken, SamplingRequest, TokenInfo
from quanthunt.sandbox.memo import Memo
from quanthunt.sandbox.model import build_precision, kv_format, load_reference, model_folder
from quanthunt.sandbox.sampler import Lane, Sample, ScoreCache, TokenLogprob, score_batch
from quanthunt.sandbox.threads import ThreadTuner

SCORE_BATCH_TOKENS = 2048
"""Most tokens scored in one forward pass (~400 MB of fp32 logits at SmolLM2's vocabulary)."""
PREFILL_BATCH_TOKENS = 4096
"""Most (padded) prompt tokens prefilled in one forward pass when requests join a lane."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


@dataclass
class EngineStats:
    """Compute done by kind ("prefill", "decode", "score"): forward passes, rows, tokens, seconds."""

    by_kind: dict[str, list[float]] = field(default_factory=dict)

    def record(self, kind: str, rows: int, tokens: int, seconds: float) -> None:
        entry = self.by_kind.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((1, rows, tokens, seconds)):
            entry[i] += value

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            kind: {"batches": b, "rows": r, "tokens": t, "seconds": round(s, 3), "mean_batch": round(r / b, 2) if b else 0.0}
            for kind, (b, r, t, s) in self.by_kind.items()
        }


@dataclass
class _Job:
    kind: str  # "sample" | "score"
    precision: str
    payload: Any  # a SamplingRequest | (ids, top_logprobs)
    future: Future[Any]


def _token_bounded(jobs: list[_Job], length: Callable[[_Job], int], budget: int) -> list[list[_Job]]:
    """Split ``jobs`` into runs whose padded size (rows x longest) stays within ``budget``."""
    groups: list[list[_Job]] = []
    longest = 0
    for job in jobs:
        longest = max(longest, length(job))
        if groups and (len(groups[-1]) + 1) * longest <= budget:
            groups[-1].append(job)
        else:
            groups.append([job])
            longest = length(job)
    return groups


def _looked_up(lengths: dict[int, int]) -> Callable[[_Job], int]:
    return lambda job: lengths[id(job)]


def _waves(jobs: list[_Job], cache: ScoreCache | None) -> list[list[_Job]]:
    """Score jobs in two waves: sequences that agree up to their first uncached block wait
    for one of them (the first wave's), then reuse its blocks, so the k completions of a new
    prompt compute it once."""
    if cache is None:
        return [jobs]
    leaders: dict[tuple[int, ...], _Job] = {}
    for job in jobs:
        leaders.setdefault(cache.first_missing(*job.payload), job)
    led = {id(job) for job in leaders.values()}
    return [list(leaders.values()), [job for job in jobs if id(job) not in led]]


class _Scheduler:
    """The compute thread (see the module docstring). Its torch threads are every core this
    process may run on, or one when the machine is busy (``threads.ThreadTuner``)."""

    def __init__(self, reference: nn.Module, tokenizer: Any, stop_ids: Sequence[int], *, max_batch: int) -> None:
        self._reference = reference
        self._building = threading.Lock()
        self._tokenizer = tokenizer
        self._stop_ids = list(stop_ids)
        self._max_batch = max_batch
        self._decoders: dict[str, Decoder] = {}
        self._lanes: dict[str, Lane] = {}
        self._score_caches: dict[str, ScoreCache] = {}
        self._running: dict[str, set[Future[Any]]] = defaultdict(set)
        self._finished: list[tuple[Future[Any], Sample]] = []
        self._waiting: dict[str, deque[_Job]] = defaultdict(deque)
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.stats = EngineStats()
        self.tuner = ThreadTuner(len(os.sched_getaffinity(0)))
        self._thread = threading.Thread(target=self._run, name="sandbox-compute", daemon=True)
        self._thread.start()

    def submit(self, kind: str, precision: str, payload: Any) -> Future[Any]:
        job = _Job(kind, precision, payload, Future())
        with self._cond:
            if self._closed:
                raise SandboxError("the sandbox engine is shut down")
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def decoder(self, precision: str) -> Decoder:
        """``precision``'s forward pass, built on first use (1-4 s). Only the decoder is kept:
        it holds the weights it needs, packed, and the model it was built from is dropped."""
        with self._building:
            if precision not in self._decoders:
                self._decoders[precision] = Decoder(build_precision(self._reference, precision), kv_format=kv_format(precision))
            return self._decoders[precision]

    def _text(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def _lane(self, precision: str) -> Lane:
        if precision not in self._lanes:
            self._lanes[precision] = Lane(
                self.decoder(precision), self._text, stop_token_ids=self._stop_ids, max_batch=self._max_batch
            )
        return self._lanes[precision]

    def _busy(self) -> bool:
        return any(lane.running for lane in self._lanes.values()) or any(self._waiting.values())

    def _take(self) -> list[_Job] | None:
        """What arrived since the last step; waits while there is nothing to do."""
        with self._cond:
            while not self._queue and not self._closed and not self._busy():
                self._cond.wait()
            if self._closed:
                return None
            arrived = list(self._queue)
            self._queue.clear()
            return arrived

    def _run(self) -> None:
        torch.set_num_threads(self.tuner.current)
        with torch.inference_mode():
            while (arrived := self._take()) is not None:
                scores: dict[str, list[_Job]] = defaultdict(list)
                for job in arrived:
                    (scores[job.precision] if job.kind == "score" else self._waiting[job.precision]).append(job)
                for precision, jobs in scores.items():
                    self._guarded(precision, jobs, self._score)
                for precision in list(self._waiting):
                    self._guarded(precision, [], self._admit)
                for precision, lane in list(self._lanes.items()):
                    if lane.running:
                        self._guarded(precision, [], self._step)
        failure = SandboxError("the sandbox engine is shut down")
        with self._cond:
            left = [job.future for job in self._queue] + [job.future for jobs in self._waiting.values() for job in jobs]
        for future in left + [future for futures in self._running.values() for future in futures]:
            if not future.done():
                future.set_exception(failure)

    def _guarded(self, precision: str, jobs: list[_Job], work: Callable[[str, list[_Job]], None]) -> None:
        """Run ``work``; on an error, fail its jobs and everything running at ``precision``
        (the thread must survive a bad batch) and start that lane afresh."""
        try:
            work(precision, jobs)
        except Exception as exc:
            for future in [job.future for job in jobs] + list(self._running.pop(precision, set())):
                if not future.done():
                    future.set_exception(exc)
            self._lanes.pop(precision, None)

    def _score(self, precision: str, jobs: list[_Job]) -> None:
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        decoder = self.decoder(precision)
        for job in live:
            if (length := len(job.payload[0])) > decoder.context_length:
                too_long = f"cannot score {length} tokens: the model's context is {decoder.context_length}"
                job.future.set_exception(SandboxError(too_long))
        live = [job for job in live if not job.future.done()]
        # fp32 only: bf16 compute scores a cached prefix's continuation up to 0.11 nats away
        # from one causal pass (its own rounding noise; fp32: 2e-5), and verify compares scores
        cache = self._score_caches.setdefault(precision, ScoreCache()) if decoder.dtype == torch.float32 else None
        for wave in _waves(live, cache):
            computed = {id(job): len(job.payload[0]) - (cache.cached_length(*job.payload) if cache else 0) for job in wave}
            for group in _token_bounded(wave, _looked_up(computed), SCORE_BATCH_TOKENS):
                started = time.perf_counter()
                answers = score_batch(decoder, [job.payload for job in group], cache)
                tokens = sum(computed[id(job)] for job in group)
                self.stats.record("score", len(group), tokens, time.perf_counter() - started)
                self.stats.record("score_cached", len(group), sum(len(job.payload[0]) for job in group) - tokens, 0.0)
                for job, scored in zip(group, answers, strict=True):  # after the stats: a reply sees its own work
                    job.future.set_result(scored)

    def _admit(self, precision: str, _: list[_Job]) -> None:
        waiting, lane = self._waiting[precision], self._lane(precision)
        joining: list[_Job] = []
        while waiting and len(joining) < lane.free:
            job = waiting.popleft()
            if job.future.set_running_or_notify_cancel():
                joining.append(job)
        if not waiting:
            del self._waiting[precision]
        self._running[precision].update(job.future for job in joining)
        for group in _token_bounded(joining, lambda job: len(job.payload.prompt_ids), PREFILL_BATCH_TOKENS):
            started = time.perf_counter()
            try:
                tokens = lane.admit([(job.payload, self._resolver(precision, job.future)) for job in group])
                self.stats.record("prefill", len(group), tokens, time.perf_counter() - started)
            finally:
                self._resolve_finished()

    def _resolver(self, precision: str, future: Future[Any]) -> Callable[[Sample], None]:
        def done(sample: Sample) -> None:
            self._running[precision].discard(future)
            self._finished.append((future, sample))

        return done

    def _resolve_finished(self) -> None:
        """Answer the requests the last step finished, once its stats are recorded (a reply
        that reads ``compute_stats`` sees the work done for it)."""
        finished, self._finished = self._finished, []
        for future, sample in finished:
            future.set_result(sample)

    def _step(self, precision: str, _: list[_Job]) -> None:
        started = time.perf_counter()
        threads = self.tuner.threads(started)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        try:
            rows = self._lanes[precision].step()
            seconds = time.perf_counter() - started
            self.tuner.record(threads, rows, seconds, started + seconds)
            self.stats.record("decode", rows, rows, seconds)
        finally:
            self._resolve_finished()


@dataclass
class _Pending:
    """An answer being computed, and how many requests await it."""

    answer: asyncio.Future[Any]
    waiting: int = 0


class ModelEngine:
    """The real model at every precision the roster names.

    Usage: ``engine = ModelEngine.load(); completion = await engine.complete("nvfp4", request)``
    """

    mode = "model"

    def __init__(
        self,
        reference: nn.Module,
        tokenizer: Any,
        *,
        max_batch: int = SANDBOX_MAX_BATCH,
        memo: Memo | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.memo = memo
        self.context_length = int(getattr(reference.config, "max_position_embeddings", 8192))
        stop_ids = [int(tokenizer.eos_token_id)]
        self._bytes = _byte_decoder()
        self._special = {int(i) for i in tokenizer.all_special_ids}
        self._token_cache: dict[int, TokenInfo] = {}
        self._pending: dict[tuple[str, str, Any], _Pending] = {}
        self._scheduler = _Scheduler(reference, tokenizer, stop_ids, max_batch=max_batch)

    @classmethod
    def load(cls, precisions: Sequence[str] = ()) -> ModelEngine:
        """Load the reference model and pre-build ``precisions`` so no request waits for it;
        answers are kept in ``$QUANTHUNT_SANDBOX_MEMO`` when it is set (``memo``)."""
        reference, tokenizer = load_reference()
        engine = cls(reference, tokenizer, memo=Memo.from_environment(model_digest=model_folder().name))
        for precision in precisions:
            engine._scheduler.decoder(precision)
        return engine

    def close(self) -> None:
        self._scheduler.close()
        if self.memo is not None:
            self.memo.close()

    def compute_stats(self) -> dict[str, dict[str, float]]:
        tuner = self._scheduler.tuner
        memo: dict[str, dict[str, float]] = {"memo": {"hits": self.memo.hits}} if self.memo else {}
        return {**self._scheduler.stats.as_dict(), "threads": {"current": tuner.current, "switches": tuner.switches}, **memo}

    def encode_chat(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            return_dict=True,
        )
        return [int(i) for i in encoded["input_ids"]]

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_info(self, token_id: int) -> TokenInfo:
        info = self._token_cache.get(token_id)
        if info is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if token_id in self._special or any(ch not in self._bytes for ch in piece):
                raw = str(piece).encode("utf-8")
            else:
                raw = bytes(self._bytes[ch] for ch in piece)
            info = TokenInfo(token_id, raw.decode("utf-8", errors="replace"), raw)
            self._token_cache[token_id] = info
        return info

    def _out(self, scored: TokenLogprob) -> OutToken:
        return OutToken(
            self.token_info(scored.token_id),
            scored.logprob,
            [(self.token_info(i), lp) for i, lp in scored.top],
        )

    async def complete(self, precision: str, request: SamplingRequest, *, pace: tuple[float, float] | None = None) -> Completion:
        sample: Sample = await self._answer("sample", precision, request)
        return Completion(
            text=sample.text,
            tokens=[self._out(t) for t in sample.logprobs],
            finish_reason=sample.finish_reason,
            prompt_tokens=len(request.prompt_ids),
        )

    async def score(
        self, ids: Sequence[int], *, top_logprobs: int, precision: str = REFERENCE_PRECISION
    ) -> list[OutToken | None]:
        scored: list[TokenLogprob | None] = await self._answer("score", precision, (tuple(ids), top_logprobs))
        return [None if s is None else self._out(s) for s in scored]

    async def _answer(self, kind: str, precision: str, payload: Any) -> Any:
        """The answer to ``payload`` (a ``SamplingRequest``, or ``(ids, top_logprobs)`` to
        score): the memo's when it holds it, else computed once for every identical request
        in flight. Every request is seeded, so identical ones have one answer (computed
        apart, a near-tie may flip under other batch company); a default audit asks it
        several times, of each endpoint serving the same precision."""
        if self.memo is not None and (kept := self.memo.answer(kind, precision, payload)) is not None:
            return kept
        key = (kind, precision, payload)
        pending = self._pending.get(key)
        if pending is None:
            submitted = self._scheduler.submit(kind, precision, payload if kind == "sample" else (list(payload[0]), payload[1]))
            pending = self._pending[key] = _Pending(asyncio.wrap_future(submitted))
            pending.answer.add_done_callback(functools.partial(self._settled, key, pending))
        pending.waiting += 1
        try:
            return await asyncio.shield(pending.answer)
        except asyncio.CancelledError:
            pending.waiting -= 1
            if pending.waiting == 0:  # nobody wants it: a queued job is dropped unstarted
                self._forget(key, pending)
                pending.answer.cancel()
            raise

    def _forget(self, key: tuple[str, str, Any], pending: _Pending) -> None:
        if self._pending.get(key) is pending:
            del self._pending[key]

    def _settled(self, key: tuple[str, str, Any], pending: _Pending, answer: asyncio.Future[Any]) -> None:
        self._forget(key, pending)
        if self.memo is not None and not answer.cancelled() and answer.exception() is None:
            self.memo.keep(key[0], key[1], key[2], answer.result())
