"""The fault matrix: every stage that talks to a gateway (survey, verify, generate) ×
every fault the roster can inject, against a latency-mode sandbox over loopback. Each
stage either completes correctly or stops with its documented exit code and a one-line
message; afterwards outputs, ledger and MLflow agree, and a rerun completes."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
from fixtures.generation import GenerationBed
from fixtures.project import Project
from fixtures.sandbox import provider

from quanthunt.sandbox.roster import FAULT_KINDS
from quanthunt.sandbox.server import SandboxProcess

GATEWAY_KINDS = tuple(k for k in FAULT_KINDS if k != "finish_error")
SURVEY_OUTPUTS = ("reports/survey/providers.csv", "reports/survey/budget_plan.json")
FAULT_TIMING = {"retry_after_s": 0.05, "timeout_s": 4}


def roster(**extra: Any) -> dict[str, Any]:
    faults = extra.pop("faults", {})
    return {
        "providers": [
            provider("alpha", faults={**FAULT_TIMING, **faults}),
            provider("beta", pricing={"prompt": "0.000001", "completion": "0.0000025"}, faults={**FAULT_TIMING, **faults}),
            provider("nolog", supports_logprobs=False),
        ],
        **extra,
    }


def point_at(project: Project, sandbox: SandboxProcess) -> None:
    project.set_param("api.base_url", sandbox.api_url)
    project.set_param("reference.base_url", sandbox.reference_url)


def last_line(done: Any) -> str:
    return str(done.stderr.strip().splitlines()[-1]) if done.stderr.strip() else ""


@pytest.mark.parametrize("kind", GATEWAY_KINDS)
def test_survey_retries_a_flaky_gateway(project: Project, latency_sandbox: Callable[..., SandboxProcess], kind: str) -> None:
    sandbox = latency_sandbox(roster(gateway_faults={kind: 0.3, **FAULT_TIMING}))
    point_at(project, sandbox)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    assert all((project.root / p).exists() for p in SURVEY_OUTPUTS)


@pytest.mark.parametrize("kind", ["unavailable", "connection_reset", "malformed_json"])
def test_survey_gives_up_cleanly_on_a_broken_gateway(
    project: Project, latency_sandbox: Callable[..., SandboxProcess], kind: str
) -> None:
    sandbox = latency_sandbox(roster(gateway_faults={kind: 1.0, **FAULT_TIMING}))
    point_at(project, sandbox)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    assert last_line(done).startswith("error: ") and "Traceback" not in done.stderr
    assert not any((project.root / p).exists() for p in SURVEY_OUTPUTS)
    runs = project.mlflow().search_runs([project.mlflow().get_experiment_by_name("quanthunt").experiment_id])
    assert [r.info.status for r in runs if r.data.tags.get("quanthunt.stage") == "survey"] == ["FAILED"]


def verify_project(project: Project, sandbox: SandboxProcess) -> None:
    point_at(project, sandbox)
    for key, value in {
        "verify.probes.prompts": 8,
        "verify.max_probes_per_provider": 8,  # one round: these tests are about faults, not power
        "verify.probes.sample_mode_completions_per_prompt": 2,
        "verify.probes.max_tokens": 8,
        "verify.decision.mixture_detection_tokens": 8,  # the rates as measured at 64 tokens: fine for fault tests
    }.items():
        project.set_param(key, value)
    assert project.run("survey", "--params", "params.yaml").returncode == 0


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_verify_under_provider_faults(project: Project, latency_sandbox: Callable[..., SandboxProcess], kind: str) -> None:
    sandbox = latency_sandbox(roster(faults={kind: 0.3}))
    verify_project(project, sandbox)
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    verdicts = json.loads((project.root / "reports/verify/verdicts.json").read_text())
    by_name = {p["provider"]: p for p in verdicts["providers"]}
    for name in ("Alpha", "Beta"):
        assert by_name[name]["verdict"] in ("equivalent", "inconclusive")  # faults never make a faithful provider "different"
        reason = by_name[name]["reason"]
        assert by_name[name]["verdict"] == "equivalent" or any(why in reason for why in ("failed", "power", "not shown")), reason
    assert by_name["Nolog"]["mode"] == "sample"


def test_verify_with_the_reference_down(project: Project, latency_sandbox: Callable[..., SandboxProcess]) -> None:
    sandbox = latency_sandbox(roster())
    verify_project(project, sandbox)
    project.set_param("reference.base_url", "http://127.0.0.1:9/v1")
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2
    assert last_line(done) == "error: cannot reach the reference deployment at 127.0.0.1:9"
    assert not (project.root / "reports/verify/verdicts.json").exists()


def test_verify_with_the_gateway_down_keeps_the_paid_verdicts(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    sandbox = latency_sandbox(roster())
    verify_project(project, sandbox)
    earlier = project.root / "reports/verify/verdicts.json"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    earlier.write_text('{"an earlier, paid audit": true}\n')
    project.set_param("api.base_url", "http://127.0.0.1:9/api/v1")
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2, done.stderr
    assert last_line(done).startswith("error: api.base_url: cannot reach the gateway at http://127.0.0.1:9/api/v1")
    assert "Traceback" not in done.stderr
    assert earlier.read_text() == '{"an earlier, paid audit": true}\n'


def test_verify_waits_out_a_reference_outage_and_blames_no_provider_for_it(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    """A reference that answers 503 for a while mid-audit (restarting, or stalled: a real
    vLLM beside the busy sandbox on a 2-core CI machine held a dozen scoring requests for
    minutes, and every provider it could not score came out inconclusive): every paid reply
    is scored once it is back, and no provider is charged with the reference's failures."""
    sandbox = latency_sandbox(roster(reference_outage={"after": 12, "requests": 40}))
    verify_project(project, sandbox)
    project.set_param("verify.reference_retry_for_s", 60)
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    verdicts = json.loads((project.root / "reports/verify/verdicts.json").read_text())
    for p in verdicts["providers"]:
        assert p["failed_requests"] == 0 and not p["unusable"] and not p["errors"], p
    assert "the reference failed 40 requests (http_503 ×40); each was retried until it answered" in done.stderr


