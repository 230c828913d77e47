"""The reference's chat render (vLLM's ``POST /v1/chat/completions/render``, which the
``speculators`` project's data prep calls to get a conversation's prompt ids), over real
HTTP on loopback: the reply a real vLLM 0.32 gave (``tests/contracts/replies/vllm``,
``render-chat*``) in shape, the ids of ``/tokenize`` with ``messages`` for either
``add_generation_prompt``, vLLM's errors, and no such route in the SGLang flavour."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml
from fixtures.contracts import recorded
from fixtures.sandbox import MODEL_ID, provider, roster_dict

from quanthunt.sandbox.server import SandboxProcess

VLLM = recorded("vllm")
MESSAGES = VLLM["render-chat"]["request"]["body"]["messages"]
RENDER = "/v1/chat/completions/render"


def root(sandbox: SandboxProcess) -> str:
    return sandbox.reference_url.removesuffix("/v1")


def render(sandbox: SandboxProcess, body: Any) -> httpx.Response:
    return httpx.post(root(sandbox) + RENDER, json=body, timeout=120)


def tokenize(sandbox: SandboxProcess, **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{root(sandbox)}/tokenize", json={"model": MODEL_ID, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def same_shape(mine: Any, real: Any, where: str = "body") -> None:
    """The same keys throughout, and values of the same JSON types (null for null)."""
    if isinstance(real, dict):
        assert isinstance(mine, dict), where
        assert list(mine) == list(real), f"{where}: {sorted(set(mine) ^ set(real))}"
        for key in real:
            same_shape(mine[key], real[key], f"{where}.{key}")
    elif isinstance(real, list):
        assert isinstance(mine, list), where
        for i, item in enumerate(mine if real else []):
            same_shape(item, real[0], f"{where}[{i}]")
    else:
        assert type(mine) is type(real), f"{where}: {type(mine).__name__}, vLLM {type(real).__name__}"


# -- on the real model: the same tokenizer and chat template as the recorded vLLM ---------------------------------


@pytest.mark.model
@pytest.mark.parametrize("name", ["render-chat", "render-chat-no-generation-prompt"])
def test_the_reply_has_vllms_fields_and_types_and_its_ids(model_sandbox: SandboxProcess, name: str) -> None:
    real = VLLM[name]
    reply = render(model_sandbox, real["request"]["body"])
    assert reply.status_code == real["status"] == 200
    body = reply.json()
    same_shape(body, real["body"])
    assert body["token_ids"] == real["body"]["token_ids"]
    assert body["request_id"].startswith("chatcmpl-") and len(body["request_id"]) == len(real["body"]["request_id"])
    # a plain request: what vLLM's chat request sets, max_tokens all the context leaves
    max_model_len = tokenize(model_sandbox, prompt="x")["max_model_len"]
    expected = real["body"]["sampling_params"] | {"max_tokens": max_model_len - len(body["token_ids"])}
    assert body["sampling_params"] == expected
    unknowable = {"request_id", "token_ids", "sampling_params"}
    assert {k: v for k, v in body.items() if k not in unknowable} == {
        k: v for k, v in real["body"].items() if k not in unknowable
    }


@pytest.mark.model
def test_the_ids_are_tokenizes_and_the_generation_prompt_extends_them(model_sandbox: SandboxProcess) -> None:
    rendered = {}
    for add in (True, False):
        reply = render(model_sandbox, {"messages": MESSAGES, "add_generation_prompt": add})
        assert reply.status_code == 200, reply.text
        rendered[add] = reply.json()["token_ids"]
        assert rendered[add] == tokenize(model_sandbox, messages=MESSAGES, add_generation_prompt=add)["tokens"]
    assert len(rendered[True]) > len(rendered[False]) and rendered[True][: len(rendered[False])] == rendered[False]
    # the default is the generation prompt
    assert render(model_sandbox, {"messages": MESSAGES}).json()["token_ids"] == rendered[True]


@pytest.mark.model
def test_a_wrong_model_is_vllms_404(model_sandbox: SandboxProcess) -> None:
    real = VLLM["render-chat-wrong-model"]
    reply = render(model_sandbox, real["request"]["body"])
    assert reply.status_code == real["status"] == 404
    assert reply.json()["error"]["code"] == 404
    assert reply.json()["error"]["message"].startswith(real["body"]["error"]["message"].split(" Valid")[0])


@pytest.mark.model
def test_the_request_shapes_the_sampling_params_as_vllm_does(model_sandbox: SandboxProcess) -> None:
    """Values a real vLLM 0.32 gave to these requests (seen once, not recorded)."""
    body = {"model": MODEL_ID, "messages": MESSAGES, "seed": 7, "stop": ["x"], "top_p": 0.9, "temperature": 0.7}
    reply = httpx.post(root(model_sandbox) + RENDER, json=body | {"max_completion_tokens": 9},
                       headers={"X-Request-Id": "abc"}, timeout=120).json()  # fmt: skip
    assert reply["request_id"] == "chatcmpl-abc" and reply["model"] == MODEL_ID
    assert reply["sampling_params"] == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 0.7,
        "top_p": 0.9, "min_p": 0.0, "seed": 7, "stop": ["x"], "stop_token_ids": [], "max_tokens": 9,
        "output_kind": 2, "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False,
    }  # fmt: skip
    greedy = render(model_sandbox, {"messages": MESSAGES, "temperature": 0, "max_tokens": 5}).json()["sampling_params"]
    assert "top_p" not in greedy and "min_p" not in greedy and greedy["max_tokens"] == 5
    logprobs = render(model_sandbox, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}).json()
    assert logprobs["sampling_params"]["logprobs"] == 3
    # pydantic's lax booleans, as vLLM reads add_generation_prompt
    lax = render(model_sandbox, {"messages": MESSAGES, "add_generation_prompt": "no"}).json()
    assert lax["token_ids"] == tokenize(model_sandbox, messages=MESSAGES, add_generation_prompt=False)["tokens"]


# -- latency mode: no model needed ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    """One latency-mode sandbox (vLLM flavour) for the many bad bodies."""
    folder = tmp_path_factory.mktemp("render")
    (folder / "roster.yaml").write_text(yaml.safe_dump(roster_dict(provider("alpha"))), encoding="utf-8")
    with SandboxProcess(mode="latency", roster=folder / "roster.yaml", log_path=folder / "sandbox.log") as sandbox:
        yield sandbox


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        [1],
        {},
        {"messages": "x"},
        {"messages": []},
        {"messages": MESSAGES, "add_generation_prompt": {}},
        {"messages": MESSAGES, "chat_template_kwargs": 5},
        {"messages": MESSAGES, "max_tokens": 10**9},
        {"messages": MESSAGES, "temperature": "hot"},
    ],
    ids=repr,
)
def test_a_bad_body_is_a_400(plain_sandbox: SandboxProcess, body: Any) -> None:
    sandbox = plain_sandbox
    content = body.encode() if isinstance(body, str) else httpx.Request("POST", "/", json=body).content
    reply = httpx.post(root(sandbox) + RENDER, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and error["message"]


def test_the_thinking_switch_renders_as_tokenize_does(latency_sandbox: Callable[..., SandboxProcess]) -> None:
    """With the reasoning profile, ``chat_template_kwargs`` opens the thinking block or
    renders it empty, as ``/tokenize`` does; the reasoning parser's view comes along."""
    sandbox = latency_sandbox(roster_dict(provider("alpha"), model={"reasoning": {"think_tokens": 3}}))
    seen = {}
    for kwargs in (None, {"thinking": False}):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        reply = render(sandbox, {"messages": MESSAGES, **extra})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["token_ids"] == tokenize(sandbox, messages=MESSAGES, **extra)["tokens"]
        assert body["reasoning_ended"] is (kwargs is not None)
        assert body["reasoning_parser_kwargs"] == {
            "chat_template_kwargs": (kwargs or {}) | {"add_generation_prompt": True, "continue_final_message": False}
        }
        seen[kwargs is None] = body["token_ids"]
    assert seen[True] != seen[False]
    plain = render(sandbox, {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert plain["token_ids"] == tokenize(sandbox, messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert seen[True][: len(plain["token_ids"])] == plain["token_ids"] and plain["reasoning_ended"] is False


def test_sglang_serves_no_render(latency_sandbox: Callable[..., SandboxProcess]) -> None:
    sandbox = latency_sandbox(roster_dict(provider("alpha"), reference_flavour="sglang"))
    reply = render(sandbox, {"messages": MESSAGES, "add_generation_prompt": True})
    assert reply.status_code == 404
    unknown = httpx.post(f"{root(sandbox)}/v1/no/such/route", json={}, timeout=30)
    assert (reply.status_code, reply.json().keys()) == (unknown.status_code, unknown.json().keys())
