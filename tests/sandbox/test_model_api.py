"""The real model behind the sandbox, over real HTTP on loopback (one shared instance)."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.sandbox import AUTH, KEY, MODEL_ID
from openai import OpenAI

from quanthunt.replies import same_provider
from quanthunt.sandbox.server import SandboxProcess

pytestmark = pytest.mark.model
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write one sentence about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def sdk(model_sandbox: SandboxProcess) -> OpenAI:
    return OpenAI(base_url=model_sandbox.api_url, api_key=KEY, max_retries=0, timeout=120)


def gateway_chat(sandbox: SandboxProcess, **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{sandbox.api_url}/chat/completions", json={"model": MODEL_ID, **body}, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def reference(sandbox: SandboxProcess, route: str, **body: Any) -> dict[str, Any]:
    base = sandbox.reference_url.removesuffix("/v1") if route == "tokenize" else sandbox.reference_url
    reply = httpx.post(f"{base}/{route}", json={"model": MODEL_ID, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_openai_sdk_gets_paris_greedily_with_logprobs(sdk: OpenAI, contract: Callable[[str, Any], None]) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL_ID,
        messages=PARIS,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=5,
        extra_body={"provider": {"only": ["moonshotai"], "allow_fallbacks": False, "require_parameters": True}},
    )
    contract("ChatResult", raw.http_response.json())
    completion = raw.parse()
    choice = completion.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    assert len(tokens) == completion.usage.completion_tokens  # type: ignore[union-attr]
    # the stop token ends the logprobs and the count, not the text (as vLLM 0.32: chat-stop.json)
    assert tokens[-1].token == "<|im_end|>"
    assert "".join(t.token for t in tokens[:-1]) == choice.message.content
    for token in tokens:
        assert len(token.top_logprobs) == 5
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy picks the argmax
        assert token.logprob <= 0
    assert completion.model_extra and completion.model_extra["provider"] == "Moonshot AI"


def test_teacher_forced_scores_equal_sampling_logprobs(model_sandbox: SandboxProcess) -> None:
    sampled = reference(
        model_sandbox,
        "chat/completions",
        messages=STORY,
        temperature=1.0,
        seed=7,
        max_tokens=32,
        logprobs=True,
        top_logprobs=2,
        return_tokens_as_token_ids=True,
    )
    content = sampled["choices"][0]["logprobs"]["content"]
    completion_ids = [int(t["token"].split(":")[1]) for t in content]
    prompt_ids = reference(model_sandbox, "tokenize", messages=STORY)["tokens"]
    scored = reference(model_sandbox, "completions", prompt=prompt_ids + completion_ids, max_tokens=0, echo=True, logprobs=2)
    teacher = scored["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids) :]
    assert len(teacher) == len(content) > 5
    assert max(abs(a - t["logprob"]) for a, t in zip(teacher, content, strict=True)) < 1e-4


def test_faithful_provider_matches_the_reference_and_nvfp4_does_not(model_sandbox: SandboxProcess) -> None:
    body: dict[str, Any] = {"messages": STORY, "temperature": 1.0, "seed": 1234, "max_tokens": 32, "logprobs": True}
    ref = reference(model_sandbox, "chat/completions", **body)
    faithful = gateway_chat(model_sandbox, **body, provider={"only": ["moonshotai"]})
    nvfp4 = gateway_chat(model_sandbox, **body, provider={"only": ["together"]})
    text = ref["choices"][0]["message"]["content"]
    assert faithful["choices"][0]["message"]["content"] == text
    ref_lp = [t["logprob"] for t in ref["choices"][0]["logprobs"]["content"]]
    faithful_lp = [t["logprob"] for t in faithful["choices"][0]["logprobs"]["content"]]
    assert faithful_lp == pytest.approx(ref_lp, abs=1e-4)
    nvfp4_lp = [t["logprob"] for t in nvfp4["choices"][0]["logprobs"]["content"]]
    assert nvfp4_lp[:3] != pytest.approx(ref_lp[:3], abs=1e-3)


def test_bf16_compute_is_close_but_not_identical(model_sandbox: SandboxProcess) -> None:
    body: dict[str, Any] = {"messages": PARIS, "temperature": 0, "max_tokens": 12, "logprobs": True}
    ref = [t["logprob"] for t in reference(model_sandbox, "chat/completions", **body)["choices"][0]["logprobs"]["content"]]
    bf16 = gateway_chat(model_sandbox, **body, provider={"only": ["fireworks"]})
    got = [t["logprob"] for t in bf16["choices"][0]["logprobs"]["content"]]
    diffs = [abs(a - b) for a, b in zip(ref, got, strict=False)]
    assert 0 < sum(diffs) / len(diffs) < 0.3


def echo_scores(base: str, ids: list[int]) -> list[float]:
    body = {"model": MODEL_ID, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1}
    reply = httpx.post(f"{base}/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [float(v) for v in reply.json()["choices"][0]["logprobs"]["token_logprobs"][1:]]


def test_the_rosters_other_deployments_each_serve_their_own_precision(model_sandbox: SandboxProcess) -> None:
    """The default roster's ``deployments``: the same text scored by the reference and by
    each deployment, as a team would score it on its second server and its coarse build."""
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp for the passing ships."
    ids = reference(model_sandbox, "tokenize", prompt=text)["tokens"]
    ours = echo_scores(model_sandbox.reference_url, ids)
    off = {
        name: statistics.fmean(
            abs(a - b) for a, b in zip(echo_scores(model_sandbox.deployment_url(name), ids), ours, strict=True)
        )
        for name in ("bf16-box", "fp8-kv", "coarse")
    }
    assert 0 < off["bf16-box"] < off["coarse"] and 0 < off["fp8-kv"] < off["coarse"], off
    assert off["coarse"] > 0.1, off  # NVFP4 weights: far off
    chat = httpx.post(
        f"{model_sandbox.deployment_url('coarse')}/chat/completions",
        json={"model": MODEL_ID, "messages": PARIS, "max_tokens": 8, "seed": 1},
        timeout=120,
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    unknown = httpx.post(f"{model_sandbox.url}/deployments/nope/v1/completions", json={"model": MODEL_ID, "prompt": "Hi"})
    assert unknown.status_code == 404


def test_streaming_concatenates_to_the_same_text(sdk: OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_ID,
        "messages": STORY,
        "temperature": 0.8,
        "seed": 99,
        "max_tokens": 24,
        "extra_body": {"provider": {"only": ["moonshotai"]}},
    }
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_provider_without_logprobs_drops_them_unless_required(model_sandbox: SandboxProcess) -> None:
    body: dict[str, Any] = {"messages": PARIS, "max_tokens": 4, "logprobs": True}
    dropped = gateway_chat(model_sandbox, **body, provider={"only": ["novita"]})
    assert dropped["provider"] == "Novita"
    assert dropped["choices"][0]["logprobs"] is None
    refused = httpx.post(
        f"{model_sandbox.api_url}/chat/completions",
        json={"model": MODEL_ID, **body, "provider": {"only": ["novita"], "require_parameters": True}},
        headers=AUTH,
    )
    assert refused.status_code == 404


def test_every_default_provider_serves_and_bills(model_sandbox: SandboxProcess) -> None:
    endpoints = httpx.get(f"{model_sandbox.api_url}/models/{MODEL_ID}/endpoints").json()["data"]["endpoints"]
    for endpoint in endpoints:
        if endpoint["status"] <= -3:
            continue
        reply = gateway_chat(model_sandbox, messages=PARIS, max_tokens=3, provider={"only": [endpoint["tag"]]})
        assert same_provider(reply["provider"], endpoint["provider_name"], endpoint["tag"])  # Parasail answers by slug
        usage = reply["usage"]
        prompt, completion = float(endpoint["pricing"]["prompt"]), float(endpoint["pricing"]["completion"])
        discount = endpoint["pricing"].get("discount", 0)
        expected = (usage["prompt_tokens"] * prompt + usage["completion_tokens"] * completion) * (1 - discount)
        assert usage["cost"] == pytest.approx(expected)


def test_a_short_request_overtakes_a_long_one_running_at_any_precision(model_sandbox: SandboxProcess) -> None:
    """Continuous batching: a request joins the running batch between steps and leaves when it
    is done, whether it shares the long request's precision (the reference) or not (nvfp4
    through the gateway); it never waits for another request's whole completion."""

    async def race() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(timeout=300) as client:

            async def long() -> None:
                body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "seed": 1}
                reply = await client.post(f"{model_sandbox.reference_url}/completions", json=body)
                assert reply.json()["usage"]["completion_tokens"] == 300
                finished.append("long")

            async def short(name: str, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
                await asyncio.sleep(1.0)  # the long one is decoding by now
                reply = await client.post(url, json={"model": MODEL_ID, "max_tokens": 4, **body}, headers=headers)
                assert reply.status_code == 200, reply.text
                finished.append(name)

            await asyncio.gather(
                long(),
                short("same precision", f"{model_sandbox.reference_url}/completions", {"prompt": "Hello"}, {}),
                short(
                    "nvfp4",
                    f"{model_sandbox.api_url}/chat/completions",
                    {"messages": PARIS, "provider": {"only": ["together"]}},
                    AUTH,
                ),
            )
        return finished

    assert asyncio.run(race())[-1] == "long"
