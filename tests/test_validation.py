"""The validator's pure core: a turn counts as verified only for the endpoint that was."""

from __future__ import annotations

import json

from quanthunt.validation import check

HASH = "h" * 64


def line(record_id: str, tag: str, provider: str) -> str:
    turn = {"provider": provider, "endpoint_tag": tag, "generation_id": "gen-1", "finish_reason": "stop",
            "prompt_tokens": 5, "completion_tokens": 3, "cost_usd": 0.01, "attempts": 1}  # fmt: skip
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
