"""What ties one pipeline run's stages together in MLflow, and how a run's owner is told
alive from dead (the stage runs themselves: ``tests/stages``)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from quanthunt import interrupts
from quanthunt.errors import ConfigError
from quanthunt.params import load_params
from quanthunt.tracking import Invocation, pipeline_invocation, process_gone, process_identity, stage_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_pipeline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QUANTHUNT_PIPELINE_ID", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(name, raising=False)


def test_the_explicit_id_wins_over_a_dvc_experiment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_EXP_NAME", "beige-tarp")
    monkeypatch.setenv("QUANTHUNT_PIPELINE_ID", "make-run-1733300000-42")
    assert pipeline_invocation() == Invocation("make-run-1733300000-42", is_dvc_process=False)


def test_a_dvc_experiment_names_the_invocation_with_its_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_EXP_NAME", "beige-tarp")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "0123456789abcdef0123")
    assert pipeline_invocation() == Invocation("dvc-exp:0123456789ab:beige-tarp", is_dvc_process=False)


def test_outside_any_pipeline_there_is_no_invocation() -> None:
    assert pipeline_invocation() is None  # pytest does not run under a dvc process


@pytest.mark.parametrize("bad", ["it's", "a b", "x" * 201, "line\nbreak"])
def test_an_id_that_cannot_go_into_a_search_filter_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("QUANTHUNT_PIPELINE_ID", bad)
    with pytest.raises(ConfigError, match=r"^QUANTHUNT_PIPELINE_ID: ") as info:
        pipeline_invocation()
    assert bad not in str(info.value)


def test_a_finished_process_is_gone_and_a_live_one_is_not() -> None:
    assert not process_gone(process_identity())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(child.pid)
    child.wait()
    assert process_gone(identity)
    assert not process_gone("another-host:1:1")  # cannot be told from here: never declared dead


def test_a_stop_whose_interrupt_was_dropped_still_ends_the_run_killed(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python drops an exception raised inside a finaliser: SIGTERM landing in
    ``BaseEventLoop.__del__`` let a survey run on to its end and close FINISHED (1 run in 4
    of ``test_sigterm_ends_the_stage_run_killed_at_once``). The signal's record decides."""
    for name in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(interrupts, "_received", [])
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    params = load_params(REPO / "params.yaml")
    stage = stage_run("survey", params=params, section=params.survey, root=tmp_path, experiment="quanthunt")
    with stage as run, contextlib.suppress(KeyboardInterrupt):  # as the finaliser swallowed it
        interrupts.interrupt(signal.SIGTERM, None)
    assert interrupts.received() == ("SIGTERM",)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    stopped = client.get_run(run.run_id)
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags["quanthunt.error"] == "stopped by Ctrl-C or SIGTERM"
    monkeypatch.setattr(interrupts, "_received", [])
    with stage_run("survey", params=params, section=params.survey, root=tmp_path, experiment="quanthunt") as later:
        pass
    assert client.get_run(later.run_id).info.status == "FINISHED"
