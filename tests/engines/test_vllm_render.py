"""A real vLLM's chat render (``POST /v1/chat/completions/render``, what the ``speculators``
project's data prep calls), as the sandbox's reference imitates it (``tests/sandbox/test_render.py``):
the chat template's ids, those of its own ``/tokenize`` with ``messages`` for either
``add_generation_prompt``, the generation prompt extending the conversation, and the
recorded reply's fields (``tests/contracts/replies/vllm/render-chat*``).

The suite's vLLM (``tests/fixtures/engines.py``) is started with the scale-out routes on,
which serve the render. Run alone with
``.venv/bin/pytest -n 0 -m engines tests/engines/test_vllm_render.py`` (about a minute to
start the server on the sandbox's fp32 weights)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fixtures.contracts import recorded

from quanthunt.engines import VllmServer

pytestmark = pytest.mark.engines
VLLM = recorded("vllm")
MESSAGES = VLLM["render-chat"]["request"]["body"]["messages"]


def post(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(server.url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_the_render_ids_are_its_tokenize_ids_and_the_generation_prompt_extends_them(vllm: VllmServer) -> None:
    rendered = {}
    for add in (True, False):
        body = post(vllm, "/v1/chat/completions/render", {"messages": MESSAGES, "add_generation_prompt": add})
        assert list(body) == list(VLLM["render-chat"]["body"])  # the recorded fields, in order
        rendered[add] = body["token_ids"]
        assert rendered[add] == post(vllm, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add})["tokens"]
        assert rendered[add] == VLLM["render-chat" if add else "render-chat-no-generation-prompt"]["body"]["token_ids"]
    assert len(rendered[True]) > len(rendered[False]) and rendered[True][: len(rendered[False])] == rendered[False]
