"""``quanthunt compare`` on a real MLflow store: runs of one stage side by side, each
column named by stage, dataset and run id, params diffed only within that stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from quanthunt.cli import app
from quanthunt.params import load_params
from quanthunt.tracking import stage_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A params file and an MLflow store holding, oldest first: two survey runs with
    different budgets (the second under an experiment name, as ``dvc exp run`` sets it),
    then validate runs of datasets chat and code with different
    ``validate.max_truncated_share``."""
    for name in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "QUANTHUNT_PIPELINE_ID"):
        monkeypatch.delenv(name, raising=False)
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    params_path = tmp_path / "params.yaml"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for usd, exp_name in ((100.0, None), (50.0, "beige-yate")):
        if exp_name:
            monkeypatch.setenv("DVC_EXP_NAME", exp_name)
        raw["survey"]["budget"]["usd"] = usd
        params_path.write_text(yaml.safe_dump(raw))
        params = load_params(params_path)
        with stage_run("survey", params=params, section=params.survey, root=tmp_path, experiment="quanthunt") as run:
            run.log_metrics({"candidates": 6})
    monkeypatch.delenv("DVC_EXP_NAME")
    for dataset, records, share in (("chat", 20, 0.5), ("code", 18, 0.25)):
        raw["validate"]["max_truncated_share"] = share
        params_path.write_text(yaml.safe_dump(raw))
        params = load_params(params_path)
        with stage_run("validate", params=params, section=params.validate_, root=tmp_path, experiment="quanthunt") as run:
            run.set_tags({"dataset": dataset, "status": "passed"})
            run.log_metrics({"records": records})
    return params_path


def compare(params_path: Path, *args: str) -> str:
    done = CliRunner().invoke(app, ["compare", "--params", str(params_path), *args])
    assert done.exit_code == 0, done.output
    return done.output


def test_default_compares_the_latest_stage_only(store: Path) -> None:
    runs = json.loads(compare(store, "--json"))
    assert [(r["stage"], r["dataset"]) for r in runs] == [("validate", "code"), ("validate", "chat")]
    table = compare(store)
    assert "2 run(s) of stage validate" in table
    for run in runs:
        assert f"validate@{run['dataset']} {run['run_id'][:8]}" in table
    assert "survey" not in table
    assert "budget.usd" not in table  # survey's params are not diffed against validate's
    (row,) = [line for line in table.splitlines() if "param max_truncated_share" in line]
    assert "0.25" in row and "0.5" in row
    assert "metric records" in table


def test_stage_and_dataset_choose_the_runs(store: Path) -> None:
    table = compare(store, "--stage", "survey")
    assert "2 run(s) of stage survey" in table
    (row,) = [line for line in table.splitlines() if "param budget.usd" in line]
    assert "100.0" in row and "50.0" in row
    (row,) = [line for line in table.splitlines() if "dvc.exp_name" in line]  # the experiment beside its baseline
    assert "beige-yate" in row
    assert "validate" not in table and "max_truncated_share" not in table
    runs = json.loads(compare(store, "--stage", "validate", "--dataset", "chat", "--json"))
    assert [(r["stage"], r["dataset"], r["metrics"]["records"]) for r in runs] == [("validate", "chat", 20.0)]
