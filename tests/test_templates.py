"""Recovering the reference's chat template from its renders: the system prompt it inserts
by default and its turn markers, checked on synthetic renders of two template families and
on the sandbox's real SmolLM2 template, which must also reproduce the gateway's billing."""

from __future__ import annotations

import httpx
import pytest
from fixtures.sandbox import AUTH, MODEL_ID, reference_chat_template

from quanthunt.sandbox.server import SandboxProcess
from quanthunt.templates import PROBES, ChatTemplate, derive


def chatml(messages: list[dict[str, str]], generation_prompt: bool, default_system: str | None) -> str:
    if messages[0]["role"] != "system" and default_system is not None:
        messages = [{"role": "system", "content": default_system}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def llama3(messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages
    )
    return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation_prompt else "")


def test_a_chatml_template_with_a_default_system_prompt() -> None:
    renders = {name: chatml(list(m), g, "You are SmolLM.") for name, (m, g) in PROBES.items()}
    assert derive(renders) == ChatTemplate("You are SmolLM.", "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n")


def test_a_template_without_a_default_system_prompt() -> None:
    renders = {name: llama3(list(m), g) for name, (m, g) in PROBES.items()}
    found = derive(renders)
    assert found.system_prompt is None
    assert (found.user_header, found.assistant_header, found.end_of_turn_token) == (
        "<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>",
    )  # fmt: skip


def test_templates_that_do_not_fit_are_named() -> None:
    renders = {name: chatml(list(m), g, None) for name, (m, g) in PROBES.items()}
    with pytest.raises(ValueError, match="drops a conversation's system message"):
        derive(renders | {"with_system": renders["default"]})
    with pytest.raises(ValueError, match="no end-of-turn marker"):
        derive(renders | {"answered": renders["answered"].removesuffix("<|im_end|>\n")})


@pytest.mark.model
def test_the_sandbox_reference_template_reproduces_the_gateways_prompt_tokens(model_sandbox: SandboxProcess) -> None:
    found = reference_chat_template(model_sandbox)
    assert found.system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert (found.assistant_header, found.end_of_turn_token) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    # The explicit system prompt renders exactly what the provider billed for a conversation without one.
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = httpx.post(f"{model_sandbox.api_url}/chat/completions", timeout=120, headers=AUTH,
                       json={"model": MODEL_ID, "messages": messages, "max_tokens": 2})  # fmt: skip
    assert reply.status_code == 200, reply.text
    explicit = [{"role": "system", "content": found.system_prompt}, *messages]
    tokens = httpx.post(model_sandbox.reference_url.removesuffix("/v1") + "/tokenize", timeout=60,
                        json={"messages": explicit, "add_generation_prompt": True}).json()["tokens"]  # fmt: skip
    assert len(tokens) == reply.json()["usage"]["prompt_tokens"]
