"""The operator's day, through the real CLI: stop a run with Ctrl-C or SIGTERM, change the
sampling params as a DVC experiment, mistype the roster, lose the gateway — and lose no
money, no output and no metrics of the last good run."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from typing import Any

import yaml
from fixtures.generation import GenerationBed
from fixtures.project import Project

RESUME = "resume with `quanthunt generate tiny --params params.yaml`"


def start(bed: GenerationBed) -> Any:
    """``quanthunt generate`` as a terminal runs it: the leader of its own process group."""
    return bed.project.start("generate", "tiny", "--params", "params.yaml")


def wait_for_records(bed: GenerationBed, count: int, proc: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(bed.records()) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "generation never got under way"
        time.sleep(0.1)


def attempts(bed: GenerationBed) -> list[tuple[str, int, str | None]]:
    """The ledger's attempts (none before the run has made its tables: CI once polled the
    file between its creation and the schema's, ``no such table: attempts``)."""
    if not (bed.project.root / "state/ledger.sqlite").exists():
        return []
    db = sqlite3.connect(bed.project.root / "state/ledger.sqlite")
    try:
        return db.execute("SELECT record_id, turn, outcome FROM attempts").fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        db.close()


def test_ctrl_c_stops_sending_lets_in_flight_finish_and_resumes(generation_bed: Callable[..., GenerationBed]) -> None:
    bed = generation_bed(records=200, latency_ms=1500, params={"generate.concurrency": 8, "generate.request_timeout_s": 30})
    proc = start(bed)
    wait_for_records(bed, 4, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C at the terminal sends: the whole group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted by SIGINT: ") and RESUME in last, last
    rows = attempts(bed)
    assert all(outcome is not None for _, _, outcome in rows), "a request was left in flight: the grace was not given"
    assert all(outcome != "unknown" for _, _, outcome in rows), "an in-flight request was abandoned, not finished"
    assert bed.sandbox.pid is not None and bed.sandbox._proc is not None and bed.sandbox._proc.poll() is None
    assert not bed.output.exists(), "an unfinished run published its output"
    assert not (bed.project.root / "reports/generate/tiny.json").exists(), "an unfinished run wrote the metrics"

    sent = len(rows)
    bed.project.set_param("generate.concurrency", 64)  # the resume need not wait its turn 8 at a time (37 s)
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in bed.records()]
    assert len(ids) == len(set(ids)) == 200
    assert bed.output.read_bytes() == bed.working.read_bytes()  # type: ignore[union-attr]
    assert len(attempts(bed)) - sent >= 200 - len(set(r for r, _, _ in rows))


def test_sigterm_is_a_first_ctrl_c(generation_bed: Callable[..., GenerationBed]) -> None:
    bed = generation_bed(records=200, latency_ms=1500, params={"generate.concurrency": 8, "generate.request_timeout_s": 30})
    proc = start(bed)
    wait_for_records(bed, 4, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted by SIGTERM: ")
    assert all(outcome not in (None, "unknown") for _, _, outcome in attempts(bed))


def test_a_second_ctrl_c_cuts_in_flight_requests_and_provenance_counts_them(
    generation_bed: Callable[..., GenerationBed],
) -> None:
    bed = generation_bed(records=40, latency_ms=4000, params={"generate.concurrency": 8, "generate.request_timeout_s": 30,
                                                               "generate.ramp_up_s": 0})  # fmt: skip
    proc = start(bed)
    deadline = time.monotonic() + 60
    while not any(outcome is None for _, _, outcome in attempts(bed)):  # requests in flight
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - started < 4, "the second Ctrl-C waited for the requests in flight"
    assert "were cut off" in stderr.strip().splitlines()[-1]
    cut = {(r, t) for r, t, outcome in attempts(bed) if outcome is None}
    assert cut, "nothing was in flight when the run was cut off: the test proves nothing"

    bed.project.set_param("generate.concurrency", 64)  # the resume need not wait its turn 8 at a time
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    by_turn: dict[tuple[str, int], list[str]] = {}
    for record_id, turn, outcome in attempts(bed):
        by_turn.setdefault((record_id, turn), []).append(str(outcome))
    for record in bed.records():
        for turn, provenance in enumerate(record["provenance"]["turns"]):
            ledger = by_turn[record["id"], turn]
            assert provenance["attempts"] == len(ledger), (record["id"], turn, provenance, ledger)
            assert provenance["attempts_by_billing"]["possibly_billed"] == ledger.count("unknown")
        assert record["provenance"]["attempts"] == sum(t["attempts"] for t in record["provenance"]["turns"])
    assert any(t["attempts_by_billing"]["possibly_billed"] for r in bed.records() for t in r["provenance"]["turns"])


def test_unreachable_gateway_is_a_fast_exit_2_that_keeps_the_last_good_run(
    generation_bed: Callable[..., GenerationBed],
) -> None:
    bed = generation_bed(records=6)
    assert bed.generate().returncode == 0
    metrics = bed.project.root / "reports/generate/tiny.json"
    before = (metrics.read_bytes(), bed.output.read_bytes())
    bed.project.set_param("api.base_url", "http://127.0.0.1:9/api/v1")
    bed.project.set_param("generate.monitor.share", 0)
    started = time.monotonic()
    done = bed.generate()
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: api.base_url: cannot reach the gateway at http://127.0.0.1:9/api/v1")
    )
    assert time.monotonic() - started < 30
    assert (metrics.read_bytes(), bed.output.read_bytes()) == before


