"""Checking a generated dataset before it becomes training data, and exporting it.

``check`` flattens every record into one row, validates the rows with the
``generated_records`` schema (ids unique, roles alternating and ending with the
assistant, no empty answer, every turn served by a verified-equivalent endpoint (its
tag and provider name), costs, token limits, sampling params), then checks what a row
cannot see: the share of cut-off answers, costs against the ledger, and every line
against the sha256 the ledger recorded when generation wrote it (edited, added or
removed records are named).

What is exported is then trimmed, never rewritten:
- records a provider served after its monitor's change estimate (``suspect``) are
  quarantined: not exported, counted;
- a turn that did not finish (``finish_reason`` other than ``stop``: cut at
  ``max_tokens``, filtered) is never exported as if complete: SpecForge and
  speculators append the end-of-turn token to every assistant turn and train on it, so
  the record is cut before its first unfinished turn (or dropped if nothing is left);
- every exported row must pass SpecForge's own check of regenerated data
  (``specforge_problem``), and is written as its regeneration script writes a row.
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
from quanthunt.monitor import suspect_turn
from quanthunt.schemas import Failure

ROW_COLUMNS = (
    "line", "id", "roles_ok", "empty_assistant", "endpoints", "verdict", "cost_usd", "prompt_tokens", "completion_tokens",
    "max_turn_completion_tokens", "finish_reason", "params_sha256", "turns", "answer",
)  # fmt: skip

COMPLETE = frozenset({"stop", "eos"})
"""Finish reasons of a turn that ended where the model ended it."""

THINK_MARKERS = ("<think>", "</think>")


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
        "verdict": _verdict(turns),
        "cost_usd": float(usage.get("cost_usd", -1.0)),
        "prompt_tokens": int(usage.get("prompt_tokens", -1)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "max_turn_completion_tokens": max((int(t.get("completion_tokens", 0)) for t in turns), default=0),
        "finish_reason": _first_unfinished(turns) or "stop",
        "params_sha256": str(provenance.get("params_sha256", "")),
        "turns": len(turns),
        "answer": answers[-1] if answers else "",
    }


def _verdict(turns: Sequence[Mapping[str, Any]]) -> str:
    """``equivalent`` when every turn's endpoint was verified so, else the first other verdict."""
    verdicts = [str(t.get("verdict")) for t in turns] or ["none"]
    return next((v for v in verdicts if v != "equivalent"), "equivalent")


def _first_unfinished(turns: Sequence[Mapping[str, Any]]) -> str | None:
    return next((str(t.get("finish_reason")) for t in turns if t.get("finish_reason") not in COMPLETE), None)


def suspect_by(entry: Mapping[str, Any], suspect: Mapping[str, int]) -> str | None:
    """The stopped provider's tag if any turn of the record is suspect (``suspect_turn``), else None."""
    for turn in (entry.get("provenance") or {}).get("turns") or []:
        if isinstance(turn, dict) and suspect_turn(turn, suspect):
            return str(turn.get("endpoint_tag"))
    return None


