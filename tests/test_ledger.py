"""The request ledger and its group-commit writer: one suite, run on both backends (real
SQLite in tmp_path, a real PostgreSQL server started by the suite)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quanthunt.errors import ConfigError
from quanthunt.ledger import (
    URL_VARIABLE,
    FinishAttempt,
    Ledger,
    LedgerWriter,
    NoteGenerationIds,
    ReplaceRecords,
    RequestKey,
    SaveMonitor,
    SaveProbeReply,
    StartAttempt,
    WriteRecords,
    open_ledger,
)
from quanthunt.ledger_sqlite import SqliteLedger

HASH = "p" * 64


def key(record: str, turn: int = 0) -> RequestKey:
    return RequestKey("chat", record, turn, HASH)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    """The same tests on each backend, opened as the stages open it (``open_ledger``)."""
    if request.param == "sqlite":
        url = "sqlite:///state/ledger.sqlite"
    else:
        monkeypatch.setenv(URL_VARIABLE, request.getfixturevalue("postgres_url"))
        url = "sqlite:///unused.sqlite"
    opened = open_ledger(url, tmp_path)
    yield opened
    opened.close()


def finish(k: RequestKey, attempt: int, cost: float, **fields: object) -> FinishAttempt:
    return FinishAttempt(k, attempt, state="done", outcome="ok", cost_usd=cost, **fields)  # type: ignore[arg-type]


def test_each_start_is_a_new_attempt_of_the_same_request(ledger: Ledger) -> None:
    first, second = ledger.commit([StartAttempt(key("a"), "run1", 0.5), StartAttempt(key("b"), "run1", 0.5)])
    third = ledger.write(StartAttempt(key("a"), "run1", 0.25))
    assert len({first, second, third}) == 3
    assert ledger.query("SELECT id, attempt FROM attempts WHERE record_id='a' ORDER BY id") == [(first, 1), (third, 2)]
    assert ledger.query("SELECT state, attempts, reserved_usd FROM requests WHERE record_id='a'") == [("in_flight", 2, 0.25)]


def test_unwritten_record_costs_sum_every_attempt_of_records_not_yet_written(ledger: Ledger) -> None:
    for record, costs in {"written": [0.1], "half": [0.2, 0.3], "failed": [0.0]}.items():
        for turn, cost in enumerate(costs):
            attempt = ledger.write(StartAttempt(key(record, turn), "r", 1.0))
            ledger.write(finish(key(record, turn), attempt, cost))
    ledger.write(WriteRecords("chat", HASH, [("written", "{}", "0" * 64)]))
    assert ledger.unwritten_record_costs("chat", HASH) == pytest.approx({"half": 0.5})
    assert ledger.unwritten_record_costs("chat", "q" * 64) == {}
    assert ledger.record_costs("chat", HASH) == pytest.approx({"written": 0.1, "half": 0.5, "failed": 0.0})
    assert ledger.spend(dataset="chat").settled_usd == pytest.approx(0.6)


def test_writer_commits_queued_operations_and_generation_ids_together(ledger: Ledger) -> None:
    async def scenario() -> tuple[int, int]:
        writer = LedgerWriter(ledger, interval_s=0.001)
        writer.start()
        attempt = await writer.write(StartAttempt(key("a"), "r", 0.1))
        writer.note_generation_id(attempt, "gen-123")
        other = await writer.write(StartAttempt(key("b"), "r", 0.1))
        await writer.close()
        return attempt, other

    attempt, other = asyncio.run(scenario())
    assert dict(ledger.query("SELECT id, generation_id FROM attempts")) == {attempt: "gen-123", other: None}


def test_a_failing_operation_fails_its_whole_group_and_commits_none_of_it(ledger: Ledger) -> None:
    started = ledger.write(StartAttempt(key("a"), "r", 0.1))

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        writer = LedgerWriter(ledger, interval_s=0.05)
        writer.start()
        good = writer.submit(StartAttempt(key("b"), "r", 0.1))
        bad = writer.submit(FinishAttempt(key("a"), started, state="no such state", outcome="ok", cost_usd=0.0))
        await asyncio.gather(good, bad, return_exceptions=True)
        await writer.close()
        return good.exception(), bad.exception()

    good_error, bad_error = asyncio.run(scenario())
    assert "check" in str(bad_error).lower()
    assert good_error is bad_error
    assert ledger.query("SELECT record_id, state FROM requests") == [("a", "in_flight")]


def test_done_turns_are_those_of_records_not_written_yet(ledger: Ledger) -> None:
    for record in ("written", "half"):
        attempt = ledger.write(StartAttempt(key(record), "r", 1.0))
        ledger.write(finish(key(record), attempt, 0.1, reply={"content": record}, completion_tokens=7))
    ledger.write(WriteRecords("chat", HASH, [("written", "{}", "0" * 64)]))
    assert ledger.done_turns("chat", HASH) == {("half", 0): {"content": "half"}}
    assert ledger.done_records("chat", HASH) == {"written": ("0" * 64, "{}")}
    assert ledger.output_tokens("chat", HASH) == 14


def test_recovery_makes_in_flight_requests_unknown_until_reconciled(ledger: Ledger) -> None:
    lost = ledger.write(StartAttempt(key("lost"), "dead-run", 0.5))
    ledger.write(StartAttempt(key("other", 1), "dead-run", 0.25))
    ledger.commit([StartAttempt(RequestKey("elsewhere", "x", 0, HASH), "dead-run", 1.0)])
    ledger.write(NoteGenerationIds([(lost, "gen-lost")]))
    assert ledger.recover("chat") == 2
    assert ledger.state_counts("chat") == {"unknown_outcome": 2}
    assert ledger.state_counts("elsewhere") == {"in_flight": 1}
    assert ledger.spend(dataset="chat").unknown_usd == pytest.approx(0.75)
    assert ledger.unknown_with_generation_id("chat") == [(lost, "gen-lost")]
    ledger.reconcile(lost, 0.125)
    spend = ledger.spend(dataset="chat")
    assert (spend.settled_usd, spend.unknown_usd, spend.unknown_attempts) == (0.125, 0.25, 1)
    assert ledger.unwritten_attempts("chat", HASH) == {("lost", 0): {"billed": 1}, ("other", 1): {"possibly_billed": 1}}


def test_a_monitor_is_saved_and_restored_with_its_path(ledger: Ledger) -> None:
    ledger.commit([SaveMonitor("v", "chat", "a/int4", served=3), SaveMonitor("v", "code", "a/int4", served=1)])
    ledger.write(
        SaveMonitor("v", "chat", "a/int4", served=5, state={"stopped": {"at": 4}, "e": 2.5}, points=[(1, 1.5), (0, 1.0)])
    )
    ledger.write(SaveMonitor("v", "chat", "a/int4", served=6, state={"stopped": None, "e": 3.0}, points=[(1, 2.0)]))
    states = ledger.monitor_states("v")
    assert states["chat", "a/int4"] == {"stopped": None, "e": 3.0, "served": 6, "path": [[0, 1.0], [1, 2.0]]}
    assert states["code", "a/int4"] == {"stopped": None, "served": 1, "path": []}
    assert ledger.monitor_states("another verification") == {}


def test_reopening_keeps_everything_and_applies_no_migration_twice(ledger: Ledger, tmp_path: Path) -> None:
    attempt = ledger.write(StartAttempt(key("a"), "r", 0.1))
    versions = ledger.query("SELECT version FROM schema_migrations ORDER BY version")
    again = open_ledger("sqlite:///state/ledger.sqlite", tmp_path)
    try:
        assert again.query("SELECT version FROM schema_migrations ORDER BY version") == versions
        assert versions == [(v,) for v in range(1, 5 if isinstance(ledger, SqliteLedger) else 6)]
        assert again.query("SELECT id FROM attempts") == [(attempt,)]
    finally:
        again.close()


def test_paid_probe_replies_are_kept_by_request_and_read_back_by_age(ledger: Ledger) -> None:
    before = time.time()
    ledger.commit([SaveProbeReply("k1", "a/int4", "chat:1", '{"x": 1}', 0.002, "run-1"),
                   SaveProbeReply("k2", "b/fp8", "chat:1", '{"x": 2}', 0.0, "run-1")])  # fmt: skip
    ledger.write(SaveProbeReply("k1", "a/int4", "chat:1", '{"x": 3}', 0.004, "run-2"))  # bought again: the newer wins
    paid = ledger.paid_probe_replies(since=before)
    assert set(paid) == {"k1", "k2"}
    reply, cost, run_id, at = paid["k1"]
    assert (reply, cost, run_id) == ('{"x": 3}', 0.004, "run-2") and before <= at <= time.time()
    assert ledger.paid_probe_replies(since=time.time() + 60) == {}


def test_an_older_ledger_gains_the_new_tables_and_nothing_is_applied_twice(ledger: Ledger, tmp_path: Path) -> None:
    """A ledger made before verify kept its replies (SQLite at version 2, a shared ledger
    at 3): reopened, it gets the new tables under the next numbers, and a shared ledger's
    own migration is not run again (it would fail: its tables exist)."""
    attempt = ledger.write(StartAttempt(key("a"), "r", 0.1))
    first_new = 3 if isinstance(ledger, SqliteLedger) else 4
    with ledger.transaction() as tx:
        tx.execute("DROP TABLE probe_replies")
        tx.execute("DROP TABLE replaced_records")
        tx.execute("DELETE FROM schema_migrations WHERE version>=?", (first_new,))
    again = open_ledger("sqlite:///state/ledger.sqlite", tmp_path)
    try:
        assert again.query("SELECT MAX(version) FROM schema_migrations") == [(first_new + 1,)]
        again.write(SaveProbeReply("k", "a/int4", "chat:1", "{}", 0.001, "run"))
        assert set(again.paid_probe_replies(since=0)) == {"k"}
        assert again.replaced("chat", HASH) == []
        assert again.query("SELECT id FROM attempts") == [(attempt,)]
    finally:
        again.close()


def test_a_record_set_aside_keeps_its_line_and_its_turns_before_the_first_made_again(ledger: Ledger) -> None:
    """Refill (a provider re-verified different): the record's line moves to
    replaced_records, its turns from the first bad one are no longer done (not reused), and
    the turns before it stay done for the run that makes the record again."""
    for turn in (0, 1, 2):
        attempt = ledger.write(StartAttempt(key("a", turn), "r", 0.1))
        ledger.write(finish(key("a", turn), attempt, 0.01, reply=f'{{"turn": {turn}}}'))
    ledger.write(WriteRecords("chat", HASH, [("a", '{"id": "a"}', "sha-a"), ("b", '{"id": "b"}', "sha-b")]))
    ledger.write(ReplaceRecords("chat", HASH, [("a", 1, "beta/int4 re-verified different")]))
    assert set(ledger.done_records("chat", HASH)) == {"b"}
    ((record, line, turn, why, at),) = ledger.replaced("chat", HASH)
    assert (record, line, turn, why) == ("a", '{"id": "a"}', 1, "beta/int4 re-verified different") and at > 0
    assert set(ledger.done_turns("chat", HASH)) == {("a", 0)}
    assert ledger.record_costs("chat", HASH) == {"a": pytest.approx(0.03)}  # every attempt stays counted
    ledger.write(ReplaceRecords("chat", HASH, [("a", 1, "again")]))  # set aside twice (a crash between): kept once
    assert len(ledger.replaced("chat", HASH)) == 1


def test_a_ledger_url_is_checked_and_the_environment_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_VARIABLE, "sqlite:///from-env.sqlite")
    open_ledger("sqlite:///from-params.sqlite", tmp_path).close()
    assert (tmp_path / "from-env.sqlite").exists()
    assert not (tmp_path / "from-params.sqlite").exists()
    monkeypatch.setenv(URL_VARIABLE, "mysql://user:hunter2@db/ledger")
    with pytest.raises(ConfigError, match=r"\$QUANTHUNT_LEDGER_URL: .*not a ledger URL") as caught:
        open_ledger("sqlite:///from-params.sqlite", tmp_path)
    assert "hunter2" not in str(caught.value)


def test_an_unreachable_postgres_names_the_setting_and_hides_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_VARIABLE, "postgresql://quanthunt:hunter2@127.0.0.1:1/ledger?connect_timeout=2")
    with pytest.raises(ConfigError, match=r"\$QUANTHUNT_LEDGER_URL: cannot reach the ledger") as caught:
        open_ledger("sqlite:///state/ledger.sqlite", tmp_path)
    assert "hunter2" not in str(caught.value)


def test_a_sqlite_file_that_is_not_a_ledger_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    with pytest.raises(ConfigError, match=r"notes\.txt: not a usable ledger database"):
        open_ledger("sqlite:///notes.txt", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a database\n" * 100
