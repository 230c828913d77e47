"""The generation engine, in-process: a write failure stops it, a record's cost and turns
across runs, the collector settings, the ramp, routing and provenance by endpoint, empty
answers (real SQLite in tmp_path; an in-process chat client in place of HTTP, which the
stage tests cover against the sandbox). The sink's ordering behind the ledger:
``test_records.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fixtures.params import SHIPPED, changed
from fixtures.records import writing
from fixtures.verdicts import eligible

from quanthunt.gateway import Routing
from quanthunt.generation import Engine, quiet_collector
from quanthunt.jobs import Eligible, Job
from quanthunt.ledger import FinishAttempt, Ledger, RequestKey, StartAttempt
from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.params import Retry, Sampling
from quanthunt.prompts import PromptRecord, Turn
from quanthunt.replies import ChatReply, Usage

HASH = "p" * 64
SAMPLING = Sampling(temperature=0.7, top_p=1.0, max_tokens=16, seed=0)
RETRY = Retry(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0, empty_answer_max_tokens=None)
PROVIDER = eligible("Moonshot AI", "moonshotai/int4", "int4", 1e-6, 2e-6, 8192)


def job(concurrency: int = 4, *, ramp_up_s: float = 0.0, max_usd: float = 10.0,
        providers: tuple[Eligible, ...] = (PROVIDER,)) -> Job:  # fmt: skip
    settings = changed(SHIPPED.generate, sampling=SAMPLING, retry=RETRY, max_usd_per_run=max_usd, max_output_tokens=None,
                       concurrency=concurrency, ramp_up_s=ramp_up_s)  # fmt: skip
    return Job(dataset="chat", model="m", providers=providers, routing=Routing(data_collection="deny"), params_hash=HASH,
               run_id="run", settings=settings, concurrency=concurrency, verification_run_id="v")  # fmt: skip


class FixedCostChat:
    """Answers every request at once, served by ``provider``, costing ``cost``."""

    def __init__(self, cost: float, provider: str = PROVIDER.name) -> None:
        self.cost, self.provider, self.calls = cost, provider, 0

    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply:
        self.calls += 1
        if on_headers is not None:
            on_headers(f"gen-{self.calls}")
        usage = Usage(prompt_tokens=5, completion_tokens=3, cost=self.cost)
        name = f"gen-{self.calls}"
        return ChatReply(id=name, generation_id=name, provider=self.provider, model="m", content=f"answer {self.calls}",
                         reasoning=None, finish_reason="stop", logprobs=None, usage=usage)  # fmt: skip


class SlowChat(FixedCostChat):
    """Holds every request ``hold_s`` and notes when each was sent (event-loop time)."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(0.0001)
        self.hold_s, self.sent_at = hold_s, list[float]()

    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply:
        self.sent_at.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.hold_s)
        return await super().chat(body, on_headers=on_headers)


class PinnedChat(FixedCostChat):
    """Serves the endpoint each request is pinned to; its reply names the provider as
    ``names[tag]`` says; the first ``empty`` replies have no content (thinking ate max_tokens)."""

    def __init__(self, names: Mapping[str, str], *, empty: int = 0) -> None:
        super().__init__(0.01)
        self.names, self.empty = names, empty
        self.bodies: list[Mapping[str, Any]] = []
        self.served: dict[str, str] = {}
        """generation id -> the tag the request was pinned to."""

    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply:
        self.bodies.append(body)
        (tag,) = body["provider"]["only"]
        reply = await super().chat(body, on_headers=on_headers)
        self.served[reply.id] = tag
        if self.calls <= self.empty:
            return dataclasses.replace(reply, provider=self.names[tag], content="", finish_reason="length")
        return dataclasses.replace(reply, provider=self.names[tag])


