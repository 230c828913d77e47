"""The sampler's one known source of rerun differences, measured: a seeded request's text
depends on the batch it was computed in only through float rounding, which flips a
sampled token at a near-tie in a few fp32 completions (bf16 compute: most of them).
Verdicts must not depend on it; the README states the bound this test keeps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.sampler import Lane, Sample, Sampler

pytestmark = pytest.mark.model

QUESTIONS = ("Explain how a hash map works.", "Write a haiku about rain.", "Why is the sky blue?", "Describe the water cycle.")


def test_batch_composition_flips_few_fp32_completions() -> None:
    torch.set_num_threads(2)
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
    torch.set_num_threads(2)
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
