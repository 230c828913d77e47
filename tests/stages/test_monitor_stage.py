"""The generate stage's monitor on the real model: a provider that drifts to NVFP4 after
30 % of its requests is stopped, none of the records it served after the drift reaches
``data/final``, the faithful provider goes on serving; at the shipped T 0.7, a sample-mode
provider's drift to NVFP4 and a logprob-mode provider's sampler drifting +0.3 are stopped
by the sampler's tests, and a faithful one that reports logprobs after temperature is not;
a kill -9 mid-run resumes with the monitor's state as it was saved."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fixtures.generation import SANDBOX_KEY, GenerationBed, write_prompts, write_verdicts
from fixtures.project import Project
from fixtures.sandbox import provider

from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.sandbox.server import SandboxProcess

RECORDS = 64
DRIFT_AFTER = 10
"""beta's requests before it drifts: 30 % of the ~32 it gets (prices are equal)."""
PREDICTED_REPLIES = 5
"""Monitored replies from a drift to NVFP4 to the stop, the drifted one included:
``benchmarks/monitor_drift.py``'s p99 (and max) at the default monitor."""


@dataclass
class DriftBed:
    project: Project
    sandbox: SandboxProcess

    def stats(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.sandbox.api_url}/sandbox/stats", headers={"Authorization": f"Bearer {SANDBOX_KEY}"})
        return dict(reply.json())

    def summary(self) -> dict[str, Any]:
        return dict(json.loads((self.project.root / "reports/generate/tiny.detail.json").read_text()))


@pytest.fixture
def drift_bed(project: Project, tmp_path: Path) -> Iterator[Callable[..., DriftBed]]:
    started: list[SandboxProcess] = []

    def build(*, providers: list[dict[str, Any]] | None = None, records: int = RECORDS, max_tokens: int = 24,
              prompt: str = "What is {i} plus 1? Answer with the number only.", concurrency: int = 8,
              params: dict[str, Any] | None = None) -> DriftBed:  # fmt: skip
        alpha = provider("alpha", precision="int4-bf16act")  # faithful, with bf16 compute noise
        beta = provider("beta", drift=[{"after_requests": DRIFT_AFTER, "precision": "nvfp4"}])
        providers = providers or [alpha, beta]
        roster = {"providers": providers, "credits": {"default_usd": 100.0}}
        path = tmp_path / "roster.yaml"
        path.write_text(yaml.safe_dump(roster), encoding="utf-8")
        sandbox = SandboxProcess(mode="model", roster=path, log_path=tmp_path / "sandbox.log").start()
        started.append(sandbox)
        # Short answers: most end before max_tokens (validate exports no answer cut there).
        write_prompts(project.root / "data/prompts/tiny.jsonl", records, multiturn_every=0, single=prompt)
        settings: dict[str, Any] = {
            "api.base_url": sandbox.api_url, "reference.base_url": sandbox.reference_url, "datasets": ["tiny"],
            "generate.max_records": None, "generate.concurrency": concurrency, "generate.sampling.max_tokens": max_tokens,
            "generate.monitor.share": 1.0, "generate.progress_interval_s": 1, "validate.max_truncated_share": 1.0,
            **(params or {}),
        }  # fmt: skip
        for key, value in settings.items():
            project.set_param(key, value)
        done = project.run("survey", "--params", "params.yaml")
        assert done.returncode == 0, done.stderr
        model = yaml.safe_load(project.params_path.read_text())["survey"]["model"]
        write_verdicts(project.root, providers, model)
        return DriftBed(project, sandbox)

    yield build
    for sandbox in started:
        sandbox.stop()