def test_bad_prompts_are_named_before_a_sandbox_starts(generation_bed: Callable[..., GenerationBed]) -> None:
    bed = generation_bed(records=3)
    bed.project.set_param("api.base_url", "sandbox")
    bed.project.set_param("reference.base_url", "sandbox")
    prompts = bed.project.root / "data/prompts/tiny.jsonl"
    prompts.write_text(prompts.read_text() + "{not json\n")
    started = time.monotonic()
    done = bed.generate()
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"error: {prompts}:4: not valid JSON")
    assert not (bed.project.root / "logs/sandbox-generate-tiny.log").exists(), "a sandbox was started first"
    assert time.monotonic() - started < 15


def test_a_roster_typo_is_named_by_every_stage(project: Project) -> None:
    roster = yaml.safe_load((project.root / "src/quanthunt/sandbox/roster.yaml").read_text())
    del roster["providers"][0]["precision"]
    (project.root / "roster.yaml").write_text(yaml.safe_dump(roster))
    project.set_param("sandbox.roster", "roster.yaml")
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: {project.root / 'roster.yaml'}: providers.0.precision: Field required"


def test_sampling_params_are_an_experiment_axis(generation_bed: Callable[..., GenerationBed]) -> None:
    """``dvc exp run -S generate.sampling.temperature=0.8`` makes a second dataset beside
    the first (nothing reused), ``dvc exp show`` puts the two side by side, and going back
    to the first params gives back the first output byte for byte. Survey and verify are
    stood in for (committed as they are: ``dvc commit``); calibrate (no controls: the shipped
    margins), generate and validate run for real."""
    bed = generation_bed(records=6)
    project = bed.project
    root = project.root
    for path in ("reports/verify/report.html", "reports/verify/metrics.json", "reports/verify/plots/.keep"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("{}\n")
    git = ["git", "-C", str(root)]

    def dvc(*args: str) -> subprocess.CompletedProcess[str]:
        done = project.dvc(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    dvc("repro", "calibrate")
    dvc("commit", "--force", "survey", "verify")
    dvc("repro", "validate@tiny")
    subprocess.run([*git, "add", "-A"], check=True, env=project.env)
    subprocess.run([*git, "commit", "-qm", "baseline"], check=True, env=project.env)
    first = bed.output.read_bytes()

    dvc("exp", "run", "-S", "generate.sampling.temperature=0.8", "validate@tiny")
    second = [json.loads(line) for line in bed.output.read_text().splitlines()]
    assert len(second) == 6 and {r["provenance"]["sampling"]["temperature"] for r in second} == {0.8}
    assert len(list((root / "state/generating").glob("tiny-*.jsonl"))) == 2

    text = dvc("exp", "show", "--no-pager", "--md").stdout
    assert "0.8" in text and "0.7" in text and "records_done" in text

    subprocess.run([*git, "checkout", "-q", "--", "params.yaml"], check=True, env=project.env)
    dvc("repro", "validate@tiny")
    assert bed.output.read_bytes() == first  # the first params' dataset, unchanged and not bought again
