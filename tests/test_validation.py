"""The validator's pure core: a turn counts as verified only for the endpoint that was;
records a stopped provider served from its suspect checkpoint on are not exported; an
unfinished turn is never exported as complete; every exported row passes SpecForge's own
check of regenerated data; prompt fidelity compares rendered and billed prompt tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from quanthunt.validation import check, final_record, prompt_fidelity, requests_of, specforge_problem, trim_unfinished

HASH = "h" * 64


def turn_of(tag: str, provider: str, finish: str = "stop", monitor: dict[str, object] | None = None) -> dict[str, Any]:
    return {"provider": provider, "endpoint_tag": tag, "declared_quantization": "int4", "verdict": "equivalent",
            "verification_run_id": "run-v", "verdict_run_id": "run-p", "generation_id": "gen-1", "finish_reason": finish,
            "prompt_tokens": 5, "completion_tokens": 3, "cost_usd": 0.01, "attempts": 1, "monitor": monitor}  # fmt: skip


def entry(record_id: str, turns: list[dict[str, Any]], *, system: bool = False) -> dict[str, Any]:
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}] if system else []
    for k in range(len(turns)):
        conversation += [
            {"role": "user", "content": f"question {k}"},
            {"role": "assistant", "content": f"answer {record_id} {k}"},
        ]
    cost = round(sum(t["cost_usd"] for t in turns), 10)
    provenance = {"providers": [], "usage": {"prompt_tokens": 5 * len(turns), "completion_tokens": 3 * len(turns),
                  "cost_usd": cost}, "params_sha256": HASH, "turns": turns}  # fmt: skip
    return {"id": record_id, "conversations": conversation, "provenance": provenance}


def line(record_id: str, tag: str, provider: str, monitor: dict[str, object] | None = None) -> str:
    return json.dumps(entry(record_id, [turn_of(tag, provider, monitor=monitor)]))


def test_a_turn_is_checked_against_the_endpoint_not_only_the_provider_name() -> None:
    # DeepInfra's bf16 endpoint was verified; its fp4 endpoint (same provider name) was not.
    lines = [line("ok", "deepinfra/bf16", "DeepInfra"), line("sibling", "deepinfra/fp4", "DeepInfra"),
             line("renamed", "deepinfra/bf16", "Chutes")]  # fmt: skip
    costs = {r: 0.01 for r in ("ok", "sibling", "renamed")}
    checked = check(lines, max_tokens=16, eligible=[("deepinfra/bf16", "DeepInfra")], params_sha256=HASH,
                    ledger_lines={}, ledger_costs=costs, max_truncated_share=1.0)  # fmt: skip
    served = next(f for f in checked.failures if f.check == "served_by_verified_equivalent_provider")
    assert sorted(e.split(":")[0] for e in served.examples) == ["renamed", "sibling"]
    assert checked.metrics["endpoints"] == {"deepinfra/bf16": 2, "deepinfra/fp4": 1}


def test_records_from_a_stopped_provider_since_its_suspect_checkpoint_are_quarantined() -> None:
    eligible = [("a/int4", "A"), ("b/int4", "B")]
    lines = [
        line("b-before", "b/int4", "B", {"e_value": 0.2, "checkpoint": 2}),
        line("b-at", "b/int4", "B", {"e_value": 0.3, "checkpoint": 3}),
        line("b-after", "b/int4", "B", {"e_value": 9.0, "checkpoint": 5}),
        line("b-unstamped", "b/int4", "B"),  # written before monitoring: counted as after, to be safe
        line("a-late", "a/int4", "A", {"e_value": 0.1, "checkpoint": 9}),
    ]
    costs = dict.fromkeys(("b-before", "b-at", "b-after", "b-unstamped", "a-late"), 0.01)
    checked = check(lines, max_tokens=16, eligible=eligible, params_sha256=HASH, ledger_lines={}, ledger_costs=costs,
                    max_truncated_share=1.0, suspect={"b/int4": 3})  # fmt: skip
    assert [r["id"] for r in checked.records] == ["b-before", "a-late"]
    assert all(r["status"] == "success" for r in checked.records)
    assert checked.metrics["records"] == 2 and checked.metrics["records_generated"] == 5
    assert checked.metrics["records_quarantined"] == 3
    assert checked.metrics["quarantined_by_provider"] == {"b/int4": 3}


def test_a_record_is_cut_before_its_first_unfinished_turn_or_dropped() -> None:
    a = "a/int4", "A"
    whole = entry("whole", [turn_of(*a), turn_of(*a)])
    cut = entry("cut", [turn_of(*a), turn_of(*a, finish="length"), turn_of(*a)], system=True)
    dropped = entry("dropped", [turn_of(*a, finish="length"), turn_of(*a)])
    assert trim_unfinished(whole).record == whole and trim_unfinished(whole).turns_removed == 0
    trimmed = trim_unfinished(cut)
    assert trimmed.record is not None and (trimmed.turns_removed, trimmed.reason) == (2, "length")
    assert [t["role"] for t in trimmed.record["conversations"]] == ["system", "user", "assistant"]
    assert trimmed.record["conversations"][-1]["content"] == "answer cut 0"
    assert len(trimmed.record["provenance"]["turns"]) == 1
    assert trimmed.record["provenance"]["cut"] == {"turns_removed": 2, "finish_reason": "length", "cost_usd": 0.02}
    assert trimmed.record["provenance"]["usage"] == cut["provenance"]["usage"]  # what the record cost stays
    assert trim_unfinished(dropped).record is None and trim_unfinished(dropped).turns_removed == 2
    assert trim_unfinished(cut, drop=True).record is None


def test_the_truncated_share_counts_turns_and_fails_the_dataset_beyond_the_limit() -> None:
    a = "a/int4", "A"
    records = [entry(f"r{i}", [turn_of(*a), turn_of(*a, finish="length" if i < 2 else "stop")]) for i in range(10)]
    lines = [json.dumps(r) for r in records]
    costs = {r["id"]: 0.02 for r in records}
    kwargs: dict[str, Any] = {"max_tokens": 16, "eligible": [a], "params_sha256": HASH, "ledger_lines": {}, "ledger_costs": costs}
    passed = check(lines, max_truncated_share=0.1, **kwargs)  # 2 of 20 turns
    assert not [f for f in passed.failures if f.column == "finish_reason"]
    assert passed.metrics["truncated_share"] == 0.1 and passed.metrics["records_cut"] == 2
    assert passed.metrics["turns_removed_by_reason"] == {"length": 2} and passed.metrics["turns_exported"] == 18
    assert all(t["finish_reason"] == "stop" for r in passed.records for t in r["provenance"]["turns"])
    failed = check(lines, max_truncated_share=0.05, **kwargs)
    (share,) = [f for f in failed.failures if f.column == "finish_reason"]
    assert share.check == "truncated_share_at_most_0.05" and share.count == 2


def specforge_row(**changes: Any) -> dict[str, Any]:
    row = final_record(entry("r", [turn_of("a/int4", "A")], system=True))
    return {**row, **changes}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"status": None}, "status must be 'success'"),
        ({"id": " "}, "id must be a non-empty string"),
        ({"conversations": []}, "conversations must be a non-empty list"),
        ({"conversations": [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a"}]}, "message 0 content must be a non-empty string"),
        ({"conversations": [{"role": "user", "content": "q"}]}, "conversation must end with an assistant message"),
        ({"conversations": [{"role": "assistant", "content": "a"}]}, "message 0 expected role 'user', got 'assistant'"),
        ({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a"}]},
         "assistant message 1 contains a thinking marker"),
        ({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]},
         "assistant message 1 has non-empty reasoning_content"),
    ],
)  # fmt: skip
def test_rows_specforge_would_refuse_are_named(change: dict[str, Any], problem: str) -> None:
    assert specforge_problem(specforge_row(), reasoning=False) is None
    assert specforge_problem(specforge_row(**change), reasoning=False) == problem


def test_a_reasoning_run_needs_reasoning_on_every_answer() -> None:
    thought = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "because"}]
    assert specforge_problem(specforge_row(conversations=thought), reasoning=True) is None
    assert specforge_problem(specforge_row(), reasoning=True) == "assistant message 2 has empty reasoning_content"


def test_prompt_fidelity_compares_each_exported_turn_with_what_was_billed() -> None:
    rows = [final_record(entry(f"r{i}", [turn_of("a/int4", "A"), turn_of("a/int4", "A")])) for i in range(3)]
    sent = requests_of(rows[0]["conversations"])
    assert [[m["role"] for m in messages] for messages in sent] == [["user"], ["user", "assistant", "user"]]
    rendered = {(f"r{i}", k): 5 for i in range(3) for k in range(2)} | {("r1", 1): 6}
    fidelity = prompt_fidelity(rows, rendered)
    assert (fidelity.turns, fidelity.matched, fidelity.records, fidelity.records_matched) == (6, 5, 3, 2)
    assert fidelity.mismatches == ["r1 turn 1 (a/int4): billed 5, rendered 6"]
