"""The sandbox's memo: an answer kept is the answer computed, exactly; it is found only by
its own model, code, precision and request; and the model engine asks it before computing."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from quanthunt.errors import SandboxError
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.memo import VARIABLE, Memo
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.model_engine import ModelEngine
from quanthunt.sandbox.sampler import Sample, TokenLogprob

REQUEST = SamplingRequest(prompt_ids=(1, 2, 3), max_tokens=4, temperature=0.7, top_p=0.9, seed=11, top_logprobs=2)
SAMPLE = Sample(
    token_ids=[5, 6],
    logprobs=[TokenLogprob(5, -0.1234567890123, [(5, -0.1234567890123), (9, -2.5)]), TokenLogprob(6, -1e-12, [])],
    text="ab",
    finish_reason="length",
)


def test_a_kept_sample_comes_back_exactly_and_from_another_process_s_memo(tmp_path: Path) -> None:
    path = tmp_path / "memo.sqlite"
    Memo(path, model_digest="m").keep("sample", "nvfp4", REQUEST, SAMPLE)
    other = Memo(path, model_digest="m")  # as a later sandbox process opens it
    assert other.answer("sample", "nvfp4", REQUEST) == SAMPLE
    assert other.hits == 1


def test_only_the_same_model_precision_and_request_find_an_answer(tmp_path: Path) -> None:
    path = tmp_path / "memo.sqlite"
    memo = Memo(path, model_digest="m")
    scores = [None, TokenLogprob(2, -0.5, [(2, -0.5)]), TokenLogprob(3, -3.0, [])]
    memo.keep("sample", "nvfp4", REQUEST, SAMPLE)
    memo.keep("score", "int4-native", ((1, 2, 3), 5), scores)
    assert memo.answer("sample", "int4-native", REQUEST) is None
    assert memo.answer("sample", "nvfp4", dataclasses.replace(REQUEST, seed=12)) is None
    assert memo.answer("sample", "nvfp4", dataclasses.replace(REQUEST, temperature=0.8)) is None
    assert Memo(path, model_digest="another model").answer("sample", "nvfp4", REQUEST) is None
    assert memo.answer("score", "int4-native", ((1, 2, 3), 4)) is None
    assert memo.answer("score", "int4-native", ((1, 2), 5)) is None
    assert memo.answer("score", "int4-native", ((1, 2, 3), 5)) == scores


def test_an_unusable_memo_path_names_the_variable_and_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "a folder"
    folder.mkdir()
    monkeypatch.setenv(VARIABLE, str(folder))
    with pytest.raises(SandboxError, match=rf"\${VARIABLE}: cannot use .*a folder as the sandbox's memo"):
        Memo.from_environment(model_digest="m")
    monkeypatch.setenv(VARIABLE, "")
    assert Memo.from_environment(model_digest="m") is None


@pytest.mark.model
def test_the_engine_answers_a_request_it_answered_before_from_the_memo(tmp_path: Path) -> None:
    reference, tokenizer = load_reference()
    engine = ModelEngine(reference, tokenizer, memo=Memo(tmp_path / "memo.sqlite", model_digest="m"))
    ids = engine.encode_chat([{"role": "user", "content": "Name a colour."}])
    request = SamplingRequest(tuple(ids), 12, temperature=1.0, seed=3, top_logprobs=5)

    async def twice() -> list[object]:
        first = await engine.complete("nvfp4", request)
        scored = await engine.score([*ids, *(t.token.id for t in first.tokens)], top_logprobs=5)
        computed = engine.compute_stats()
        again = await engine.complete("nvfp4", request)
        rescored = await engine.score([*ids, *(t.token.id for t in first.tokens)], top_logprobs=5)
        return [first, scored, computed, again, rescored, engine.compute_stats()]

    first, scored, computed, again, rescored, stats = asyncio.run(twice())
    engine.close()
    assert again == first and rescored == scored
    assert stats["memo"]["hits"] == 2
    assert {kind: stats[kind] for kind in ("decode", "score")} == {kind: computed[kind] for kind in ("decode", "score")}
