"""The sandbox's reference deployment (vLLM flavour) against what a real vLLM 0.32 server
answered to the same requests (``tests/contracts/replies/vllm``): the same routes and
statuses, token names, alternatives and teacher-forced logprobs, field by field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fixtures.contracts import recorded

from quanthunt.sandbox.server import SandboxProcess

pytestmark = pytest.mark.model
VLLM = recorded("vllm")
TOLERANCE = 2e-3
"""Same fp32 weights, other kernels: logprobs agree to ~1e-5, alternatives' ranks may swap
only where two are this close."""


def ask(sandbox: SandboxProcess, name: str) -> tuple[int, Any]:
    request = VLLM[name]["request"]
    root = sandbox.reference_url.removesuffix("/v1")
    reply = httpx.request(request["method"], root + request["path"], json=request["body"], timeout=120)
    return reply.status_code, reply.json()


@pytest.mark.parametrize("name", sorted(VLLM))
def test_same_status_for_every_recorded_request(model_sandbox: SandboxProcess, name: str) -> None:
    status, _ = ask(model_sandbox, name)
    assert status == VLLM[name]["status"]


@pytest.mark.parametrize("name", ["tokenize-root-messages", "tokenize-root-prompt"])
def test_tokenize_gives_the_same_ids(model_sandbox: SandboxProcess, name: str) -> None:
    _, body = ask(model_sandbox, name)
    assert body["tokens"] == VLLM[name]["body"]["tokens"] and body["count"] == VLLM[name]["body"]["count"]


def close_rank(top: dict[str, float], key: str) -> bool:
    """Whether ``key`` sits at the edge of the listed alternatives, within ``TOLERANCE`` of
    one that is or is not listed (where two engines may rank differently)."""
    values = sorted(top.values())
    return abs(top[key] - values[0]) < TOLERANCE


@pytest.mark.parametrize("name", ["score-ids-max0", "score-names-max0", "score-names-max1"])
def test_echoed_scores_match_field_by_field(model_sandbox: SandboxProcess, name: str) -> None:
    """Token names (``""`` for a partial UTF-8 piece, ``token_id:N`` on request), the scored
    token first among k or k+1 alternatives, a later same-named alternative replacing an
    earlier one, text offsets, and the logprobs themselves."""
    _, body = ask(model_sandbox, name)
    mine, real = body["choices"][0]["logprobs"], VLLM[name]["body"]["choices"][0]["logprobs"]
    n = len(VLLM[name]["request"]["body"]["prompt"])
    assert mine["tokens"][:n] == real["tokens"][:n]
    assert mine["text_offset"][:n] == real["text_offset"][:n]
    assert mine["token_logprobs"][0] is None and mine["top_logprobs"][0] is None
    for i in range(1, n):
        assert mine["token_logprobs"][i] == pytest.approx(real["token_logprobs"][i], abs=TOLERANCE)
        ours, theirs = mine["top_logprobs"][i], real["top_logprobs"][i]
        assert next(iter(ours)) == next(iter(theirs)) == real["tokens"][i]
        unsure = {k for k in set(ours) ^ set(theirs) if close_rank(ours if k in ours else theirs, k)}
        assert set(ours) ^ set(theirs) <= unsure, f"position {i}"
        for key in set(ours) & set(theirs):
            assert ours[key] == pytest.approx(theirs[key], abs=TOLERANCE), f"position {i} {key!r}"
    assert body["usage"]["prompt_tokens"] == VLLM[name]["body"]["usage"]["prompt_tokens"]


@pytest.mark.parametrize("name", ["chat-top5", "chat-top5-ids"])
def test_chat_logprobs_have_vllms_shape(model_sandbox: SandboxProcess, name: str) -> None:
    """Chat ``top_logprobs``: the sampled token first, k entries in all; names in context;
    the sampled token's ``bytes`` those of its text (also under token ids)."""
    _, body = ask(model_sandbox, name)
    for reply in (body, VLLM[name]["body"]):
        content = reply["choices"][0]["logprobs"]["content"]
        text = reply["choices"][0]["message"]["content"]
        assert b"".join(bytes(t["bytes"]) for t in content).decode() == text
        for item in content:
            assert len(item["top_logprobs"]) == 5
            assert item["top_logprobs"][0]["token"] == item["token"]
            assert item["top_logprobs"][0]["logprob"] == item["logprob"]


@pytest.mark.parametrize("name", ["chat-stop", "chat-stop-ids"])
def test_a_stopped_reply_ends_with_its_stop_token_as_vllms_does(model_sandbox: SandboxProcess, name: str) -> None:
    """A reply that stopped: the stop token (``<|im_end|>``, or ``token_id:2``) is the last
    logprob entry and counts in ``completion_tokens``, and the text leaves it out (the
    sandbox answers greedily: its seeded draws are not vLLM's, its greedy answer stops)."""
    request = VLLM[name]["request"]
    greedy = request["body"] | {"temperature": 0.0}
    body = httpx.post(model_sandbox.reference_url.removesuffix("/v1") + request["path"], json=greedy, timeout=120).json()
    for reply in (body, VLLM[name]["body"]):
        choice = reply["choices"][0]
        content = choice["logprobs"]["content"]
        assert choice["finish_reason"] == "stop"
        assert content[-1]["token"] == ("token_id:2" if name.endswith("ids") else "<|im_end|>")
        assert bytes(content[-1]["bytes"]) == b"<|im_end|>"
        assert len(content) == reply["usage"]["completion_tokens"]
        assert b"".join(bytes(t["bytes"]) for t in content[:-1]).decode() == choice["message"]["content"]


@pytest.mark.parametrize("name", ["tokenize-root-messages-open", "tokenize-root-messages-closed"])
def test_an_assistant_message_renders_open_and_closed_as_vllms_does(model_sandbox: SandboxProcess, name: str) -> None:
    """``continue_final_message`` leaves the last message open; without it (and with no
    generation prompt) it is closed by the end-of-turn token: ``Reference.end_of_turn``."""
    _, body = ask(model_sandbox, name)
    assert body["tokens"] == VLLM[name]["body"]["tokens"]


@pytest.mark.parametrize("chat", ["chat-top5-ids", "chat-stop-ids"])
def test_teacher_forced_sandbox_scores_of_vllms_own_sample_match_its_logprobs(model_sandbox: SandboxProcess,
                                                                              chat: str) -> None:  # fmt: skip
    """The sandbox's reference scores vLLM's sampled tokens as vLLM itself reported them, the
    stop token that ended a reply included."""
    content = VLLM[chat]["body"]["choices"][0]["logprobs"]["content"]
    prompt = (
        VLLM["tokenize-root-messages"]["body"]["tokens"]
        if chat == "chat-top5-ids"
        else VLLM["score-chat-stop-sample"]["request"]["body"]["prompt"][: -len(content)]
    )
    ids = [int(t["token"].removeprefix("token_id:")) for t in content]
    root = model_sandbox.reference_url
    model = VLLM["models"]["body"]["data"][0]["id"]
    body = {"model": model, "prompt": prompt + ids, "echo": True, "logprobs": 1, "max_tokens": 0}
    scored = httpx.post(f"{root}/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[len(prompt) :] == pytest.approx([t["logprob"] for t in content], abs=TOLERANCE)