def _normalised(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


@dataclass(frozen=True)
class Trimmed:
    """A record as exported: cut before its first unfinished turn (``None`` if no complete
    turn came before it), and what was removed."""

    record: dict[str, Any] | None
    turns_removed: int = 0
    reason: str | None = None
    """The first unfinished turn's finish reason."""
    cost_usd_removed: float = 0.0


def trim_unfinished(entry: Mapping[str, Any], *, drop: bool = False) -> Trimmed:
    """``entry`` cut before its first unfinished assistant turn, with that turn's user
    segment (``drop=True``: the record is dropped instead). Its ``provenance.turns`` keep
    the exported turns; ``usage`` stays what the record cost (it was paid for)."""
    provenance = entry["provenance"]
    turns = provenance["turns"]
    first = next((k for k, t in enumerate(turns) if t.get("finish_reason") not in COMPLETE), None)
    if first is None:
        return Trimmed(dict(entry))
    reason = str(turns[first].get("finish_reason"))
    removed = len(turns) - first
    cost = round(sum(float(t.get("cost_usd") or 0.0) for t in turns[first:]), 10)
    if first == 0 or drop:
        return Trimmed(None, len(turns), reason, round(sum(float(t.get("cost_usd") or 0.0) for t in turns), 10))
    conversation = entry["conversations"]
    assistants = [i for i, t in enumerate(conversation) if t.get("role") == "assistant"]
    kept = conversation[: assistants[first - 1] + 1]
    cut = {"turns_removed": removed, "finish_reason": reason, "cost_usd": cost}
    return Trimmed({**entry, "conversations": kept, "provenance": {**provenance, "turns": turns[:first], "cut": cut}},
                   removed, reason, cost)  # fmt: skip


def has_think_marker(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in THINK_MARKERS)


def specforge_problem(row: Mapping[str, Any], *, reasoning: bool) -> str | None:
    """Why SpecForge's check of regenerated data (``scripts/validate_regenerated_data.py``
    with ``scripts/conversation_validation.py``, sgl-project/SpecForge a6b6b02) would refuse
    ``row``, run with ``--expect-reasoning`` (``reasoning``) or ``--expect-non-reasoning
    --strict-think-markers``; None if it accepts it."""
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} must be an object"
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {index} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role != expected:
            return f"message {index} expected role {expected!r}, got {role!r}"
        saw_user, expected = True, ("assistant" if role == "user" else "user")
        if role != "assistant":
            continue
        thinking = message.get("reasoning_content")
        if thinking is not None and not isinstance(thinking, str):
            return f"assistant message {index} reasoning_content must be a string or null"
        if reasoning and not (thinking or "").strip():
            return f"assistant message {index} has empty reasoning_content"
        if not reasoning and (thinking or "").strip():
            return f"assistant message {index} has non-empty reasoning_content"
        if has_think_marker(content) or has_think_marker(thinking or ""):
            return f"assistant message {index} contains a thinking marker"
    if not saw_user:
        return "conversation has no user message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None


def requests_of(conversation: Sequence[Mapping[str, Any]]) -> list[list[dict[str, str]]]:
    """The messages sent for each assistant turn: everything before it, as generation sent
    it (earlier answers without their reasoning)."""
    return [
        [{"role": str(t["role"]), "content": str(t["content"])} for t in conversation[:i]]
        for i, turn in enumerate(conversation)
        if turn.get("role") == "assistant"
    ]


@dataclass(frozen=True)
class Fidelity:
    """How many exported turns' prompts, rendered by the reference's chat template, have the
    token count the provider billed (``usage.prompt_tokens``)."""

    turns: int
    matched: int
    records: int
    records_matched: int
    mismatches: list[str]

    @property
    def share(self) -> float:
        return self.matched / self.turns if self.turns else 0.0

    def card(self) -> dict[str, Any]:
        return {"turns": self.turns, "turns_matched": self.matched, "match_share": round(self.share, 4),
                "records": self.records, "records_matched": self.records_matched, "mismatches": self.mismatches}  # fmt: skip


def prompt_fidelity(records: Sequence[Mapping[str, Any]], rendered: Mapping[tuple[str, int], int], *, first: int = 5) -> Fidelity:
    """Compare each exported turn's billed prompt tokens with ``rendered`` ((record id, turn)
    → the reference's token count of the same messages)."""
    turns = matched = whole = 0
    mismatches: list[str] = []
    for record in records:
        all_match = True
        for k, turn in enumerate(record["provenance"]["turns"]):
            turns += 1
            billed, ours = int(turn.get("prompt_tokens") or 0), rendered.get((str(record["id"]), k))
            if ours == billed:
                matched += 1
                continue
            all_match = False
            if len(mismatches) < first:
                mismatches.append(f"{record['id']} turn {k} ({turn.get('endpoint_tag')}): billed {billed}, rendered {ours}")
        whole += all_match
    return Fidelity(turns, matched, len(records), whole, mismatches)


