"""The engine's compute thread: closing it answers every request it holds, scoring shares a
prompt's computation among the completions that arrive with it, and identical requests in
flight share one computation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from quanthunt.errors import SandboxError
from quanthunt.sandbox.engine import OutToken, SamplingRequest
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.model_engine import ModelEngine
from quanthunt.sandbox.sampler import PREFIX_BLOCK, Sampler

pytestmark = pytest.mark.model


def test_closing_fails_running_and_waiting_requests_instead_of_leaving_them_hanging() -> None:
    engine = ModelEngine.load()
    ids = tuple(engine.encode_chat([{"role": "user", "content": "hi"}]))

    async def scenario() -> list[BaseException | object]:
        # 40 long requests: a lane runs 32 of them, the other 8 wait for a free row.
        requests = [SamplingRequest(ids, 500, seed=i, ignore_eos=True) for i in range(40)]
        tasks = [asyncio.ensure_future(engine.complete("int4-native", r)) for r in requests]
        await asyncio.sleep(1.0)
        engine.close()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)

    answers = asyncio.run(scenario())
    assert len(answers) == 40 and all(isinstance(a, SandboxError) for a in answers), answers


def test_completions_of_one_new_prompt_scored_together_compute_the_prompt_once() -> None:
    """Four completions of one prompt arrive in one batch: one of them is scored first and
    the other three start where its blocks end; their scores equal each one's alone."""
    engine = ModelEngine.load()
    prompt = engine.encode_chat([{"role": "user", "content": "Explain how a hash map works, briefly."}])
    sequences = [prompt + engine.encode_text(tail) for tail in ("Keys hash to buckets.", "A table.", "It maps keys.", "Hashing!")]

    async def scenario() -> list[list[OutToken | None]]:
        return list(await asyncio.gather(*(engine.score(ids, top_logprobs=5) for ids in sequences)))

    together = asyncio.run(scenario())
    stats = engine.compute_stats()
    engine.close()
    computed, reused = stats["score"]["tokens"], stats["score_cached"]["tokens"]
    shared = len(prompt) // PREFIX_BLOCK * PREFIX_BLOCK - 1  # the prompt's whole blocks but the last position
    assert computed + reused == sum(len(ids) for ids in sequences)
    assert reused >= 3 * shared, stats
    model, tokenizer = load_reference()
    alone = Sampler(model, tokenizer, stop_token_ids=[])  # no cache: each sequence in one causal pass
    for ids, scored in zip(sequences, together, strict=True):
        own = alone.score(ids, top_logprobs=5)
        assert [t.token.id if t else None for t in scored] == [t.token_id if t else None for t in own]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(scored[1:], own[1:], strict=True) if a and b) < 1e-4


def test_identical_requests_in_flight_are_computed_once_and_one_giving_up_leaves_the_other_its_answer() -> None:
    """Every request is seeded: endpoints serving one precision are asked the same audit
    request, and a timed-out probe is asked again while its first try still computes."""
    engine = ModelEngine.load()
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Name three rivers."}]))
    request = SamplingRequest(ids, 24, seed=5, top_logprobs=5, ignore_eos=True)

    async def scenario() -> list[object]:
        impatient = asyncio.ensure_future(engine.complete("nvfp4", request))
        patient = [asyncio.ensure_future(engine.complete("nvfp4", request)) for _ in range(2)]
        await asyncio.sleep(0)
        impatient.cancel()
        answers = await asyncio.gather(*patient)
        shared = engine.compute_stats()["decode"]["rows"]
        alone = await engine.complete("nvfp4", dataclasses.replace(request, seed=6))
        return [*answers, alone, shared, engine.compute_stats()["decode"]["rows"] - shared]

    first, second, other, shared_rows, alone_rows = asyncio.run(scenario())
    engine.close()
    assert first == second and first != other
    assert shared_rows == alone_rows > 0  # three requests for one answer cost what one does
