"""The reasoning profile (``roster.Thinking``) over any engine: the thinking template's
prompt, and decoding in three parts (reasoning, the forced end of the thinking block, the
answer) within one ``max_tokens`` budget, logprobs over every token as vLLM reports them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from quanthunt.sandbox.engine import Completion, CompletionEngine, OutToken, SamplingRequest
from quanthunt.sandbox.roster import Thinking


def prompt_ids(
    engine: CompletionEngine, messages: Sequence[dict[str, str]], thinking: Thinking | None, *, enabled: bool
) -> list[int]:
    """The chat template's ids, ready for the assistant: with the thinking block opened
    (thinking on) or rendered empty (thinking off)."""
    ids = engine.encode_chat(messages)
    if thinking is None:
        return ids
    return ids + engine.encode_text(thinking.open if enabled else thinking.open + thinking.close)


async def complete(
    engine: CompletionEngine,
    precision: str,
    request: SamplingRequest,
    thinking: Thinking | None,
    *,
    enabled: bool,
    pace: tuple[float, float] | None = None,
) -> Completion:
    """Sample ``request`` (whose prompt came from ``prompt_ids``): with thinking on, up to
    ``think_tokens`` of reasoning, the block's end (forced: its logprobs as the model scores
    it at ``precision``), then the answer with what is left of ``max_tokens``."""
    if thinking is None or not enabled:
        return await engine.complete(precision, request, pace=pace)
    budget = request.max_tokens
    think = await engine.complete(
        precision, dataclasses.replace(request, max_tokens=min(thinking.think_tokens, budget), stop=()), pace=pace
    )
    head = [*request.prompt_ids, *(t.token.id for t in think.tokens)]
    close_ids = engine.encode_text(thinking.close)
    scored = await engine.score(head + close_ids, top_logprobs=request.top_logprobs, precision=precision)
    close = [t for t in scored[len(head) :] if t is not None][: max(budget - len(think.tokens), 0)]
    tokens: list[OutToken] = [*think.tokens, *close]
    left = budget - len(tokens)
    if left <= 0:  # the reasoning ate the budget: no answer
        return Completion("", tokens, "length", len(request.prompt_ids), think.synthetic_logprobs, think.text, len(tokens))
    answer = await engine.complete(
        precision,
        dataclasses.replace(request, prompt_ids=(*head, *close_ids), max_tokens=left, seed=request.seed + 1),
        pace=pace,
    )
    return Completion(answer.text, [*tokens, *answer.tokens], answer.finish_reason, len(request.prompt_ids),
                      answer.synthetic_logprobs, think.text, len(tokens))  # fmt: skip