def check(
    lines: Sequence[str],
    *,
    max_tokens: int,
    eligible: Sequence[tuple[str, str]],
    params_sha256: str,
    ledger_lines: Mapping[str, str],
    ledger_costs: Mapping[str, float],
    max_truncated_share: float,
    reasoning: bool = False,
    drop_unfinished: bool = False,
    suspect: Mapping[str, int] | None = None,
    first: int = 5,
) -> Checked:
    """Validate a generated dataset's lines. ``eligible``: (endpoint tag, provider name) of
    each verified-equivalent endpoint; ``ledger_lines``: record id → sha256 of the line
    generation wrote; ``ledger_costs``: record id → settled spend in the ledger;
    ``max_truncated_share``: of all assistant turns, the most that may stop at
    ``max_tokens``; ``reasoning``: every answer must carry its reasoning (else none may);
    ``suspect``: endpoint tag → checkpoint from which its monitor quarantined its records.
    ``Checked.records`` holds the final rows to export (quarantined records left out,
    unfinished turns trimmed, in SpecForge's form: ``final_record``)."""
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
    finish = Counter(str(t.get("finish_reason")) for e in records for t in (e.get("provenance") or {}).get("turns") or [])
    all_turns = sum(finish.values())
    truncated = finish.get("length", 0) / all_turns if all_turns else 0.0
    if truncated > max_truncated_share + 1e-12:
        found.append(Failure("finish_reason", f"truncated_share_at_most_{max_truncated_share:g}", finish["length"],
                             [f"{truncated:.1%} of {all_turns} assistant turns stopped at max_tokens {max_tokens}"]))  # fmt: skip

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
    trimmed = [trim_unfinished(entry, drop=drop_unfinished) for entry, tag in zip(records, by, strict=True) if tag is None]
    exported = [final_record(t.record) for t in trimmed if t.record is not None]
    removed_by: Counter[str] = Counter()
    for t in trimmed:
        if t.reason is not None:
            removed_by[t.reason] += t.turns_removed
    refused = [f"{row['id']}: {problem}" for row in exported if (problem := specforge_problem(row, reasoning=reasoning))]
    if refused:
        found.append(Failure("conversations", "accepted_by_specforge_validator", len(refused), refused[:first]))
    answers = [_normalised(r["answer"]) for r in rows]
    seen = Counter(answers)
    duplicates = sum(c for a, c in seen.items() if a and c > 1)
    lengths = [len(r["answer"]) for r in rows]
    metrics = {
        "records": len(exported),
        "records_generated": n,
        "records_quarantined": sum(quarantined.values()),
        "quarantined_by_provider": dict(quarantined),
        "records_cut": sum(1 for t in trimmed if t.record is not None and t.turns_removed),
        "records_dropped": sum(1 for t in trimmed if t.record is None),
        "turns_removed": sum(t.turns_removed for t in trimmed),
        "turns_removed_by_reason": dict(removed_by),
        "cost_usd_removed": round(sum(t.cost_usd_removed for t in trimmed), 10),
        "turns": all_turns,
        "turns_exported": sum(len(r["provenance"]["turns"]) for r in exported),
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
    """The row SpecForge's regeneration script (``scripts/regenerate_train_data.py``) writes
    for the same conversation: ``id``, ``conversations`` [{role, content,
    reasoning_content?}] and ``status: "success"``; our provenance rides along under
    ``provenance`` (SpecForge's loader reads ``conversations`` and drops other columns)."""
    conversation = []
    for turn in entry["conversations"]:
        kept = {"role": turn["role"], "content": turn["content"]}
        if turn.get("reasoning_content"):
            kept["reasoning_content"] = turn["reasoning_content"]
        conversation.append(kept)
    return {
        "id": entry["id"],
        "conversations": conversation,
        "status": "success",
        "provenance": {"dataset": entry.get("dataset"), **entry["provenance"]},
    }
