"""The monitor inside the generation engine, in-process: monitored requests ask for
logprobs, every turn carries its provider's monitor state, a crossing stops routing to the
provider and saves the stop, and with no provider left the run ends resumable (exit 75).
A stub stands in for the reference's scoring (the stage test scores at the real one)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fixtures.params import SHIPPED, changed
from fixtures.records import writing
from fixtures.verdicts import eligible, verdicts_of
from test_generation import HASH, PinnedChat, job, lines, records

from quanthunt.errors import EXIT_OUT_OF_BUDGET, ConfigError
from quanthunt.generation import Engine
from quanthunt.jobs import Eligible
from quanthunt.ledger import Ledger, SaveMonitor
from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.measurements import LogprobCompletion
from quanthunt.monitor import ProviderMonitor, rank_temperature, sampler_testable
from quanthunt.monitoring import Monitoring, monitor_card, monitor_margin
from quanthunt.replies import ChatReply, TokenLogprob
from quanthunt.report import DatasetView, monitor_section
from quanthunt.verdicts import Calibration

A = eligible("A", "a/int4", "int4", 1e-6, 2e-6, 8192)
B = eligible("B", "b/int4", "int4", 1e-6, 2e-6, 8192)
DRIFT_AFTER = 12
"""Replies b serves faithfully; later ones come from a coarser model."""


class DriftingChat(PinnedChat):
    """b's replies after its ``DRIFT_AFTER``-th are marked as drifted (the stub scorer reads
    the mark); every reply carries logprobs when asked."""

    def __init__(self) -> None:
        super().__init__({"a/int4": "A", "b/int4": "B"})
        self.by_tag: Counter[str] = Counter()
        self.drifted: set[str] = set()

    async def chat(self, body: Mapping[str, Any], *, on_headers: Any = None) -> ChatReply:
        reply = await super().chat(body, on_headers=on_headers)
        tag = self.served[reply.id]
        self.by_tag[tag] += 1
        logprobs = [TokenLogprob(token="x", logprob=-0.5)] if body.get("logprobs") else None
        if tag == "b/int4" and self.by_tag[tag] > DRIFT_AFTER:
            self.drifted.add(reply.id)
            return dataclasses.replace(reply, content="DRIFTED " + reply.content, logprobs=logprobs)
        return dataclasses.replace(reply, logprobs=logprobs)


class StubScorer:
    """Scores a reply as the reference would: |Δ| 0.6 (extreme) for drifted text, 0.01 else."""

    reasoning = SHIPPED.reasoning

    def __init__(self) -> None:
        self.scored = 0

    async def prompt_ids(self, messages: Sequence[Mapping[str, str]], errors: Counter[str]) -> list[int]:
        await asyncio.sleep(0)
        return [1, 2, 3]

    async def logprobs(self, prompt: list[int], reply: ChatReply, errors: Counter[str], *, probe_id: str, index: int,
                       seq: int) -> LogprobCompletion:  # fmt: skip
        self.scored += 1
        shift = 0.6 if reply.content.startswith("DRIFTED") else 0.01
        return LogprobCompletion(probe_id, index, 3, 3, [shift] * 3, [], [])


def run_monitored(tmp_path: Path, providers: tuple[Eligible, ...], count: int) -> tuple[Engine, DriftingChat, Ledger]:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    chat = DriftingChat()
    settings = changed(SHIPPED.generate.monitor, share=1.0, checkpoint_every=4, concurrency=2)
    monitors = {p.tag: ProviderMonitor.start(p.tag, "logprob", sampler=False, margin=SHIPPED.verify.margin, alpha=0.05 / 2,
                                             checkpoint_every=4, audited=[]) for p in providers}  # fmt: skip

    async def scenario() -> Engine:
        async with writing(ledger, tmp_path / "out.jsonl", HASH) as (writer, sink):
            monitoring = Monitoring(monitors, StubScorer(), writer, verification_run_id="v", dataset="chat",  # type: ignore[arg-type]
                                    settings=settings)  # fmt: skip
            engine = Engine(job(2, providers=providers), chat, ledger, writer, sink, done_turns={}, monitoring=monitoring)
            await engine.run(records(*(f"r{i:03d}" for i in range(count))))
            await monitoring.close()
            return engine

    return asyncio.run(scenario()), chat, ledger


def test_a_drifting_provider_is_stopped_and_the_other_goes_on(tmp_path: Path) -> None:
    engine, chat, ledger = run_monitored(tmp_path, (A, B), 80)
    assert all(b.get("logprobs") is True and b.get("top_logprobs") == 5 for b in chat.bodies)  # share 1: every one
    stops = engine.progress.monitor_stops
    assert list(stops) == ["b/int4"]
    assert DRIFT_AFTER <= stops["b/int4"]["at"] < DRIFT_AFTER + 5
    assert "b/int4" in engine.progress.retired and engine.fatal is None
    # routing stopped: after the stop only what was in flight or awaiting its score went to b
    assert chat.by_tag["b/int4"] <= stops["b/int4"]["replies_before"] + 2 * 2
    written = lines(tmp_path / "out.jsonl")
    assert len(written) == 80
    turns = [r["provenance"]["turns"][0] for r in written]
    assert all(t["monitor"]["checkpoint"] >= 0 and t["monitor"]["monitored"] for t in turns)
    drifted = [t for t in turns if t["generation_id"] in chat.drifted]
    assert drifted and all(t["monitor"]["checkpoint"] >= stops["b/int4"]["suspect_from"] for t in drifted)
    saved = ledger.monitor_states("v")
    assert saved["chat", "b/int4"]["stopped"]["at"] == stops["b/int4"]["at"]
    assert saved["chat", "a/int4"]["stopped"] is None
    assert [i for i, _ in saved["chat", "a/int4"]["path"]] == list(range(chat.by_tag["a/int4"]))


def test_with_every_provider_stopped_the_run_ends_resumable(tmp_path: Path) -> None:
    engine, chat, _ = run_monitored(tmp_path, (B,), 60)
    fatal = engine.fatal
    assert fatal is not None and fatal.exit_code == EXIT_OUT_OF_BUDGET
    assert "stopped by its monitor" in str(fatal) and "rerun verify" in str(fatal)
    assert chat.by_tag["b/int4"] < 60


def test_a_monitor_whose_replies_were_never_scored_still_reports(tmp_path: Path) -> None:
    """A run killed while its only monitored replies were being scored saved just their count."""
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")
    ledger.write(SaveMonitor("v", "chat", "b/int4", served=3))
    state = ledger.monitor_states("v")["chat", "b/int4"]
    card = monitor_card(state)
    assert card == {"replies": 3, "threshold": None, "e_path": [], "stopped": None}
    monitor = ProviderMonitor("b/int4", "logprob", False, SHIPPED.verify.margin, 40.0, 4)
    monitor.restore(state)
    assert (monitor.served, monitor.fed, monitor.checkpoint) == (3, 3, 0)
    page = monitor_section([DatasetView("chat", [], {"providers": [{"tag": "b/int4", "monitor": card}]}, None)])
    assert "b/int4" in page and "<img" not in page


def test_the_sampler_is_monitored_at_the_generations_temperature_and_not_where_the_pit_is_unknown() -> None:
    """At the shipped T 0.7 (and any temperature in (0, 1]) the rank statistics are exact
    (``measurements.tempered_pit_normal_score``): a sample-mode provider is monitored and a
    logprob-mode one has the sampler's tests besides its |Δ| tests. A nucleus cut or a
    temperature above 1 would need mass the reference does not list: no sampler tests there,
    and the scorer ranks at 1 (its statistics unused) instead of failing."""
    shipped = SHIPPED.generate.sampling
    for sampling, testable in [(shipped, True), (changed(shipped, temperature=1.0), True),
                               (changed(shipped, top_p=0.9), False), (changed(shipped, temperature=1.3), False),
                               (changed(shipped, temperature=0.0), False)]:  # fmt: skip
        assert sampler_testable(sampling) is testable
        assert rank_temperature(sampling) == (sampling.temperature if testable else 1.0)
        sample = ProviderMonitor.start("s/x", "sample", sampler=testable, margin=SHIPPED.verify.margin, alpha=0.05,
                                       checkpoint_every=8, audited=[])  # fmt: skip
        assert sample.monitored is testable
        logprob = ProviderMonitor.start("l/x", "logprob", sampler=testable, margin=SHIPPED.verify.margin, alpha=0.05,
                                        checkpoint_every=8, audited=[])  # fmt: skip
        assert logprob.monitored and ("sampler: mean Φ(rank z) off ½" in logprob.bet_names) is testable


def test_the_monitor_bets_with_the_margins_calibrated_at_the_generations_settings_and_refuses_others() -> None:
    """Verify decides with its margins; the monitor with the sampler's widened to what the
    controls showed at the generation's settings, and only at those settings."""
    margin, sampling = SHIPPED.verify.margin, SHIPPED.generate.sampling
    wider = changed(margin, sample_tail_p0=0.09, sampler_shift=0.08)
    measured_at = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 384}
    calibration = Calibration.of(SHIPPED.survey.model, controls=["box"], note="n", margin=margin,
                                 decision=SHIPPED.verify.decision, monitor_margin=wider,
                                 monitor_settings=measured_at)  # fmt: skip
    verdicts = verdicts_of(calibration=calibration)
    assert monitor_margin(verdicts, sampling, margin) == wider
    assert monitor_margin(verdicts_of(), sampling, margin) == margin  # a file from before: what verify decided with
    hotter = changed(sampling, temperature=0.8)
    with pytest.raises(ConfigError, match=r"generate.sampling.temperature 0.7 \(now 0.8\).*quanthunt calibrate"):
        monitor_margin(verdicts, hotter, margin)
