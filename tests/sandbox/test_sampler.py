"""The sampler's one known source of rerun differences, measured: a seeded request's text
depends on the batch it was computed in only through float rounding, which flips a
sampled token at a near-tie in a few fp32 completions (bf16 compute: most of them).
Verdicts must not depend on it; the README states the bound this test keeps."""

from __future__ import annotations

import pytest
import torch

from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.sampler import Sampler

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
    # measured: 1 with these seeds, 0 with two other seed sets
    assert differ <= 3, f"{differ} of 24 completions changed with the batch composition"