def lines(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def records(*ids: str) -> list[PromptRecord]:
    return [PromptRecord(i, (Turn("user", f"question {i}"),)) for i in ids]


@dataclass(frozen=True)
class Ran:
    engine: Engine
    output: Path
    started: float
    """Event-loop time at the start of the run."""
    took_s: float


def run_engine(
    tmp_path: Path, chat: FixedCostChat, prompts: list[PromptRecord], ledger: Ledger, the_job: Job | None = None
) -> Ran:
    """Run the engine once on ``ledger`` (resuming what it holds), writing ``tmp_path/out.jsonl``."""
    output = tmp_path / "out.jsonl"

    async def scenario() -> Ran:
        async with writing(ledger, output, HASH) as (writer, sink):
            engine = Engine(the_job or job(), chat, ledger, writer, sink, done_turns=ledger.done_turns("chat", HASH))
            started = asyncio.get_running_loop().time()
            await engine.run(prompts)
            return Ran(engine, output, started, asyncio.get_running_loop().time() - started)

    return asyncio.run(scenario())


def test_engine_stops_and_raises_when_the_output_cannot_be_written(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    output = tmp_path / "out.jsonl"

    async def scenario() -> Engine:
        async with writing(ledger, output, HASH) as (writer, sink):
            sink._fh.close()  # every write now fails, as on a vanished disk
            engine = Engine(job(concurrency=1), FixedCostChat(0.01), ledger, writer, sink, done_turns={})
            with pytest.raises(ValueError, match="closed file"):
                await engine.run(records(*(f"r{i}" for i in range(20))))
        return engine

    engine = asyncio.run(scenario())
    assert engine.progress.records_done == 0
    assert engine.progress.stop_reason is not None
    assert "out.jsonl failed" in engine.progress.stop_reason
    assert engine.progress.requests_ok < 20  # it stopped dispatching


def test_a_records_cost_counts_attempts_of_earlier_runs(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    # an earlier run paid for an attempt of r1 whose reply was lost
    attempt = ledger.write(StartAttempt(RequestKey("chat", "r1", 0, HASH), run_id="earlier", reserved_usd=0.1))
    ledger.write(
        FinishAttempt(RequestKey("chat", "r1", 0, HASH), attempt, state="pending", outcome="failed_billed", cost_usd=0.04)
    )
    ran = run_engine(tmp_path, FixedCostChat(0.01), records("r1", "r2"), ledger)
    engine, output = ran.engine, ran.output
    costs = {r["id"]: r["provenance"]["usage"]["cost_usd"] for r in map(json.loads, output.read_text().splitlines())}
    assert costs == pytest.approx({"r1": 0.05, "r2": 0.01})
    assert costs == pytest.approx(ledger.record_costs("chat", HASH))
    assert engine.progress.records_done == 2
    generation_ids = {g for (g,) in ledger.db.execute("SELECT generation_id FROM attempts WHERE run_id='run'")}
    assert generation_ids == {"gen-1", "gen-2"}


def test_a_resumed_record_asks_only_for_the_turns_an_earlier_run_did_not_finish(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    first = RequestKey("chat", "m1", 0, HASH)
    earlier = {"content": "earlier answer", "reasoning": None, "provider": PROVIDER.name, "endpoint_tag": PROVIDER.tag,
               "generation_id": "gen-old",
               "finish_reason": "stop", "prompt_tokens": 4, "completion_tokens": 2, "cost_usd": 0.02, "attempts": 1}  # fmt: skip
    attempt = ledger.write(StartAttempt(first, run_id="earlier", reserved_usd=0.1))
    ledger.write(FinishAttempt(first, attempt, state="done", outcome="ok", cost_usd=0.02, reply=earlier))
    conversation = (Turn("user", "part one?"), Turn("assistant", "old"), Turn("user", "part two?"))
    chat = FixedCostChat(0.01)
    ran = run_engine(tmp_path, chat, [PromptRecord("m1", conversation)], ledger)
    engine, output = ran.engine, ran.output
    (line,) = map(json.loads, output.read_text().splitlines())
    assert chat.calls == 1
    assert [t["content"] for t in line["conversations"] if t["role"] == "assistant"] == ["earlier answer", "answer 1"]
    assert line["provenance"]["usage"]["cost_usd"] == pytest.approx(0.03)
    assert [t["generation_id"] for t in line["provenance"]["turns"]] == ["gen-old", "gen-1"]
    assert engine.done_turns == {}


def test_quiet_collector_restores_the_collector_afterwards() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with quiet_collector(young_threshold=12_345):
        assert gc.get_threshold()[0] == 12_345
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_the_ramp_spreads_the_first_wave_over_ramp_up_s(tmp_path: Path) -> None:
    chat = SlowChat(hold_s=0.5)
    ran = run_engine(tmp_path, chat, records("a", "b", "c", "d"), SqliteLedger(tmp_path / "ledger.sqlite"),
                     job(concurrency=4, ramp_up_s=0.4))  # fmt: skip
    assert ran.engine.progress.records_done == 4
    # Worker k starts k x 0.1 s in (never earlier; load only delays it), and each sends
    # once in the first 0.5 s: the k-th send is at least k x 0.1 s in. Without the ramp
    # all four go at once.
    since_start = sorted(t - ran.started for t in chat.sent_at)
    assert all(sent >= k * 0.1 - 0.001 for k, sent in enumerate(since_start)), since_start


def test_a_stop_during_the_ramp_ends_the_run_without_waiting_it_out(tmp_path: Path) -> None:
    # A cap below one request's worst case: the first worker stops the run at once; the
    # other workers would otherwise sleep through up to 45 s of a 60 s ramp.
    ran = run_engine(tmp_path, FixedCostChat(0.01), records("a", "b", "c", "d"), SqliteLedger(tmp_path / "ledger.sqlite"),
                     job(concurrency=4, ramp_up_s=60, max_usd=1e-9))  # fmt: skip
    assert ran.engine.progress.stop_reason is not None and "spending cap" in ran.engine.progress.stop_reason
    assert ran.took_s < 10


def test_each_turn_names_the_endpoint_of_its_provider_that_served_it(tmp_path: Path) -> None:
    # One provider, two endpoints; the base slug's pin ignores the variant (or it could land there).
    base = eligible("DeepInfra", "deepinfra", "bf16", 1e-6, 2e-6, 8192, siblings=("deepinfra/turbo",))
    turbo = eligible("DeepInfra", "deepinfra/turbo", "fp8", 1e-6, 2e-6, 8192, siblings=("deepinfra",))
    chat = PinnedChat({"deepinfra": "DeepInfra", "deepinfra/turbo": "DeepInfra"})
    ids = [f"r{i}" for i in range(30)]
    ran = run_engine(tmp_path, chat, records(*ids), SqliteLedger(tmp_path / "ledger.sqlite"), job(providers=(base, turbo)))
    written = lines(ran.output)
    assert {r["id"] for r in written} == set(ids)
    for record in written:
        (turn,) = record["provenance"]["turns"]
        assert turn["endpoint_tag"] == chat.served[turn["generation_id"]]
        declared = {"deepinfra": "bf16", "deepinfra/turbo": "fp8"}[turn["endpoint_tag"]]
        assert turn["provider"] == "DeepInfra" and turn["declared_quantization"] == declared
        (served,) = record["provenance"]["providers"]
        assert served == {k: turn[k] for k in ("provider", "endpoint_tag", "declared_quantization", "verdict", "verdict_run_id")}
    assert set(ran.engine.progress.providers) == {"deepinfra", "deepinfra/turbo"}
    ignored = {tuple(b["provider"]["only"]): b["provider"].get("ignore") for b in chat.bodies}
    assert ignored == {("deepinfra",): ["deepinfra/turbo"], ("deepinfra/turbo",): None}
    assert all(b["provider"]["data_collection"] == "deny" for b in chat.bodies)


def test_a_reply_by_slug_is_kept_and_another_provider_retires_the_endpoint(tmp_path: Path) -> None:
    fireworks = eligible("Fireworks", "fireworks/int4", "int4", 1e-6, 2e-6, 8192)
    chat = PinnedChat({PROVIDER.tag: "moonshotai", fireworks.tag: "Chutes"})  # Moonshot AI by its slug; "Fireworks" is not
    ids = [f"r{i}" for i in range(12)]
    ran = run_engine(tmp_path, chat, records(*ids), SqliteLedger(tmp_path / "ledger.sqlite"),
                     job(concurrency=1, providers=(PROVIDER, fireworks)))  # fmt: skip
    progress = ran.engine.progress
    assert {r["id"] for r in lines(ran.output)} == set(ids)
    assert {t["endpoint_tag"] for r in lines(ran.output) for t in r["provenance"]["turns"]} == {PROVIDER.tag}
    assert [b["provider"]["only"] for b in chat.bodies].count([fireworks.tag]) <= 1  # never asked again after it
    assert progress.quarantined == len(progress.retired) and set(progress.retired) <= {fireworks.tag}

    everyone_wrong = PinnedChat({PROVIDER.tag: "Chutes", fireworks.tag: "Chutes"})
    (tmp_path / "b").mkdir()
    stopped = run_engine(tmp_path / "b", everyone_wrong, records(*ids), SqliteLedger(tmp_path / "b.sqlite"),
                         job(concurrency=1, providers=(PROVIDER, fireworks)))  # fmt: skip
    assert everyone_wrong.calls == 2 and not stopped.output.read_text()
    assert stopped.engine.fatal is not None and stopped.engine.fatal.exit_code == 2
    assert set(stopped.engine.progress.retired) == {PROVIDER.tag, fireworks.tag}


def test_an_empty_answer_is_paid_for_asked_again_and_never_written(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    chat = PinnedChat({PROVIDER.tag: PROVIDER.name}, empty=1)
    ran = run_engine(tmp_path, chat, records("r1"), ledger)
    (line,) = lines(ran.output)
    assert line["conversations"][-1]["content"] == "answer 2"
    assert line["provenance"]["usage"]["cost_usd"] == pytest.approx(0.02)  # the empty answer was paid for too
    assert ledger.record_costs("chat", HASH) == pytest.approx({"r1": 0.02})
    assert ran.engine.progress.errors["empty_answer"] == 1 and ran.engine.progress.retries["empty_answer"] == 1
    outcomes = list(ledger.db.execute("SELECT outcome, error_kind, cost_usd FROM attempts ORDER BY id"))
    assert outcomes == [("failed_billed", "empty_answer", 0.01), ("ok", None, 0.01)]


def test_an_empty_answer_is_asked_again_with_the_larger_budget_the_params_allow(tmp_path: Path) -> None:
    """``generate.retry.empty_answer_max_tokens``: the turn whose thinking ate ``max_tokens``
    is asked again with room for an answer, and its worst case is reserved for it."""
    chat = PinnedChat({PROVIDER.tag: PROVIDER.name}, empty=1)
    retry = changed(RETRY, max_attempts=3, empty_answer_max_tokens=64)
    larger = dataclasses.replace(job(), settings=changed(job().settings, retry=retry))
    ran = run_engine(tmp_path, chat, records("r1"), SqliteLedger(tmp_path / "ledger.sqlite"), larger)
    assert [b["max_tokens"] for b in chat.bodies] == [16, 64]
    assert lines(ran.output)[0]["conversations"][1]["content"] == "answer 2"
