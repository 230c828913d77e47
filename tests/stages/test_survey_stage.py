"""The survey stage end to end: the CLI and `dvc repro` in a fresh project, its outputs,
its MLflow run, bad inputs, and the planted-key scan."""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable

from fixtures.project import Project

OUTPUTS = ("reports/survey/providers.csv", "reports/survey/budget_plan.json", "reports/survey/metrics.json")


def test_survey_writes_its_outputs_and_one_mlflow_run(project: Project, planted_key: Callable[[Project], str]) -> None:
    key = planted_key(project)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr

    with (project.root / OUTPUTS[0]).open() as fh:
        rows = {r["tag"]: r for r in csv.DictReader(fh)}
    assert rows["together/nvfp4"]["reason"] == "excluded: declared nvfp4"
    assert rows["deepinfra/fp4"]["reason"] == "excluded: declared fp4"
    assert rows["deepinfra/bf16"]["reason"] == "excluded: price above max"  # the same provider's other endpoint
    assert rows["deepinfra/fp4"]["provider"] == rows["deepinfra/bf16"]["provider"] == "DeepInfra"
    assert rows["atlascloud/int4"]["reason"] == "excluded: status -5"
    assert rows["chutes/unknown"]["reason"] == "candidate"  # declares unknown: verification decides
    assert rows["novita/int4"]["supports_logprobs"] == "False"
    assert "overrides apply" in rows["deepinfra/fp4"]["price_note"]
    plan = json.loads((project.root / OUTPUTS[1]).read_text())
    assert plan["candidates"] == 6
    assert [s["scenario"] for s in plan["scenarios"]] == ["cheapest", "median", "worst"]
    metrics = json.loads((project.root / OUTPUTS[2]).read_text())
    assert metrics["candidates"] == 6 and metrics["providers"] == 10

    client = project.mlflow()
    experiment = client.get_experiment_by_name("quanthunt")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["dvc.stage"] == "survey" and tags["git.dirty"] in ("true", "false") and len(tags["git.commit"]) == 40
    assert len(tags["quanthunt.params_sha256"]) == 64
    assert "chutes/unknown" in tags["candidates"].split(",")
    assert run.data.params["model"] == "huggingfacetb/smollm2-135m-instruct"
    assert run.data.params["budget.usd"] == "100.0"
    assert run.data.metrics["candidates"] == 6
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert "params.yaml" in inputs and len(inputs["params.yaml"].dataset.digest) > 8
    assert any(name.endswith("roster.yaml") for name in inputs)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"providers.csv", "budget_plan.json", "params.resolved.json"} <= artifacts

    assert project.files_containing(key) == []
    assert project.files_containing(key[:20]) == []
    assert key not in done.stdout + done.stderr


def test_unknown_model_fails_cleanly(project: Project) -> None:
    project.set_param("survey.model", "acme/no-such-model")
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "404" in lines[-1] and "acme/no-such-model" in lines[-1]
    assert "Traceback" not in done.stderr
    assert not any((project.root / p).exists() for p in OUTPUTS)
    (run,) = project.mlflow().search_runs([project.mlflow().get_experiment_by_name("quanthunt").experiment_id])
    assert run.info.status == "FAILED" and "acme/no-such-model" in run.data.tags["quanthunt.error"]


def test_unreachable_gateway_fails_cleanly(project: Project) -> None:
    project.set_param("api.base_url", "http://127.0.0.1:9/api/v1")
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: cannot reach 127.0.0.1:9: All connection attempts failed"
    assert not any((project.root / p).exists() for p in OUTPUTS)


def test_invalid_params_fail_before_anything_runs(project: Project) -> None:
    project.set_param("survey.budget.usd", -1)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: params.yaml: survey.budget.usd: Input should be greater than 0 (got -1)"
    project.set_param("survey.budget.usd", 100)
    project.set_param("survey.policy.allowed_quantizations", ["int4", "fp3"])
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2 and "unknown quantization 'fp3'" in done.stderr
    assert not (project.root / "mlflow.db").exists() or not any((project.root / p).exists() for p in OUTPUTS)


def test_dvc_repro_then_nothing_to_do(project: Project) -> None:
    first = project.dvc("repro", "survey")
    assert first.returncode == 0, first.stdout + first.stderr
    assert all((project.root / p).exists() for p in OUTPUTS)
    started = time.perf_counter()
    again = project.dvc("repro", "survey")
    elapsed = time.perf_counter() - started
    assert again.returncode == 0
    assert "didn't change" in again.stdout or "up to date" in again.stdout, again.stdout
    print(f"no-op dvc repro took {elapsed:.1f} s")  # the README quotes this; not asserted (noisy machine)

    client = project.mlflow()
    runs = client.search_runs([client.get_experiment_by_name("quanthunt").experiment_id])
    stage_runs = [r for r in runs if r.data.tags.get("quanthunt.stage") == "survey"]
    parents = [r for r in runs if r.data.tags.get("quanthunt.kind") == "pipeline"]
    assert len(stage_runs) == 1 and len(parents) == 1
    assert stage_runs[0].data.tags["mlflow.parentRunId"] == parents[0].info.run_id


def test_compare_shows_runs_with_different_params(project: Project) -> None:
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    project.set_param("survey.policy.min_uptime", 99.5)
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    shown = project.run("compare", "--stage", "survey", "--json", "--params", "params.yaml")
    assert shown.returncode == 0, shown.stderr
    runs = json.loads(shown.stdout)
    assert [r["params"]["policy.min_uptime"] for r in runs] == ["99.5", "90.0"]
    assert [r["metrics"]["candidates"] for r in runs] == [4.0, 6.0]  # Parasail (99.1) and Chutes (97.5) drop out
    table = project.run("compare", "--stage", "survey", "--params", "params.yaml")
    assert "param policy.min_uptime" in table.stdout and "99.5" in table.stdout
