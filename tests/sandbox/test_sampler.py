"""The sampler's one known source of rerun differences, measured: a seeded request's text
depends on the batch it was computed in only through float rounding, which flips a
sampled token at a near-tie in a few fp32 completions (bf16 compute: most of them).
Verdicts must not depend on it; the README states the bound this test keeps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from quanthunt.sandbox.decoder import Decoder
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.sampler import (
    PREFIX_BLOCK,
    PROCESSED_FLOOR,
    Lane,
    Sample,
    Sampler,
    ScoreCache,
    TokenLogprob,
    draw,
    reported_logprobs,
    score_batch,
)

pytestmark = pytest.mark.model

QUESTIONS = ("Explain how a hash map works.", "Write a haiku about rain.", "Why is the sky blue?", "Describe the water cycle.")


def test_batch_composition_flips_few_fp32_completions() -> None:
    model, tokenizer = load_reference()
    sampler = Sampler(model, tokenizer, stop_token_ids=[])
    requests = []
    for i in range(24):
        messages = [{"role": "user", "content": QUESTIONS[i % 4] + " " * (i // 4)}]  # prompts of several lengths
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        requests.append(SamplingRequest(tuple(ids), 24, temperature=1.0, seed=1000 + i))
    together = sampler.sample(requests)
    apart = [sample for start in range(0, 24, 5) for sample in sampler.sample(requests[start : start + 5])]
    again = sampler.sample(requests)
    assert [s.token_ids for s in again] == [s.token_ids for s in together]  # same batch, same text: no other randomness
    differ = sum(a.token_ids != b.token_ids for a, b in zip(together, apart, strict=True))
    # measured: 0 with these seeds and two other seed sets (the engine before continuous batching: 1, 0, 0)
    assert differ <= 3, f"{differ} of 24 completions changed with the batch composition"


def test_requests_joining_a_running_batch_get_their_own_text() -> None:
    """A lane admits requests between steps: each one staggered into a running batch draws the
    same tokens as when it ran alone (up to the near-tie flips measured above), stops at its
    own max_tokens, and leaves the others running."""
    model, tokenizer = load_reference()
    sampler = Sampler(model, tokenizer, stop_token_ids=[])
    requests = []
    for i in range(6):
        messages = [{"role": "user", "content": QUESTIONS[i % 4] + " " * i}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        requests.append(SamplingRequest(tuple(ids), 6 + 3 * i, temperature=1.0, seed=50 + i, top_logprobs=2))
    alone = [sampler.sample([request])[0] for request in requests]
    got: dict[int, Sample] = {}
    lane = Lane(sampler.decoder, sampler._decode, stop_token_ids=[], max_batch=4)
    order: list[int] = []

    def keep(i: int) -> Callable[[Sample], None]:
        def done(sample: Sample) -> None:
            got[i] = sample
            order.append(i)

        return done

    with torch.inference_mode():
        waiting = list(enumerate(requests))
        while waiting or lane.running:
            if waiting and lane.free:  # one joins every step while there is room
                i, request = waiting.pop(0)
                lane.admit([(request, keep(i))])
            lane.step()
    assert sorted(got) == list(range(6))
    assert [len(got[i].token_ids) for i in range(6)] == [r.max_tokens for r in requests]
    assert all(got[i].finish_reason == "length" and len(got[i].logprobs[0].top) == 2 for i in range(6))
    differ = sum(got[i].token_ids != alone[i].token_ids for i in range(6))
    assert differ <= 1, f"{differ} of 6 staggered completions differ from their run alone"
    assert order.index(0) < order.index(5)  # the short first request left before the long last one


def test_ignore_eos_runs_every_request_to_max_tokens() -> None:
    model, tokenizer = load_reference()
    sampler = Sampler(model, tokenizer, stop_token_ids=[int(tokenizer.eos_token_id)])
    ids = tuple(
        tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    requests = [
        SamplingRequest(ids, 40, temperature=1.0, seed=s, ignore_eos=ignore) for s in range(4) for ignore in (False, True)
    ]
    samples = sampler.sample(requests)
    stopped = [s for s, r in zip(samples, requests, strict=True) if not r.ignore_eos]
    forced = [s for s, r in zip(samples, requests, strict=True) if r.ignore_eos]
    assert any(s.finish_reason == "stop" for s in stopped)  # "Say hi." ends early at EOS without it
    assert all(len(s.token_ids) == 40 and s.finish_reason == "length" for s in forced)


def _scored_sequences(tokenizer: object) -> list[list[int]]:
    """Three completions of one prompt and one of another (every prompt shares the chat
    template's system header), of several lengths."""
    sequences = []
    completions = {
        QUESTIONS[0]: ("A map of keys.", "Buckets!", "It hashes each key to a bucket index"),
        QUESTIONS[2]: ("Rayleigh.",),
    }
    for question, tails in completions.items():
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]  # type: ignore[attr-defined]
        for tail in tails:
            sequences.append([int(i) for i in prompt] + tokenizer(tail, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    return sequences


def _assert_same_scores(cached: list[TokenLogprob | None], whole: list[TokenLogprob | None], tolerance: float) -> None:
    assert len(cached) == len(whole) and cached[0] is None and whole[0] is None
    for ours, theirs in zip(cached[1:], whole[1:], strict=True):
        assert ours is not None and theirs is not None and ours.token_id == theirs.token_id
        assert abs(ours.logprob - theirs.logprob) < tolerance
        # the alternatives' values, sorted: robust to two tied alternatives trading places
        assert len(ours.top) == len(theirs.top)
        assert max(abs(a[1] - b[1]) for a, b in zip(ours.top, theirs.top, strict=True)) < tolerance


def test_a_cached_prefix_scores_what_the_whole_sequence_does() -> None:
    """Completions of one prompt reuse its blocks (and another prompt the shared header), and
    every position scores as in one uncached pass, up to fp32 rounding (2e-5 at most measured)."""
    model, tokenizer = load_reference()
    decoder = Decoder(model)
    sequences = _scored_sequences(tokenizer)
    with torch.inference_mode():
        whole = score_batch(decoder, [(ids, 5) for ids in sequences])
        cache = ScoreCache()
        first = score_batch(decoder, [(sequences[0], 5)], cache)[0]
        assert cache.cached_length(sequences[0], 5) == len(sequences[0]) // PREFIX_BLOCK * PREFIX_BLOCK - 1
        shared = [cache.cached_length(ids, 5) for ids in sequences[1:]]
        prompt = len(sequences[-1]) - len(tokenizer("Rayleigh.", add_special_tokens=False)["input_ids"])
        assert all(n >= prompt // PREFIX_BLOCK * PREFIX_BLOCK - 1 for n in shared[:2]), shared  # the whole prompt's blocks
        assert 0 < shared[2] < prompt - PREFIX_BLOCK, shared  # the other prompt: the system header only
        assert cache.cached_length(sequences[0], 2) == 0  # other alternatives, other scores
        rest = score_batch(decoder, [(ids, 5) for ids in sequences[1:]], cache)  # one batch, from several depths
    for cached, uncached in zip([first, *rest], whole, strict=True):
        _assert_same_scores(cached, uncached, 1e-4)


def test_the_score_cache_keeps_to_its_budget_and_forgets_the_least_recently_used() -> None:
    model, tokenizer = load_reference()
    decoder = Decoder(model)
    sequences = _scored_sequences(tokenizer)
    position = 2 * len(decoder.layers) * decoder.kv_heads * decoder.head_dim * 4  # fp32 keys and values
    budget = 3 * PREFIX_BLOCK * position  # three blocks: less than one sequence
    assert len(sequences[0]) >= 5 * PREFIX_BLOCK
    cache = ScoreCache(budget)
    with torch.inference_mode():
        whole = score_batch(decoder, [(sequences[0], 3)])[0]
        score_batch(decoder, [(sequences[0], 3)], cache)
        assert 0 < cache.nbytes <= budget
        assert cache.cached_length(sequences[0], 3) == 0  # its first blocks went first
        again = score_batch(decoder, [(sequences[0], 3)], cache)[0]
    _assert_same_scores(again, whole, 1e-4)


def test_processed_logprobs_are_the_distribution_each_token_was_drawn_from() -> None:
    """vLLM's ``--logprobs-mode processed_logprobs``: after temperature and the top-p
    nucleus (renormalised, a cut token at -9999), the same as raw at T 1 and top-p 1."""
    logits = torch.randn((4, 300), generator=torch.Generator().manual_seed(3)) * 4
    raw = torch.log_softmax(logits, dim=-1)
    requests = [
        SamplingRequest((1,), 8, temperature=0.7, seed=0),
        SamplingRequest((1,), 8, temperature=1.0, seed=1, processed_logprobs=True),
        SamplingRequest((1,), 8, temperature=0.7, seed=2, processed_logprobs=True),
        SamplingRequest((1,), 8, temperature=0.7, top_p=0.6, seed=3, processed_logprobs=True),
    ]
    reported = reported_logprobs(logits, requests)
    assert torch.equal(reported[0], raw[0])
    assert torch.allclose(reported[1], raw[1], atol=1e-6)
    assert torch.allclose(reported[2], torch.log_softmax(logits[2] / 0.7, dim=-1), atol=1e-6)
    kept = reported[3] > PROCESSED_FLOOR
    assert 1 < int(kept.sum()) < 300 and float(reported[3].min()) == PROCESSED_FLOOR
    assert float(torch.logsumexp(reported[3][kept], dim=-1)) == pytest.approx(0.0, abs=1e-5)
    nucleus_mass = float(torch.softmax(logits[3] / 0.7, dim=-1)[kept].sum())
    assert nucleus_mass >= 0.6 and nucleus_mass - float(torch.softmax(logits[3] / 0.7, dim=-1)[kept].min()) < 0.6
    for seed in range(200):  # every token the nucleus sampler draws is one the reported logprobs keep
        generators = [torch.Generator().manual_seed(seed) for _ in requests]
        assert bool(kept[draw(logits, requests, generators)[3]])
