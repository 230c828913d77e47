"""Building SpecForge's EAGLE-3 training prompts from a final file with SpecForge's own data
code (``specforge`` on PyPI, installed without its GPU dependencies by ``make install``),
and checking what it would train on: every row kept, and every assistant turn's loss mask
covering exactly the turn's content plus the end-of-turn marker.

``python tests/consumers/specforge_check.py data/final/chat.jsonl [...]`` checks files of a
run with the template their cards name (the model's tokenizer: the sandbox's SmolLM2).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quanthunt.templates import ChatTemplate


@dataclass(frozen=True)
class Built:
    """What SpecForge made of a file: rows in and out, and each row's masked spans as text."""

    rows: int
    prompts: int
    spans: Counter[tuple[str, ...]]
    expected: Counter[tuple[str, ...]]

    @property
    def ok(self) -> bool:
        return self.rows == self.prompts and self.spans == self.expected


def masked_spans(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> tuple[str, ...]:
    spans, current = [], []
    for token, mask in zip(input_ids, loss_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return tuple(spans)


def build(final: Path, template: ChatTemplate, tokenizer: Any, *, name: str) -> Built:
    """SpecForge's ``prepare_prompt_tasks`` (what its online trainer calls on ``data.train_data_path``)
    over ``final``, with ``template`` registered as ``name``."""
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.data.template import TEMPLATE_REGISTRY
    from specforge.data.template import ChatTemplate as SpecForgeTemplate

    fields = {k: getattr(template, k) for k in ("system_prompt", "user_header", "assistant_header", "end_of_turn_token")}
    TEMPLATE_REGISTRY.register(name=name, template=SpecForgeTemplate(**fields), override=True)
    tasks = prepare_prompt_tasks(final, tokenizer, chat_template=name, max_length=8192, is_preformatted=False,
                                 train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=1)  # fmt: skip
    rows = [json.loads(line) for line in final.read_text(encoding="utf-8").splitlines()]
    expected = Counter(
        tuple(t["content"] + template.end_of_turn_token for t in r["conversations"] if t["role"] == "assistant") for r in rows
    )
    spans = Counter(masked_spans(tokenizer, t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks)
    return Built(len(rows), len(tasks), spans, expected)


def billed_matches(final: Path, tokenizer: Any, system_prompt: str | None) -> tuple[int, int]:
    """(turns, turns whose request renders to the billed prompt tokens) when a conversation
    without a system message gets ``system_prompt``, as SpecForge's parser inserts it."""
    from quanthunt.validation import requests_of

    turns = matched = 0
    for line in final.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for sent, turn in zip(requests_of(row["conversations"]), row["provenance"]["turns"], strict=True):
            inserted = [{"role": "system", "content": system_prompt}] if system_prompt and sent[0]["role"] != "system" else []
            ids = tokenizer.apply_chat_template(inserted + sent, add_generation_prompt=True, return_dict=True)["input_ids"]
            turns += 1
            matched += len(ids) == turn["prompt_tokens"]
    return turns, matched


def main(paths: list[str]) -> int:
    from transformers import AutoTokenizer

    from quanthunt.sandbox.model import model_folder

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder()), local_files_only=True)
    failed = 0
    for path in map(Path, paths):
        card = json.loads(path.with_suffix(".card.json").read_text())["prompts"]
        fields = card["chat_template"]
        template = ChatTemplate(fields["system_prompt"], fields["user_header"], fields["assistant_header"],
                                fields["end_of_turn_token"])  # fmt: skip
        built = build(path, template, tokenizer, name=fields["name"])
        turns = sum(len(k) * n for k, n in built.spans.items())
        masks = "every mask = content + end of turn" if built.ok else "MISMATCH"
        print(f"{path}: {built.rows} rows, {built.prompts} training prompts, {turns} assistant turns masked, "
              f"{masks}; prompts match {card['match_share']:.0%}")  # fmt: skip
        from specforge.data.template import TEMPLATE_REGISTRY

        for name in ("qwen", fields["name"]):
            total, matched = billed_matches(path, tokenizer, TEMPLATE_REGISTRY.get(name).system_prompt)
            print(f"  rendered with SpecForge's {name} template: {matched} of {total} turns have the billed prompt tokens")
        failed += not built.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