def test_verify_stops_when_the_reference_stays_down_and_keeps_the_paid_verdicts(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    sandbox = latency_sandbox(roster(reference_outage={"after": 12}))
    verify_project(project, sandbox)
    project.set_param("verify.reference_retry_for_s", 2)
    earlier = project.root / "reports/verify/verdicts.json"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    earlier.write_text('{"an earlier, paid audit": true}\n')
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2, done.stderr
    line = last_line(done)
    assert line.startswith(f"error: reference {sandbox.reference_url.split('/')[2]} POST /reference/v1/completions answered 503")
    assert "still failing after 2 s of retries" in line and "of probe replies were bought" in line, line
    assert "Traceback" not in done.stderr and "exception" not in done.stderr.lower(), done.stderr
    assert earlier.read_text() == '{"an earlier, paid audit": true}\n'

    # What was bought before the reference went down is kept in the ledger, and the rerun
    # (the reference back, here another one) uses it instead of buying it again.
    with sqlite3.connect(project.root / "state/ledger.sqlite") as db:
        kept = db.execute("SELECT COUNT(*), SUM(cost_usd) FROM probe_replies").fetchone()
    assert kept[0] > 0 and "a rerun within verify.reuse_paid_replies_h (24 h) uses them" in line, line
    project.set_param("reference.base_url", latency_sandbox(roster()).reference_url)
    again = project.run("verify", "--params", "params.yaml")
    assert again.returncode == 0, again.stderr
    verdicts = json.loads(earlier.read_text())
    assert sum(p["reused_replies"] for p in verdicts["providers"]) == kept[0]
    assert verdicts["reused_cost_usd"] == pytest.approx(kept[1]) and verdicts["cost_usd"] >= kept[1]


def digests(project: Project, *folders: str) -> dict[str, str]:
    """sha256 of every file under ``folders`` of the project, by path."""
    return {
        str(p.relative_to(project.root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in folders
        for p in sorted((project.root / folder).rglob("*"))
        if p.is_file()
    }


def test_a_failed_stage_under_dvc_repro_keeps_the_survey_and_the_paid_audit(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    """DVC deletes a stage's outputs before it runs, unless they persist: a broken prompts
    line (verify fails) or an unreachable gateway (survey fails first) left the paid
    verdicts.json, its report and plots, and the survey's outputs deleted."""
    sandbox = latency_sandbox(roster())
    verify_project(project, sandbox)
    first = project.dvc("repro", "verify")
    assert first.returncode == 0, first.stdout + first.stderr
    kept = digests(project, "reports/survey", "reports/verify")
    assert "reports/verify/verdicts.json" in kept and any(p.endswith(".png") for p in kept)

    prompts = project.root / "data/prompts/code.jsonl"
    original = prompts.read_bytes()
    prompts.write_bytes(original + b'{"broken\n')
    done = project.dvc("repro", "verify")
    assert done.returncode != 0 and "data/prompts/code.jsonl" in done.stderr, done.stderr
    assert digests(project, "reports/survey", "reports/verify") == kept

    prompts.write_bytes(original)
    project.set_param("api.base_url", "http://127.0.0.1:9/api/v1")
    done = project.dvc("repro", "verify")
    assert done.returncode != 0 and "cannot reach" in done.stderr, done.stderr
    assert digests(project, "reports/survey", "reports/verify") == kept


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_generate_under_provider_faults(generation_bed: Callable[..., GenerationBed], kind: str) -> None:
    # A held reply is waited for request_timeout_s (2 s) plus max_tokens (48) at 10 tokens/s: hold it longer.
    bed = generation_bed(
        faults={kind: 0.3, "timeout_s": 10},
        records=12,
        params={"generate.retry.max_attempts": 10, "generate.sampling.max_tokens": 48},
    )
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in bed.records()]
    assert len(ids) == len(set(ids)) == 12
    settled, unknown = bed.ledger_spend()
    assert settled - 1e-9 <= bed.charged_usd() <= settled + unknown + 1e-9
    report = bed.detail()
    assert sum(report["errors"].values()) > 0  # the fault did fire


def test_generate_when_the_sandbox_dies_and_comes_back(generation_bed: Callable[..., GenerationBed]) -> None:
    import time

    bed = generation_bed(
        records=240,  # ~12 s of generation at 8 in flight: the kill lands mid-run
        latency_ms=400,
        params={"generate.concurrency": 8, "generate.retry.max_attempts": 3, "generate.retry.max_delay_s": 0.2},
    )
    proc = bed.project.start("generate", "tiny", "--params", "params.yaml")
    deadline = time.monotonic() + 60
    while len(bed.records()) < 8 and time.monotonic() < deadline:  # kill once generation is under way
        time.sleep(0.2)
    port = int(bed.sandbox.url.rsplit(":", 1)[1])
    bed.sandbox.kill()
    _, stderr = proc.communicate(timeout=120)
    # Unreachable is not out of money: a prompt exit 2 that says so and how to resume.
    assert proc.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert "the gateway cannot be reached" in last and "resume with `quanthunt generate tiny --params params.yaml`" in last
    partial = [r["id"] for r in bed.records()]
    assert len(partial) == len(set(partial)) < 240
    back = SandboxProcess(mode="latency", roster=bed.sandbox.roster, port=port).start()
    try:
        done = bed.generate()
        assert done.returncode == 0, done.stderr
        ids = [r["id"] for r in bed.records()]
        assert len(ids) == len(set(ids)) == 240
    finally:
        back.stop()
