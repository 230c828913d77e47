"""A generated record's line and the dataset's output file: per-turn provenance in the
line, the sink's ordering behind the ledger (a line waits for its turns' ledger writes; a
failed write fails every later record), the file repaired against the ledger at each start
(a cut last line, lines the ledger missed, records the file lost, lines edited since), and
publishing whole files."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from fixtures.params import SHIPPED, changed
from fixtures.records import writing
from fixtures.verdicts import eligible

from quanthunt.errors import ConfigError
from quanthunt.gateway import Routing
from quanthunt.jobs import Job
from quanthunt.ledger import Ledger, WriteRecords
from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.params import Retry, Sampling
from quanthunt.prompts import PromptRecord, Turn
from quanthunt.records import adopt_published, prepare_output, publish, record_line, sha256_line

HASH = "a" * 64
NOVITA = eligible("Novita", "novita/int4", "int4", 1e-7, 4e-7, 8192, verdict_run_id="run-n")
PARASAIL = eligible("Parasail", "parasail/unknown", "unknown", 1e-7, 4e-7, 8192, verdict_run_id="run-p")
JOB = Job(
    dataset="chat",
    model="a/b",
    providers=(NOVITA, PARASAIL),
    routing=Routing(),
    params_hash=HASH,
    run_id="r1",
    settings=changed(
        SHIPPED.generate,
        sampling=Sampling(temperature=0.6, top_p=0.95, max_tokens=64, seed=None),
        retry=Retry(max_attempts=3, base_delay_s=0.1, max_delay_s=1.0, empty_answer_max_tokens=None),
        max_usd_per_run=1.0,
        max_output_tokens=None,
        concurrency=2,
    ),
    concurrency=2,
    verification_run_id="verify-1",
)
RECORD = PromptRecord("r-1", (Turn("user", "Hi"), Turn("assistant", "old"), Turn("user", "More?"), Turn("assistant", "old")))


def reply(tag: str, content: str, **fields: object) -> dict[str, object]:
    return {"endpoint_tag": tag, "content": content, "generation_id": f"gen-{content}", "finish_reason": "stop",
            "prompt_tokens": 5, "completion_tokens": 3, "cost_usd": 0.001, **fields}  # fmt: skip


def test_each_turn_names_its_own_endpoint_and_the_record_lists_providers_in_order_of_use() -> None:
    line = record_line(
        JOB,
        RECORD,
        [reply("parasail/unknown", "one", reasoning="thought"), reply("novita/int4", "two")],
        endpoints={p.tag: p for p in JOB.providers},
        cost_usd=0.0025,
        attempts=[Counter({"billed": 1}), Counter({"billed": 1, "possibly_billed": 1})],
        started=0.0,
    )
    data = json.loads(line)
    assert [t["content"] for t in data["conversations"]] == ["Hi", "one", "More?", "two"]
    assert data["conversations"][1]["reasoning_content"] == "thought" and "reasoning_content" not in data["conversations"][3]
    first, second = data["provenance"]["turns"]
    assert (first["provider"], first["declared_quantization"], first["verdict_run_id"]) == ("Parasail", "unknown", "run-p")
    assert (second["provider"], second["declared_quantization"]) == ("Novita", "int4")
    assert second["attempts"] == 2 and second["attempts_by_billing"] == {"billed": 1, "possibly_billed": 1, "unbilled": 0}
    assert [p["provider"] for p in data["provenance"]["providers"]] == ["Parasail", "Novita"]
    assert data["provenance"]["usage"] == {"prompt_tokens": 10, "completion_tokens": 6, "cost_usd": 0.0025}
    assert data["provenance"]["params_sha256"] == HASH


def test_a_turn_from_an_endpoint_no_longer_eligible_keeps_its_name_and_no_verdict() -> None:
    line = record_line(
        JOB,
        PromptRecord("r-2", (Turn("user", "Hi"), Turn("assistant", "old"))),
        [reply("gone/fp8", "one", provider="Gone")],
        endpoints={p.tag: p for p in JOB.providers},
        cost_usd=0.0,
        attempts=[Counter()],
        started=0.0,
    )
    (turn,) = json.loads(line)["provenance"]["turns"]
    assert (turn["provider"], turn["endpoint_tag"], turn["verdict"]) == ("Gone", "gone/fp8", None)


def generated(record_id: str, params_hash: str = HASH) -> str:
    return json.dumps({"id": record_id, "provenance": {"params_sha256": params_hash}})


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return SqliteLedger(tmp_path / "ledger.sqlite")


def test_a_line_waits_for_the_ledger_write_of_its_turns(tmp_path: Path, ledger: Ledger) -> None:
    output = tmp_path / "out.jsonl"

    async def scenario() -> tuple[str, str, bool]:
        async with writing(ledger, output, HASH) as (_, sink):
            turn_committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            written = sink.add("r1", '{"id": "r1"}', after=[turn_committed])
            await asyncio.sleep(0.05)
            before = output.read_text()
            turn_committed.set_result(None)
            await written
            after = output.read_text()
        return before, after, written.done()

    before, after, done = asyncio.run(scenario())
    assert before == ""
    assert after == '{"id": "r1"}\n'
    assert done
    assert set(ledger.done_records("chat", HASH)) == {"r1"}


def test_a_failed_ledger_write_keeps_the_line_out_and_fails_later_records_too(tmp_path: Path, ledger: Ledger) -> None:
    output = tmp_path / "out.jsonl"

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        async with writing(ledger, output, HASH) as (_, sink):
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(OSError("disk full"))
            first = sink.add("r1", '{"id": "r1"}', after=[failed])
            await asyncio.gather(first, return_exceptions=True)
            second = sink.add("r2", '{"id": "r2"}')
            await asyncio.gather(second, return_exceptions=True)
        return first.exception(), second.exception()

    first, second = asyncio.run(scenario())
    assert isinstance(first, OSError)
    assert second is first
    assert output.read_text() == ""
    assert ledger.done_records("chat", HASH) == {}


def test_the_file_and_the_ledger_are_made_to_agree(tmp_path: Path, ledger: Ledger) -> None:
    out = tmp_path / "chat.jsonl"
    lost, edited = generated("lost"), generated("edited")
    ledger.write(WriteRecords("chat", HASH, [("lost", lost, sha256_line(lost)), ("edited", edited, sha256_line(edited))]))
    out.write_text(generated("adopted") + "\n" + generated("edited").replace("}}", ', "x": 1}}') + "\n" + '{"id": "half')
    repair = prepare_output(out, ledger, "chat", HASH)
    assert repair.truncated_bytes == len('{"id": "half')
    assert (repair.adopted, repair.restored, repair.edited) == (1, 1, ("edited",))
    assert repair.done_ids == {"adopted", "edited", "lost"}
    assert out.read_text().splitlines()[-1] == lost  # written back from the ledger's copy
    assert set(ledger.done_records("chat", HASH)) == {"adopted", "edited", "lost"}
    again = prepare_output(out, ledger, "chat", HASH)
    assert (again.truncated_bytes, again.adopted, again.restored) == (0, 0, 0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (generated("a", "b" * 64), "record a was generated with other sampling params (bbbbbbbbbbbb)"),
        (generated("a") + "\n" + generated("a"), "record a appears twice"),
        ("not json", "not a generated record"),
    ],
)
def test_a_file_that_cannot_be_resumed_is_refused_untouched(tmp_path: Path, ledger: Ledger, content: str, message: str) -> None:
    out = tmp_path / "chat.jsonl"
    out.write_text(content + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        prepare_output(out, ledger, "chat", HASH)
    assert str(info.value).startswith(f"{out}:")
    assert out.read_text() == content + "\n" and ledger.done_records("chat", HASH) == {}


def test_a_published_file_is_adopted_only_for_the_same_params_and_publishing_replaces_it_whole(tmp_path: Path) -> None:
    published, working = tmp_path / "data" / "chat.jsonl", tmp_path / "work" / "chat.jsonl"
    published.parent.mkdir()
    published.write_text(generated("old", "c" * 64) + "\n")
    adopt_published(published, working, HASH)
    assert not working.exists()  # other params: start over
    published.write_text(generated("old") + "\n")
    adopt_published(published, working, HASH)
    assert working.read_text() == published.read_text()
    working.write_text(generated("old") + "\n" + generated("new") + "\n")
    publish(working, published)
    assert published.read_text() == working.read_text()
    assert [p.name for p in published.parent.iterdir()] == ["chat.jsonl"]  # no staged file left behind
