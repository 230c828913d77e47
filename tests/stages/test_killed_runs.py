"""A stage killed mid-run leaves no MLflow run RUNNING forever: SIGTERM (a stop, like
Ctrl-C) ends its run KILLED on the way out, and after SIGKILL the next stage start ends
it KILLED."""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from fixtures.project import Project

from quanthunt.connection import SHARED_SANDBOX_ENV


def start(project: Project, *args: str) -> Any:
    return project.start(*args)


def running_run(project: Project, stage: str, proc: Any, *, timeout: float = 120) -> Any:
    """The stage's MLflow run once it is RUNNING (the stage is then mid-run)."""
    client = project.mlflow()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        experiment = client.get_experiment_by_name("quanthunt")
        if experiment is not None:
            runs = client.search_runs(
                [experiment.experiment_id],
                filter_string=f"tags.`quanthunt.stage` = '{stage}' and attributes.status = 'RUNNING'",
            )
            if runs:
                return runs[0]
        time.sleep(0.2)
    raise AssertionError(f"no RUNNING {stage} run within {timeout} s")


def status(project: Project, run_id: str) -> str:
    return str(project.mlflow().get_run(run_id).info.status)


@contextlib.contextmanager
def held_mid_run(project: Project, stage: str) -> Iterator[tuple[subprocess.Popen[str], Any]]:
    """Start ``stage`` and yield it with its RUNNING MLflow run while it waits, mid-run, on a
    shared sandbox that accepts and never answers (its request for a gateway), so a signal
    lands mid-run however fast the stage would otherwise be: a survey on the worker's shared
    sandbox finished before the tests saw it RUNNING, and one that started a sandbox of its
    own once finished before a SIGTERM landed (both under make test)."""
    shared = project.env[SHARED_SANDBOX_ENV]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        project.env[SHARED_SANDBOX_ENV] = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = start(project, stage, "--params", "params.yaml")
        run = running_run(project, stage, proc)
        assert select.select([silent], [], [], 60)[0], "the stage never asked the shared sandbox for a gateway"
        try:
            yield proc, run
        finally:
            project.env[SHARED_SANDBOX_ENV] = shared
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)


def test_sigkilled_stage_run_ends_killed_at_the_next_start(project: Project) -> None:
    with held_mid_run(project, "survey") as (proc, killed):
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert status(project, killed.info.run_id) == "RUNNING"  # nothing can close it on SIGKILL

    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    run = project.mlflow().get_run(killed.info.run_id)
    assert run.info.status == "KILLED"
    assert "killed" in run.data.tags["quanthunt.error"]
    experiment = project.mlflow().get_experiment_by_name("quanthunt")
    statuses = sorted(r.info.status for r in project.mlflow().search_runs([experiment.experiment_id]))
    assert statuses == ["FINISHED", "KILLED"]


def test_sigterm_ends_the_stage_run_killed_at_once(project: Project) -> None:
    with held_mid_run(project, "survey") as (proc, stopped):
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0, stdout + stderr
    run = project.mlflow().get_run(stopped.info.run_id)
    assert run.info.status == "KILLED", stderr
    assert run.data.tags["quanthunt.error"] == "stopped by Ctrl-C or SIGTERM"
