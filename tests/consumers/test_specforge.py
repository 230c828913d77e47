"""SpecForge, the consumer of our final files, reads them with its own code: its EAGLE-3
data builder keeps every row and masks exactly each answer plus its end-of-turn marker,
with the template the card names. A cut record (its unfinished turn removed) and a
conversation with its own system message are among the rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.generation import GenerationBed
from fixtures.sandbox import reference_chat_template
from specforge_check import build

from quanthunt.sandbox.server import SandboxProcess
from quanthunt.validation import check

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from quanthunt.sandbox.model import model_folder

    return AutoTokenizer.from_pretrained(str(model_folder()), local_files_only=True)


def test_the_validate_stages_final_file_is_built_whole(
    generation_bed: Callable[..., GenerationBed], model_sandbox: SandboxProcess, tokenizer: Any
) -> None:
    bed = generation_bed(records=12)
    assert bed.generate().returncode == 0
    done = bed.project.run("validate", "tiny", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    built = build(bed.project.root / "data/final/tiny.jsonl", reference_chat_template(model_sandbox), tokenizer, name="qh-stage")
    assert built.rows == built.prompts == 12  # 0 rows dropped
    assert built.spans == built.expected and sum(built.spans.values()) == 12


def test_cut_records_and_own_system_messages_are_built_as_exported(
    generation_bed: Callable[..., GenerationBed], model_sandbox: SandboxProcess, tokenizer: Any, tmp_path: Path
) -> None:
    bed = generation_bed(records=6)
    assert bed.generate().returncode == 0
    records = [json.loads(line) for line in bed.output.read_text().splitlines()]
    long = next(r for r in records if len(r["provenance"]["turns"]) >= 2)
    long["provenance"]["turns"][1]["finish_reason"] = "length"  # its second answer was cut at max_tokens
    other = next(r for r in records if r is not long)
    other["conversations"].insert(0, {"role": "system", "content": "Answer in French."})
    lines = [json.dumps(r) for r in records]
    tags = {(t["endpoint_tag"], t["provider"]) for r in records for t in r["provenance"]["turns"]}
    checked = check(lines, max_tokens=10_000, eligible=sorted(tags), params_sha256=records[0]["provenance"]["params_sha256"],
                    ledger_lines={}, ledger_costs={r["id"]: r["provenance"]["usage"]["cost_usd"] for r in records},
                    max_truncated_share=1.0)  # fmt: skip
    cut = next(r for r in checked.records if r["id"] == long["id"])
    assert [t["role"] for t in cut["conversations"]] == ["user", "assistant"]
    turns = sum(len(r["provenance"]["turns"]) for r in records) - (len(long["provenance"]["turns"]) - 1)
    final = tmp_path / "final.jsonl"
    final.write_text("".join(json.dumps(r) + "\n" for r in checked.records))
    built = build(final, reference_chat_template(model_sandbox), tokenizer, name="qh-cut")
    assert built.rows == built.prompts == 6 and built.spans == built.expected
    assert sum(len(spans) * n for spans, n in built.spans.items()) == turns
