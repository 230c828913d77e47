"""vLLM's speculators, another consumer of our final files, prepares them with its own code:
``speculators prepare-data`` (``speculators`` on PyPI, installed without its GPU dependencies
by ``make install``) with ``--render-endpoint`` at the reference, which renders every
conversation through vLLM's ``/v1/chat/completions/render`` (the sandbox imitates a vLLM
started with ``--enable-scale-out``) and masks each assistant turn at the boundary between
the render of the turn's context with the generation prompt and the render through the turn.

It makes one training row per assistant turn: the conversation through that turn, only that
turn supervised. With SmolLM2's template the supervised tokens are the turn's content, its
``<|im_end|>`` and the newline the template writes after every message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from quanthunt.sandbox.server import SandboxProcess

pytestmark = pytest.mark.model

END_OF_TURN = "<|im_end|>\n"  # what the template closes every message with, all of it supervised

ROWS = [
    {"id": "single", "conversations": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2 + 2 = 4."},
    ]},
    {"id": "multi", "conversations": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green, like grass."},
    ]},
    {"id": "system", "conversations": [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
    ]},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from quanthunt.sandbox.model import model_folder

    return AutoTokenizer.from_pretrained(str(model_folder()), local_files_only=True)


def final_file(path: Path) -> Path:
    """The rows as ``data/final/<dataset>.jsonl`` holds them (status and a nested provenance)."""
    lines = []
    for row in ROWS:
        turns = [{"endpoint_tag": "p/int4", "finish_reason": "stop", "usage": {"completion_tokens": 9}}] * sum(
            t["role"] == "assistant" for t in row["conversations"]
        )
        lines.append(json.dumps({**row, "status": "success", "provenance": {"dataset": "tiny", "turns": turns}}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def prepare_data(final: Path, output: Path, render_endpoint: str) -> subprocess.CompletedProcess[str]:
    """``speculators prepare-data`` as a user runs it, offline, with its datasets cache in ``output``'s folder."""
    from quanthunt.sandbox.model import model_folder

    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(output.parent / "hf-datasets"), "NO_COLOR": "1"}
    argv = [sys.executable, "-m", "speculators", "prepare-data", "--model", str(model_folder()), "--data", str(final),
            "--output", str(output), "--render-endpoint", render_endpoint, "--num-preprocessing-workers", "1"]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_prepare_data_keeps_every_turn_and_masks_each_answer_with_its_end_of_turn(
    model_sandbox: SandboxProcess, tokenizer: Any, tmp_path: Path
) -> None:
    from datasets import load_from_disk

    root = model_sandbox.reference_url.removesuffix("/v1")  # speculators appends /v1/chat/completions/render
    done = prepare_data(final_file(tmp_path / "tiny.jsonl"), tmp_path / "prepared", root)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Failed to process conversation" not in done.stderr

    # What each row should be: the conversation through each assistant turn, as the
    # reference's /tokenize renders it, with that turn's content and end of turn supervised.
    expected: dict[tuple[int, ...], str] = {}
    with httpx.Client(base_url=root, timeout=30) as client:
        for row in ROWS:
            conv = row["conversations"]
            for j, turn in enumerate(conv):
                if turn["role"] == "assistant":
                    reply = client.post("/tokenize", json={"messages": conv[: j + 1], "add_generation_prompt": False})
                    assert reply.status_code == 200, reply.text
                    expected[tuple(reply.json()["tokens"])] = turn["content"] + END_OF_TURN
    assert len(expected) == 4

    prepared = load_from_disk(str(tmp_path / "prepared"))
    assert len(prepared) == len(expected)  # 0 dropped: every assistant turn is a row
    got: dict[tuple[int, ...], str] = {}
    for row in prepared:
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        start = mask.index(1)
        assert mask == [0] * start + [1] * (len(ids) - start)  # one span, through the row's end
        got[tuple(ids)] = tokenizer.decode(ids[start:])
    assert got == expected
