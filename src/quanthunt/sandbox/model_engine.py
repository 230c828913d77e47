"""The real model behind the sandbox: requests from the event loop are queued to one
compute thread, which groups waiting requests of the same precision into a batch
(batch 32 gives ~8x the tokens/s of batch 1 on 2 cores)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from quanthunt.defaults import SANDBOX_BATCH_WINDOW_S, SANDBOX_MAX_BATCH
from quanthunt.errors import SandboxError
from quanthunt.sandbox.engine import REFERENCE_PRECISION, Completion, OutToken, SamplingRequest, TokenInfo
from quanthunt.sandbox.model import PrecisionStore, load_reference
from quanthunt.sandbox.sampler import Sample, Sampler, TokenLogprob

SCORE_BATCH_TOKENS = 2048
"""Most tokens scored in one forward pass (~400 MB of fp32 logits at SmolLM2's vocabulary)."""


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
    """Compute done by kind ("sample", "score"): batches, rows, tokens, seconds."""

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
    payload: Any
    future: Future[Any]
    enqueued: float = field(default_factory=time.monotonic)


class _Batcher:
    """One compute thread; same-precision sample requests waiting together form a batch."""

    def __init__(
        self, store: PrecisionStore, tokenizer: Any, stop_ids: Sequence[int], *, max_batch: int, window_s: float
    ) -> None:
        self._store = store
        self._tokenizer = tokenizer
        self._stop_ids = list(stop_ids)
        self._max_batch = max_batch
        self._window_s = window_s
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.stats = EngineStats()
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

    def _take(self) -> list[_Job] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed and not self._queue:
                return None
            first = self._queue[0]
            if first.kind == "sample":
                # Give concurrent requests a moment to join the batch.
                deadline = first.enqueued + self._window_s
                while len(self._queue) < self._max_batch and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
            first = self._queue.popleft()
            batch = [first]
            tokens = len(first.payload[0]) if first.kind == "score" else 0
            for job in list(self._queue):
                if len(batch) >= self._max_batch:
                    break
                if job.kind != first.kind or job.precision != first.precision:
                    continue
                if job.kind == "score":
                    # Score batches are bounded by tokens: their logits are [batch, length, vocab].
                    tokens += len(job.payload[0])
                    if tokens > SCORE_BATCH_TOKENS:
                        break
                self._queue.remove(job)
                batch.append(job)
            return batch

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (batch := self._take()) is not None:
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if not live:
                continue
            started = time.perf_counter()
            try:
                sampler = Sampler(self._store.get(live[0].precision), self._tokenizer, stop_token_ids=self._stop_ids)
                if live[0].kind == "score":
                    for job, scored in zip(live, sampler.score_many([job.payload for job in live]), strict=True):
                        job.future.set_result(scored)
                    tokens = sum(len(job.payload[0]) for job in live)
                else:
                    results = sampler.sample([job.payload for job in live])
                    for job, result in zip(live, results, strict=True):
                        job.future.set_result(result)
                    tokens = sum(len(r.token_ids) for r in results)
                self.stats.record(live[0].kind, len(live), tokens, time.perf_counter() - started)
            except Exception as exc:  # the thread must survive a bad batch
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(exc)


class ModelEngine:
    """The real model at every precision the roster names.

    Usage: ``engine = ModelEngine.load(); completion = await engine.complete("nvfp4", request)``
    """

    mode = "model"

    def __init__(
        self,
        store: PrecisionStore,
        tokenizer: Any,
        *,
        max_batch: int = SANDBOX_MAX_BATCH,
        window_s: float = SANDBOX_BATCH_WINDOW_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = int(getattr(store.reference.config, "max_position_embeddings", 8192))
        stop_ids = [int(tokenizer.eos_token_id)]
        self._bytes = _byte_decoder()
        self._special = {int(i) for i in tokenizer.all_special_ids}
        self._token_cache: dict[int, TokenInfo] = {}
        self._batcher = _Batcher(store, tokenizer, stop_ids, max_batch=max_batch, window_s=window_s)

    @classmethod
    def load(cls, precisions: Sequence[str] = ()) -> ModelEngine:
        """Load the reference model and pre-build ``precisions`` so no request waits for it."""
        reference, tokenizer = load_reference()
        store = PrecisionStore(reference)
        for precision in precisions:
            store.get(precision)
        return cls(store, tokenizer)

    def close(self) -> None:
        self._batcher.close()

    def compute_stats(self) -> dict[str, dict[str, float]]:
        return self._batcher.stats.as_dict()

    def encode_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, return_dict=True
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
        sample: Sample = await asyncio.wrap_future(self._batcher.submit("sample", precision, request))
        return Completion(
            text=sample.text,
            tokens=[self._out(t) for t in sample.logprobs],
            finish_reason=sample.finish_reason,
            prompt_tokens=len(request.prompt_ids),
        )

    async def score(
        self, ids: Sequence[int], *, top_logprobs: int, precision: str = REFERENCE_PRECISION
    ) -> list[OutToken | None]:
        scored = await asyncio.wrap_future(self._batcher.submit("score", precision, (list(ids), top_logprobs)))
        return [None if s is None else self._out(s) for s in scored]
