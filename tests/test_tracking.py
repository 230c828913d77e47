"""What ties one pipeline run's stages together in MLflow, and how a run's owner is told
alive from dead (the stage runs themselves: ``tests/stages``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quanthunt.errors import ConfigError
from quanthunt.tracking import Invocation, pipeline_invocation, process_gone, process_identity


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
