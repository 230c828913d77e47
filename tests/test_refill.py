"""Which records are made again when a provider is found bad after it served them, and
how they are set aside: every line kept, the turns before the first bad one reused, and
the same records found again after a run that died halfway (real SQLite in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quanthunt.ledger import FinishAttempt, RequestKey, StartAttempt, WriteRecords, open_ledger
from quanthunt.records import sha256_line
from quanthunt.refill import Replacement, describe, set_aside, to_replace

HASH = "h" * 64


def line(record_id: str, *turns: tuple[str, int | None]) -> str:
    """A generated record's line with one provenance turn per (endpoint tag, monitor checkpoint)."""
    provenance = [{"endpoint_tag": tag, **({"monitor": {"checkpoint": c}} if c is not None else {})} for tag, c in turns]
    return json.dumps({"id": record_id, "provenance": {"turns": provenance}})


def test_a_record_is_made_again_from_its_first_turn_a_bad_or_suspect_provider_served() -> None:
    lines = [
        line("a", ("alpha/int4", 0), ("beta/int4", 0)),  # beta re-verified different: from turn 1
        line("b", ("alpha/int4", 0)),
        line("c", ("gamma/int4", 2), ("gamma/int4", 3)),  # gamma stopped, suspect from checkpoint 3: turn 1
        line("d", ("gamma/int4", 1)),  # before the suspect checkpoint: kept
        line("e", ("gamma/int4", None)),  # no monitor stamp: counts as after
        json.dumps({"id": "f", "provenance": {"turns": ["not a turn"]}}),  # a hand-edited line: nothing to make again
    ]
    found = to_replace(lines, bad={"beta/int4": "beta/int4 is verified different"}, suspect={"gamma/int4": 3})
    assert [(r.record_id, r.from_turn, r.tag) for r in found] == [("a", 1, "beta/int4"), ("c", 1, "gamma/int4"),
                                                                   ("e", 0, "gamma/int4")]  # fmt: skip
    assert found[0].why == "beta/int4 is verified different" and found[0].line == lines[0]
    assert "stopped by its monitor: its replies from checkpoint 3 on are suspect" in found[1].why
    assert describe(found) == "3 records (beta/int4 ×1, gamma/int4 ×2)"


def test_set_aside_keeps_every_line_once_and_rewrites_the_working_file_without_them(tmp_path: Path) -> None:
    ledger = open_ledger("sqlite:///state/ledger.sqlite", tmp_path)
    working, aside = tmp_path / "tiny-h.jsonl", tmp_path / "replaced" / "tiny-h.jsonl"
    lines = [line("a", ("alpha/int4", 0), ("beta/int4", 0)), line("b", ("alpha/int4", 0))]
    working.write_text("".join(text + "\n" for text in lines))
    for turn in (0, 1):
        key = RequestKey("tiny", "a", turn, HASH)
        attempt = ledger.write(StartAttempt(key, "run", 0.1))
        ledger.write(FinishAttempt(key, attempt, state="done", outcome="ok", cost_usd=0.01, reply='{"content": "x"}'))
    ledger.write(WriteRecords("tiny", HASH, [(json.loads(t)["id"], t, sha256_line(t)) for t in lines]))
    (replacement,) = to_replace(lines, bad={"beta/int4": "bad"}, suspect={})
    try:
        for _ in range(2):  # the second time: a run that died after setting them aside finds them again
            set_aside(ledger, working, aside, dataset="tiny", params_hash=HASH, replacements=[replacement])
            assert working.read_text().splitlines() == [lines[1]]
            assert aside.read_text().splitlines() == [lines[0]]
            assert [(r, text, turn) for r, text, turn, _, _ in ledger.replaced("tiny", HASH)] == [("a", lines[0], 1)]
            assert set(ledger.done_records("tiny", HASH)) == {"b"}
            assert set(ledger.done_turns("tiny", HASH)) == {("a", 0)}  # turn 0 (alpha's) is reused
        set_aside(ledger, working, aside, dataset="tiny", params_hash=HASH, replacements=[])  # nothing: nothing touched
        assert working.read_text().splitlines() == [lines[1]]
    finally:
        ledger.close()


def test_nothing_is_made_again_when_every_provider_is_still_trusted() -> None:
    lines = [line("a", ("alpha/int4", 5))]
    assert to_replace(lines, bad={}, suspect={"alpha/int4": 6}) == []
    replacement: Any = Replacement("a", 0, "alpha/int4", "why", lines[0])
    assert describe([replacement]) == "1 record (alpha/int4 ×1)"
