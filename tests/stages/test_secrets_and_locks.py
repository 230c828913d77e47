"""Secrets never reach anything a run writes or prints; one writer per dataset."""

from __future__ import annotations

import time
from collections.abc import Callable

from fixtures.generation import GenerationBed, write_prompts
from fixtures.project import PLANTED_KEY, Project
from fixtures.sandbox import provider

from quanthunt.sandbox.server import SandboxProcess


def test_a_planted_key_appears_nowhere(project: Project, latency_sandbox: Callable[..., SandboxProcess]) -> None:
    sandbox = latency_sandbox({"providers": [provider("alpha"), provider("beta", quantization="unknown", tag="beta/unknown")]})
    write_prompts(project.root / "data/prompts/tiny.jsonl", 8)
    settings = {
        "api.base_url": sandbox.api_url,
        "reference.base_url": sandbox.reference_url,
        "datasets": ["tiny"],
        "verify.probes.prompts": 8,
        "verify.max_probes_per_provider": 8,
        "verify.probes.completions_per_prompt": 12,  # one round of 96: enough to decide the latency providers
        "verify.margin.sampler_equivalence": 0.3,
        "verify.probes.max_tokens": 8,
        "verify.decision.mixture_detection_tokens": 8,
        "generate.max_records": None,
    }
    for key, value in settings.items():
        project.set_param(key, value)
    project.env["OPENROUTER_API_KEY"] = PLANTED_KEY
    done = project.dvc("repro")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (project.root / "data/final/tiny.jsonl").exists() and (project.root / "reports/index.html").exists()
    failed = project.run("generate", "nope", "--params", "params.yaml")  # an error message, for good measure
    assert failed.returncode == 2
    printed = done.stdout + done.stderr + failed.stdout + failed.stderr
    for needle in (PLANTED_KEY, PLANTED_KEY[:20]):
        assert needle not in printed
        assert project.files_containing(needle) == []  # mlflow.db, mlruns/, reports/, data/, state/, dvc.lock, .dvc/cache, logs


def test_one_writer_per_dataset(generation_bed: Callable[..., GenerationBed]) -> None:
    bed = generation_bed(records=200, latency_ms=1000, params={"generate.concurrency": 4})
    first = bed.project.start("generate", "tiny", "--params", "params.yaml")
    try:
        deadline = time.monotonic() + 60
        while not (bed.project.root / "state/locks/tiny.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        second = bed.generate(timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: quanthunt generate tiny is already running (pid {first.pid}); wait for it to finish or stop it"
        )
    finally:
        first.kill()
        first.wait()
    ids = [r["id"] for r in bed.records()]
    assert len(ids) == len(set(ids))