@pytest.mark.model
def test_a_drifting_provider_is_stopped_and_its_drifted_records_never_exported(drift_bed: Callable[..., DriftBed]) -> None:
    bed = drift_bed()
    done = bed.project.run("generate", "tiny", "--params", "params.yaml", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "monitor: stopped routing to beta/int4" in done.stdout + done.stderr

    monitor = bed.summary()["monitor"]["providers"]
    assert monitor["alpha/int4"]["stopped"] is None
    stop = monitor["beta/int4"]["stopped"]
    assert stop is not None
    # beta's replies are all monitored (share 1): the drift is at its reply DRIFT_AFTER
    assert DRIFT_AFTER <= stop["at"] < DRIFT_AFTER + PREDICTED_REPLIES
    assert stop["suspect_from"] * 8 <= DRIFT_AFTER
    # routing stopped once its score came: at most max_unscored (8) replies awaited scores, 8 more in flight
    assert bed.summary()["monitor_stops"]["beta/int4"]["replies_before"] <= stop["at"] + 1 + 8 + 8

    checked = bed.project.run("validate", "tiny", "--params", "params.yaml", timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    drifted = set(bed.stats()["drifted_generations"]["beta/int4"])
    assert drifted, "the drift never happened: the test proves nothing"
    final = [json.loads(line) for line in (bed.project.root / "data/final/tiny.jsonl").read_text().splitlines()]
    exported = {t["generation_id"] for r in final for t in r["provenance"]["turns"]}
    assert not exported & drifted
    assert any(t["endpoint_tag"] == "alpha/int4" for r in final for t in r["provenance"]["turns"])
    card = json.loads((bed.project.root / "data/final/tiny.card.json").read_text())
    generated = len((bed.project.root / "data/generated/tiny.jsonl").read_text().splitlines())
    assert card["quarantined"]["records"] == generated - len(final) - card["removed"]["records_dropped"] > 0
    assert card["quarantined"]["by_provider"] == {"beta/int4": card["quarantined"]["records"]}
    for record in final:
        for turn in record["provenance"]["turns"]:
            assert turn["monitor"]["checkpoint"] >= 0 and turn["monitor"]["e_value"] >= 0

    # The next run routes nothing to beta and makes its quarantined records again from alpha
    # (quanthunt.refill): then every record is exported, none of them beta's after the drift.
    again = bed.project.run("generate", "tiny", "--params", "params.yaml", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "not routing to beta/int4" in again.stdout + again.stderr
    quarantined = card["quarantined"]["records"]
    said = f"refill: {quarantined} record{'s' if quarantined > 1 else ''} (beta/int4 ×{quarantined}) made again"
    assert said in again.stdout + again.stderr
    checked = bed.project.run("validate", "tiny", "--params", "params.yaml", timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    card = json.loads((bed.project.root / "data/final/tiny.card.json").read_text())
    assert card["quarantined"]["records"] == 0 and card["replaced"]["by_provider"] == {"beta/int4": quarantined}
    final = [json.loads(line) for line in (bed.project.root / "data/final/tiny.jsonl").read_text().splitlines()]
    assert not {t["generation_id"] for r in final for t in r["provenance"]["turns"]} & drifted


SAMPLER_DRIFT_AFTER = 4
"""beta's and gamma's requests before their drift (their monitors have no audit behind them)."""


@pytest.mark.model
def test_the_sampler_is_monitored_at_the_generations_temperature(drift_bed: Callable[..., DriftBed]) -> None:
    """At the shipped T 0.7: beta serves without logprobs (sample mode) and drifts to NVFP4,
    gamma reports exact logprobs while its sampler drifts to T 1.0. Neither drift shows in
    the numbers a logprob test reads, only in the tempered rank. Alpha reports its logprobs
    after temperature, as vLLM's ``--logprobs-mode processed_logprobs`` does. In this test's setting
    (``benchmarks/monitor_drift.py --providers 3 --datasets 1 --tokens 32 --audit 0 --drift-at 0``,
    1,000 runs) beta's drift is stopped a median 43 monitored replies after it, 81 at p99, 112
    at most; gamma's 30, 53, 67. Alpha costs three times as much, so beta and gamma get most of
    the 200 records (beta ~130 replies until it stops). Both are stopped by a sampler test,
    none of their drifted records reaches ``data/final``, and alpha (faithful, with bf16
    compute noise) goes on, every reply's logprobs read as after temperature."""
    bed = drift_bed(
        providers=[
            provider("alpha", precision="int4-bf16act", logprobs_mode="processed_logprobs",
                     pricing={"prompt": "0.000003", "completion": "0.000006"}),
            provider("beta", supports_logprobs=False, drift=[{"after_requests": SAMPLER_DRIFT_AFTER, "precision": "nvfp4"}]),
            provider("gamma", drift=[{"after_requests": SAMPLER_DRIFT_AFTER, "temperature_offset": 0.3}]),
        ],
        records=200, max_tokens=32, prompt="Tell me about the number {i}.", concurrency=16,
        params={"generate.monitor.max_unscored": 64},
    )  # fmt: skip
    done = bed.project.run("generate", "tiny", "--params", "params.yaml", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is not monitored" not in done.stdout + done.stderr

    monitor = bed.summary()["monitor"]["providers"]
    assert monitor["alpha/int4"]["stopped"] is None and monitor["alpha/int4"]["replies"] > 0
    # alpha reports its logprobs after temperature (vLLM processed_logprobs): read so, every
    # reply; read as raw, alpha was stopped at its third monitored reply (extreme completions).
    assert monitor["alpha/int4"]["logprobs_read_as"] == {"processed": monitor["alpha/int4"]["replies"]}
    assert set(monitor["gamma/int4"]["logprobs_read_as"]) == {"raw"}
    assert monitor["beta/int4"]["mode"] == "sample" and monitor["gamma/int4"]["mode"] == "logprob"
    for tag in ("beta/int4", "gamma/int4"):
        stop = monitor[tag]["stopped"]
        assert stop is not None, f"{tag} was not stopped after {monitor[tag]['replies']} monitored replies"
        assert stop["at"] >= SAMPLER_DRIFT_AFTER and stop["test"].startswith("sampler")

    checked = bed.project.run("validate", "tiny", "--params", "params.yaml", timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    drifted = {g for tag in ("beta/int4", "gamma/int4") for g in bed.stats()["drifted_generations"][tag]}
    final = [json.loads(line) for line in (bed.project.root / "data/final/tiny.jsonl").read_text().splitlines()]
    exported = {t["generation_id"] for r in final for t in r["provenance"]["turns"]}
    assert exported and not exported & drifted
    assert any(t["endpoint_tag"] == "alpha/int4" for r in final for t in r["provenance"]["turns"])


def test_kill_9_mid_run_resumes_with_the_monitors_state(generation_bed: Callable[..., GenerationBed]) -> None:
    """On the latency sandbox (the monitor's bookkeeping, not the model, is under test)."""
    bed = generation_bed(records=200, latency_ms=150, params={"generate.concurrency": 4, "generate.monitor.share": 1.0,
                                                               "generate.monitor.checkpoint_every": 4})  # fmt: skip
    ledger_path = bed.project.root / "state/ledger.sqlite"
    with bed.project.start("generate", "tiny", "--params", "params.yaml") as process:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sum(len(s["path"]) for s in monitor_states(ledger_path).values()) < 20:
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)
    before = monitor_states(ledger_path)
    assert sum(len(s["path"]) for s in before.values()) >= 20, "killed before the monitors saved anything"
    assert len(bed.records()) < 200, "the run finished before the kill: nothing was resumed"

    done = bed.generate()
    assert done.returncode == 0, done.stdout + done.stderr
    after = monitor_states(ledger_path)
    for tag, state in before.items():
        resumed = after[tag]
        assert resumed["path"][: len(state["path"])] == state["path"]  # the saved past is kept, not restarted
        assert resumed["served"] > state["served"]
        indices = [i for i, _ in resumed["path"]]
        assert indices == sorted(set(indices))
        assert resumed["stopped"] is None
    assert len(bed.records()) == 200


def monitor_states(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    ledger = SqliteLedger(path)
    try:
        return {tag: state for (_, tag), state in ledger.monitor_states("fixture").items()}
    finally:
        ledger.close()
