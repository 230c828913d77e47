"""The verify stage end to end on the real model: a small roster whose truth is known,
verdicts that match it, and the same verdicts when run again with the same params."""

from __future__ import annotations

import json

import pytest
import yaml
from fixtures.project import Project

pytestmark = pytest.mark.model

PRICES = {"prompt": "0.0000006", "completion": "0.0000025"}
ROSTER = {
    "providers": [
        {"name": "Moonshot AI", "slug": "moonshotai", "tag": "moonshotai/int4", "quantization": "int4",
         "precision": "int4-native", "pricing": PRICES},
        {"name": "Fireworks", "slug": "fireworks", "tag": "fireworks/int4", "quantization": "int4",
         "precision": "int4-bf16act", "pricing": PRICES},
        {"name": "Chutes", "slug": "chutes", "tag": "chutes/unknown", "quantization": "unknown",
         "precision": "nvfp4", "pricing": PRICES},
        {"name": "Novita", "slug": "novita", "tag": "novita/int4", "quantization": "int4",
         "precision": "int4-native", "supports_logprobs": False, "pricing": PRICES},
    ]
}  # fmt: skip


@pytest.fixture
def small(project: Project) -> Project:
    (project.root / "roster.yaml").write_text(yaml.safe_dump(ROSTER))
    project.set_param("sandbox.roster", "roster.yaml")
    project.set_param("verify.probes.prompts", 8)
    project.set_param("verify.probes.max_tokens", 16)
    project.set_param("verify.probes.sample_mode_completions_per_prompt", 2)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    return project


def test_verdicts_match_the_roster_and_repeat(small: Project) -> None:
    first = small.run("verify", "--params", "params.yaml")
    assert first.returncode == 0, first.stderr
    verdicts = json.loads((small.root / "reports/verify/verdicts.json").read_text())
    by_name = {p["provider"]: p for p in verdicts["providers"]}
    assert by_name["Moonshot AI"]["verdict"] == "equivalent" and by_name["Moonshot AI"]["eligible"]
    assert by_name["Fireworks"]["verdict"] == "equivalent"  # bf16 compute: faithful on other hardware
    assert by_name["Chutes"]["verdict"] == "different" and not by_name["Chutes"]["eligible"]
    assert by_name["Novita"]["mode"] == "sample" and by_name["Novita"]["verdict"] != "different"
    assert len(verdicts["probe_ids"]) == 8
    assert verdicts["cost_usd"] == pytest.approx(sum(p["cost_usd"] for p in verdicts["providers"]))
    for provider in verdicts["providers"]:
        assert provider["mlflow_run_id"]
        if provider["mode"] == "logprob":
            assert provider["served_by"] == {provider["provider"]: provider["completions"] + provider["failed_requests"]}
    assert (small.root / "reports/verify/plots/chutes.png").read_bytes()[:4] == b"\x89PNG"
    assert "Chutes" in (small.root / "reports/verify/report.html").read_text()

    client = small.mlflow()
    runs = client.search_runs(
        [client.get_experiment_by_name("quanthunt").experiment_id], filter_string="tags.`quanthunt.stage` = 'verify'"
    )
    (stage,) = runs
    nested = client.search_runs([stage.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{stage.info.run_id}'")
    assert sorted(r.data.tags["provider"] for r in nested) == ["Chutes", "Fireworks", "Moonshot AI", "Novita"]

    again = small.run("verify", "--params", "params.yaml")
    assert again.returncode == 0, again.stderr
    repeat = json.loads((small.root / "reports/verify/verdicts.json").read_text())
    assert repeat["probe_ids"] == verdicts["probe_ids"]
    assert [(p["provider"], p["verdict"]) for p in repeat["providers"]] == [
        (p["provider"], p["verdict"]) for p in verdicts["providers"]
    ]


def test_refuses_to_start_over_the_probe_budget(small: Project) -> None:
    small.set_param("verify.max_cost_usd", 1e-6)
    done = small.run("verify", "--params", "params.yaml")
    assert done.returncode == 2
    assert "exceeds verify.max_cost_usd" in done.stderr.strip().splitlines()[-1]
    assert not (small.root / "reports/verify/verdicts.json").exists()


def test_missing_survey_output_is_a_clear_error(project: Project) -> None:
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2
    assert "providers table not found; run the survey stage first" in done.stderr
