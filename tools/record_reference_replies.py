"""Record what a real reference server answers to the requests quanthunt's reference client
makes, as contract fixtures.

Usage: ``python tools/record_reference_replies.py http://127.0.0.1:8011 tests/contracts/replies/vllm``
(the server's root URL; ``make reference-vllm`` starts one on the sandbox's weights).

Each request of ``EXCHANGES`` is sent once and written as ``<name>.json``: the request
(method, path, body) and the reply (status, body). The prompts include text whose tokens
split characters into partial UTF-8 pieces (accents, CJK), where servers differ most. The
files are committed; ``tests/test_reference.py`` replays them to the client, and
``tests/sandbox/test_reference_contract.py`` asks the sandbox the same requests and
compares its replies field by field. Rerun against a new server version and review the diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

MODEL = "huggingfacetb/smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Write the names of two cities in Japanese and in French, with accents."}]
TEXT = "Ittoille être 東京 and 北京: déjà vu."


def exchanges(client: httpx.Client) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(name, method, path, body); some bodies depend on what the server tokenized."""
    prompt = client.post("/tokenize", json={"model": MODEL, "messages": CHAT, "add_generation_prompt": True}).json()["tokens"]
    text = client.post("/tokenize", json={"model": MODEL, "prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    sample = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "logprobs": True}
    score = {"model": MODEL, "prompt": prompt + text, "echo": True, "logprobs": 5, "max_tokens": 0, "temperature": 0}
    return [
        ("models", "GET", "/v1/models", None),
        ("version", "GET", "/version", None),
        ("tokenize-root-messages", "POST", "/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": True}),
        ("tokenize-root-prompt", "POST", "/tokenize", {"model": MODEL, "prompt": TEXT, "add_special_tokens": False}),
        ("tokenize-v1-messages", "POST", "/v1/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": True}),
        ("detokenize-root", "POST", "/detokenize", {"model": MODEL, "tokens": text}),
        ("score-ids-max0", "POST", "/v1/completions", score | {"return_tokens_as_token_ids": True}),
        ("score-names-max0", "POST", "/v1/completions", score),
        ("score-names-max1", "POST", "/v1/completions", score | {"max_tokens": 1}),
        ("score-noecho-max0", "POST", "/v1/completions", score | {"echo": False}),
        ("chat-top5", "POST", "/v1/chat/completions", sample | {"top_logprobs": 5}),
        ("chat-top5-ids", "POST", "/v1/chat/completions", sample | {"top_logprobs": 5, "return_tokens_as_token_ids": True}),
        ("chat-wrong-model", "POST", "/v1/chat/completions", sample | {"model": "acme/none"}),
    ]


def main(root: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=root.rstrip("/"), timeout=120) as client:
        version = client.get("/version").json().get("version")
        for name, method, path, body in exchanges(client):
            reply = client.request(method, path, json=body)
            try:
                data = reply.json()
            except ValueError:
                data = reply.text
            record = {"server": f"vllm {version}", "request": {"method": method, "path": path, "body": body},
                      "status": reply.status_code, "body": data}  # fmt: skip
            (out / f"{name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"{name}: {reply.status_code}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
