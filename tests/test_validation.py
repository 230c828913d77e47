"""The validator's pure core: a turn counts as verified only for the endpoint that was, and
records a stopped provider served from its suspect checkpoint on are not exported."""

from __future__ import annotations

import json

from quanthunt.validation import check

HASH = "h" * 64


def line(record_id: str, tag: str, provider: str, monitor: dict[str, object] | None = None) -> str:
    turn = {"provider": provider, "endpoint_tag": tag, "generation_id": "gen-1", "finish_reason": "stop",
            "prompt_tokens": 5, "completion_tokens": 3, "cost_usd": 0.01, "attempts": 1, "monitor": monitor}  # fmt: skip
    provenance = {"provider": provider, "endpoint_tag": tag, "verdict": "equivalent", "finish_reason": "stop",
                  "usage": {"prompt_tokens": 5, "completion_tokens": 3, "cost_usd": 0.01}, "params_sha256": HASH,
                  "turns": [turn]}  # fmt: skip
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"answer {record_id}"}]
    return json.dumps({"id": record_id, "conversations": conversation, "provenance": provenance})


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
    assert checked.metrics["records"] == 2 and checked.metrics["records_generated"] == 5
    assert checked.metrics["records_quarantined"] == 3
    assert checked.metrics["quarantined_by_provider"] == {"b/int4": 3}
