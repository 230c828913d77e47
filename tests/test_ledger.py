"""The request ledger (real SQLite in tmp_path) and its group-commit writer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from quanthunt.ledger import Ledger, LedgerWriter, RequestKey

HASH = "p" * 64


def key(record: str, turn: int = 0) -> RequestKey:
    return RequestKey("chat", record, turn, HASH)


def test_each_start_is_a_new_attempt_of_the_same_request(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    with ledger.transaction():
        first = ledger.op_start(key("a"), run_id="run1", reserved_usd=0.5)
        second = ledger.op_start(key("a"), run_id="run1", reserved_usd=0.25)
    assert second != first
    attempts = ledger.db.execute("SELECT id, attempt FROM attempts ORDER BY id").fetchall()
    assert attempts == [(first, 1), (second, 2)]
    assert ledger.db.execute("SELECT state, attempts, reserved_usd FROM requests").fetchall() == [("in_flight", 2, 0.25)]


def test_unwritten_record_costs_sum_every_attempt_of_records_not_yet_written(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    with ledger.transaction():
        for record, costs in {"written": [0.1], "half": [0.2, 0.3], "failed": [0.0]}.items():
            for turn, cost in enumerate(costs):
                attempt = ledger.op_start(key(record, turn), run_id="r", reserved_usd=1.0)
                ledger.op_finish(key(record, turn), attempt, state="done", outcome="ok", cost_usd=cost)
        ledger.op_records("chat", HASH, [("written", "{}", "0" * 64)])
    assert ledger.unwritten_record_costs("chat", HASH) == pytest.approx({"half": 0.5})
    assert ledger.unwritten_record_costs("chat", "q" * 64) == {}


def test_writer_commits_queued_operations_and_generation_ids_together(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")

    async def scenario() -> tuple[int, int]:
        writer = LedgerWriter(ledger, interval_s=0.001)
        writer.start()
        attempt = await writer.write(lambda: ledger.op_start(key("a"), run_id="r", reserved_usd=0.1))
        writer.note_generation_id(attempt, "gen-123")
        other = await writer.write(lambda: ledger.op_start(key("b"), run_id="r", reserved_usd=0.1))
        await writer.close()
        return attempt, other

    attempt, other = asyncio.run(scenario())
    rows = dict(ledger.db.execute("SELECT id, generation_id FROM attempts").fetchall())
    assert rows == {attempt: "gen-123", other: None}


def test_a_failing_operation_fails_its_whole_group_and_commits_none_of_it(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")

    def broken() -> None:
        ledger.db.execute("INSERT INTO no_such_table VALUES (1)")

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        writer = LedgerWriter(ledger, interval_s=0.05)
        writer.start()
        good = writer.submit(lambda: ledger.op_start(key("a"), run_id="r", reserved_usd=0.1))
        bad = writer.submit(broken)
        await asyncio.gather(good, bad, return_exceptions=True)
        await writer.close()
        return good.exception(), bad.exception()

    good_error, bad_error = asyncio.run(scenario())
    assert "no_such_table" in str(bad_error)
    assert good_error is bad_error
    assert ledger.db.execute("SELECT COUNT(*) FROM attempts").fetchone() == (0,)


def test_done_turns_are_those_of_records_not_written_yet(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    with ledger.transaction():
        for record in ("written", "half"):
            attempt = ledger.op_start(key(record), run_id="r", reserved_usd=1.0)
            ledger.op_finish(key(record), attempt, state="done", outcome="ok", cost_usd=0.1, reply={"content": record})
        ledger.op_records("chat", HASH, [("written", "{}", "0" * 64)])
    assert ledger.done_turns("chat", HASH) == {("half", 0): {"content": "half"}}
