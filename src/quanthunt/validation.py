"""Checking a generated dataset before it becomes training data, and exporting it.

``check`` flattens every record into one row, validates the rows with the
``generated_records`` schema (ids unique, roles alternating and ending with the
assistant, no empty answer, every turn served by a verified-equivalent endpoint (its
tag and provider name),
costs, token limits, sampling params), then checks what a row cannot see: the share
of truncated answers, costs against the ledger, and every line against the sha256 the
ledger recorded when generation wrote it (edited, added or removed records are named).
Records a provider served after its monitor's change estimate (``suspect``) pass the
checks like any other line of the file but are quarantined: not exported, counted.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quanthunt import schemas
from quanthunt.schemas import Failure

ROW_COLUMNS = (
    "line", "id", "roles_ok", "empty_assistant", "endpoints", "verdict", "cost_usd", "prompt_tokens", "completion_tokens",
    "max_turn_completion_tokens", "finish_reason", "params_sha256", "turns", "answer",
)  # fmt: skip


@dataclass
class Checked:
    """What ``check`` found: failures (empty when the dataset passes), metrics, and the
    parsed records in file order."""

    failures: list[Failure]
    metrics: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def roles_in_order(conversation: Sequence[Mapping[str, Any]]) -> bool:
    """System turns first, then user and assistant alternating, ending with the assistant."""
    roles = [str(t.get("role")) for t in conversation]
    while roles and roles[0] == "system":
        roles.pop(0)
    if not roles or roles[-1] != "assistant":
        return False
    return all(role == ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles))


def _row(line: int, entry: Mapping[str, Any]) -> dict[str, Any]:
    provenance = entry.get("provenance") or {}
    conversation = entry.get("conversations") or []
    turns = provenance.get("turns") or []
    usage = provenance.get("usage") or {}
    answers = [str(t.get("content") or "") for t in conversation if t.get("role") == "assistant"]
    return {
        "line": line,
        "id": str(entry.get("id", "")),
        "roles_ok": roles_in_order(conversation),
        "empty_assistant": any(not a.strip() for a in answers),
        "endpoints": sorted({(str(t.get("endpoint_tag")), str(t.get("provider"))) for t in turns}),
        "verdict": str(provenance.get("verdict", "")),
        "cost_usd": float(usage.get("cost_usd", -1.0)),
        "prompt_tokens": int(usage.get("prompt_tokens", -1)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "max_turn_completion_tokens": max((int(t.get("completion_tokens", 0)) for t in turns), default=0),
        "finish_reason": str(provenance.get("finish_reason", "")),
        "params_sha256": str(provenance.get("params_sha256", "")),
        "turns": len(turns),
        "answer": answers[-1] if answers else "",
    }


def suspect_by(entry: Mapping[str, Any], suspect: Mapping[str, int]) -> str | None:
    """The stopped provider's tag if any turn came from it at or after its first suspect
    checkpoint (``suspect``: tag → checkpoint; a turn without a monitor stamp counts as
    after), else None."""
    for turn in (entry.get("provenance") or {}).get("turns") or []:
        if not isinstance(turn, dict):
            continue
        tag = str(turn.get("endpoint_tag"))
        start = suspect.get(tag)
        if start is not None and int((turn.get("monitor") or {}).get("checkpoint", start)) >= start:
            return tag
    return None


def _normalised(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def check(
    lines: Sequence[str],
    *,
    max_tokens: int,
    eligible: Sequence[tuple[str, str]],
    params_sha256: str,
    ledger_lines: Mapping[str, str],
    ledger_costs: Mapping[str, float],
    max_truncated_share: float,
    suspect: Mapping[str, int] | None = None,
    first: int = 5,
) -> Checked:
    """Validate a generated dataset's lines. ``eligible``: (endpoint tag, provider name) of
    each verified-equivalent endpoint; ``ledger_lines``: record id → sha256 of the line
    generation wrote; ``ledger_costs``: record id → settled spend in the ledger;
    ``suspect``: endpoint tag → checkpoint from which its monitor quarantined its records.
    ``Checked.records`` holds the records to export (quarantined ones left out)."""
    found: list[Failure] = []
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    unreadable: list[str] = []
    for number, raw in enumerate(lines, start=1):
        try:
            entry = json.loads(raw)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            unreadable.append(f"line {number}: {str(exc)[:60]}")
            continue
        records.append(entry)
        rows.append(_row(number, entry))
    if unreadable:
        found.append(Failure("(line)", "is_a_json_record", len(unreadable), unreadable[:first]))
    table = schemas.frame(rows, ROW_COLUMNS)
    schema = schemas.generated_records(max_tokens=max_tokens, eligible=eligible, params_sha256=params_sha256)
    found += schemas.failures(schema, table, id_column="id", first=first)

    n = len(rows)
    finish = Counter(r["finish_reason"] for r in rows)
    truncated = finish.get("length", 0) / n if n else 0.0
    if truncated > max_truncated_share + 1e-12:
        found.append(Failure("finish_reason", f"truncated_share_at_most_{max_truncated_share:g}", finish["length"],
                             [f"{truncated:.1%} of records stopped at max_tokens"]))  # fmt: skip

    mismatched = [f"{r['id']}: file ${r['cost_usd']:.8f}, ledger ${ledger_costs.get(r['id'], 0.0):.8f}"
                  for r in rows if abs(r["cost_usd"] - ledger_costs.get(r["id"], 0.0)) > 1e-9]  # fmt: skip
    if mismatched:
        found.append(Failure("cost_usd", "equals_ledger_settled_spend", len(mismatched), mismatched[:first]))
    total_file = sum(r["cost_usd"] for r in rows)
    total_ledger = sum(ledger_costs.get(r["id"], 0.0) for r in rows)

    hashes = {r["id"]: hashlib.sha256(lines[r["line"] - 1].encode()).hexdigest() for r in rows}
    edited = sorted(i for i, sha in hashes.items() if i in ledger_lines and ledger_lines[i] != sha)
    added = sorted(i for i in hashes if i not in ledger_lines)
    removed = sorted(i for i in ledger_lines if i not in hashes)
    for name, ids in (
        ("edited_after_generation", edited),
        ("added_after_generation", added),
        ("removed_after_generation", removed),
    ):
        if ids:
            found.append(Failure("line_sha256", name, len(ids), ids[:first]))

    by = [suspect_by(entry, suspect or {}) for entry in records]
    quarantined = Counter(tag for tag in by if tag is not None)
    exported = [entry for entry, tag in zip(records, by, strict=True) if tag is None]
    answers = [_normalised(r["answer"]) for r in rows]
    seen = Counter(answers)
    duplicates = sum(c for a, c in seen.items() if a and c > 1)
    lengths = [len(r["answer"]) for r in rows]
    metrics = {
        "records": len(exported),
        "records_generated": n,
        "records_quarantined": sum(quarantined.values()),
        "quarantined_by_provider": dict(quarantined),
        "turns": sum(r["turns"] for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "cost_usd": round(total_file, 10),
        "ledger_cost_usd": round(total_ledger, 10),
        "endpoints": dict(Counter(tag for r in rows for tag, _ in r["endpoints"])),
        "finish_reasons": dict(finish),
        "truncated_share": round(truncated, 4),
        "near_duplicate_share": round(duplicates / n, 4) if n else 0.0,
        "mean_answer_chars": round(statistics.fmean(lengths), 1) if lengths else 0.0,
        "failed_checks": len(found),
    }
    return Checked(found, metrics, exported)


def final_record(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The SpecForge / EAGLE-3 line: ``id``, ``conversations`` [{role, content,
    reasoning_content?}], with the provenance kept under ``provenance`` (SpecForge reads
    ``conversations`` and drops the other columns)."""
    conversation = []
    for turn in entry["conversations"]:
        kept = {"role": turn["role"], "content": turn["content"]}
        if turn.get("reasoning_content"):
            kept["reasoning_content"] = turn["reasoning_content"]
        conversation.append(kept)
    return {
        "id": entry["id"],
        "conversations": conversation,
        "provenance": {"dataset": entry.get("dataset"), **entry["provenance"]},
    }
