"""What produces tokens behind the sandbox's HTTP API: the ``CompletionEngine`` interface, the
types it speaks, and ``LatencyEngine``.

``LatencyEngine`` has no model (and imports no torch): it answers with canned text after
the roster's latency and throughput, so a client can be load-tested at 2,000 requests in
flight. ``model_engine.ModelEngine`` runs the real model.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from quanthunt.errors import SandboxError

REFERENCE_PRECISION = "int4-native"
"""What the reference deployment serves: the shipped weights in fp32."""


@dataclass(frozen=True)
class SamplingRequest:
    """One completion to sample. ``temperature == 0`` means greedy."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """Keep sampling past the end-of-sequence token (vLLM's ``ignore_eos``: benchmarks)."""
    processed_logprobs: bool = False
    """Report logprobs after temperature and top-p, as vLLM's ``--logprobs-mode
    processed_logprobs`` does (else the model's raw distribution, vLLM's default)."""


@dataclass(frozen=True)
class TokenInfo:
    """A token as the API shows it: id, text, UTF-8 bytes."""

    id: int
    text: str
    bytes: bytes


@dataclass
class OutToken:
    """One generated (or scored) token with its logprob and top alternatives."""

    token: TokenInfo
    logprob: float
    top: list[tuple[TokenInfo, float]] = field(default_factory=list)


@dataclass
class Completion:
    """An engine's answer to one request."""

    text: str
    tokens: list[OutToken]
    finish_reason: str
    prompt_tokens: int
    synthetic_logprobs: bool = False
    reasoning: str | None = None
    """The reasoning profile's thinking (``sandbox/thinking.py``)."""
    reasoning_tokens: int = 0
    """How many of ``tokens`` lead the answer: the reasoning and the end of its block."""


class CompletionEngine(Protocol):
    """The interface the HTTP layer needs; both engines implement it."""

    mode: str
    context_length: int

    def encode_chat(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_info(self, token_id: int) -> TokenInfo: ...

    async def complete(self, precision: str, request: SamplingRequest, *, pace: tuple[float, float] | None = None) -> Completion:
        """Sample ``request`` at ``precision``. ``pace`` is the provider's (latency s,
        tokens/s); the model engine runs at its own speed and ignores it."""
        ...

    async def score(
        self, ids: Sequence[int], *, top_logprobs: int, precision: str = REFERENCE_PRECISION
    ) -> list[OutToken | None]:
        """Teacher-forced logprobs of ``ids`` at ``precision`` (the first token: None)."""
        ...


_CANNED_WORDS = (
    "the",
    "model",
    "answers",
    "with",
    "a",
    "steady",
    "stream",
    "of",
    "plain",
    "words",
    "so",
    "that",
    "load",
    "tests",
    "measure",
    "the",
    "client",
    "and",
    "not",
    "the",
    "server",
    "while",
    "every",
    "reply",
    "still",
    "carries",
    "usage",
    "cost",
    "and",
    "a",
    "generation",
    "id",
    "like",
    "a",
    "real",
    "provider",
    "would",
)

_CANNED_TOKENS = tuple(TokenInfo(i, " " + w, (" " + w).encode()) for i, w in enumerate(_CANNED_WORDS))
_CANNED_IDS = {w: i for i, w in reversed(list(enumerate(_CANNED_WORDS)))}
"""Canned word → its first id (some words repeat in the list)."""
_END_OF_TURN = TokenInfo(len(_CANNED_TOKENS) + 0x10000, "<|im_end|>", b"<|im_end|>")
"""What ends a closed assistant message (above every hashed word's id); replies leave it out."""
_CANNED_STREAM = [OutToken(info, 0.0) for info in random.Random(0).choices(_CANNED_TOKENS, k=4096)]
""""Generated" text: windows into one fixed pseudo-random stream of canned words."""


class LatencyEngine:
    """No model: canned text after the provider's latency, at its throughput.

    A token is a whitespace-separated word: canned words have their canned id, any other
    word an id above them (from a hash). Each request's text is a deterministic function of
    its prompt and seed, and the logprobs say so: every sampled token has logprob 0 (it was
    certain) and the synthetic reference scores every token 0, so the whole pipeline
    (verification and its sampler check included) runs without a model, for fault and load
    tests; its verdicts measure nothing.
    """

    mode = "latency"
    context_length = 1_000_000

    def __init__(self, *, reply_tokens: int = 64) -> None:
        if not 0 < reply_tokens < len(_CANNED_STREAM) // 2:
            raise SandboxError(f"reply_tokens must be between 1 and {len(_CANNED_STREAM) // 2 - 1}")
        self.reply_tokens = reply_tokens

    def encode_chat(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        """The words of every message, an assistant's closed by the end-of-turn token (the
        last one left open under ``continue_final_message``)."""
        ids: list[int] = []
        for i, message in enumerate(messages):
            ids += self.encode_text(message.get("content", ""))
            if message.get("role") == "assistant" and not (continue_final_message and i == len(messages) - 1):
                ids.append(_END_OF_TURN.id)
        return ids or [0]

    def encode_text(self, text: str) -> list[int]:
        return [_CANNED_IDS.get(w, len(_CANNED_TOKENS) + (zlib.crc32(w.encode()) & 0xFFFF)) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.token_info(i).text for i in ids)

    def token_info(self, token_id: int) -> TokenInfo:
        if 0 <= token_id < len(_CANNED_TOKENS):
            return _CANNED_TOKENS[token_id]
        if token_id == _END_OF_TURN.id:
            return _END_OF_TURN
        text = f" w{token_id}"
        return TokenInfo(token_id, text, text.encode())

    async def complete(self, precision: str, request: SamplingRequest, *, pace: tuple[float, float] | None = None) -> Completion:
        latency_s, tokens_per_s = pace or (0.0, 0.0)
        n = min(request.max_tokens, self.reply_tokens)
        # A deterministic function of seed and prompt, cut from a long canned stream: cheap,
        # since this is the hot path of load tests.
        start = (request.seed ^ zlib.crc32(repr(request.prompt_ids[:64]).encode())) % (len(_CANNED_STREAM) - self.reply_tokens)
        await asyncio.sleep(latency_s + (n / tokens_per_s if tokens_per_s > 0 else 0.0))
        tokens = _CANNED_STREAM[start : start + n]
        return Completion(
            text="".join(t.token.text for t in tokens),
            tokens=tokens,
            finish_reason="length" if n == request.max_tokens else "stop",
            prompt_tokens=len(request.prompt_ids),
            synthetic_logprobs=True,
        )

    async def score(
        self, ids: Sequence[int], *, top_logprobs: int, precision: str = REFERENCE_PRECISION
    ) -> list[OutToken | None]:
        """The synthetic reference (at every precision): every token after the first scores 0."""
        scored: list[OutToken | None] = [None]
        for token_id in list(ids)[1:]:
            info = self.token_info(token_id)
            scored.append(OutToken(info, 0.0, [(info, 0.0)] if top_logprobs else []))
        return scored
