"""The verify stage end to end on the real model: a small roster whose truth is known,
verdicts that match it (the sample-mode provider audited in rounds until it is decided),
and the same verdicts when run again with the same params."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import yaml
from fixtures.controls import control, sampled
from fixtures.params import changed
from fixtures.project import Project
from fixtures.sandbox import AUTH, roster_dict
from fixtures.sandbox import provider as roster_provider

from quanthunt.calibration_run import Key, calibrated
from quanthunt.params import load_params
from quanthunt.sandbox.server import SandboxProcess

pytestmark = pytest.mark.model

PRICES = {"prompt": "0.0000006", "completion": "0.0000025"}
ROSTER = {
    "providers": [
        {"name": "Moonshot AI", "slug": "moonshotai", "tag": "moonshotai/int4", "quantization": "int4",
         "precision": "int4-native", "pricing": PRICES},
        {"name": "Fireworks", "slug": "fireworks", "tag": "fireworks/int4", "quantization": "int4",
         "precision": "int4-bf16act", "logprobs_mode": "processed_logprobs", "pricing": PRICES},
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
    project.set_param("verify.decision.mixture_detection_tokens", 16)  # accept the 64-token rates: mechanics, not power
    project.set_param("verify.decision.mixture_detection_sample", 0.9)  # ... and a short sample-mode audit
    project.set_param("verify.probes.sample_mode_completions_per_prompt", 4)
    project.set_param("verify.margin.sampler_equivalence", 0.15)  # faithful shown so in ~6 rounds, not ~12
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
    # Fireworks reports logprobs after temperature: at the audit's T 1 the same numbers; asked at
    # the generation's 0.7 too, its logprobs read as processed (the monitor reads them so).
    assert by_name["Fireworks"]["logprobs_reading"]["read_as"] == "processed"
    assert by_name["Moonshot AI"]["logprobs_reading"]["read_as"] == "raw" and by_name["Novita"]["logprobs_reading"] is None
    for name in ("Moonshot AI", "Fireworks", "Chutes"):
        reading = by_name[name]["logprobs_reading"]
        assert reading["temperature"] == 0.7 and reading["replies"] == reading["asked"] == 2, reading
    assert by_name["Chutes"]["verdict"] == "different" and not by_name["Chutes"]["eligible"]
    novita = by_name["Novita"]
    assert novita["mode"] == "sample" and novita["verdict"] == "equivalent", novita["reason"]
    assert novita["rounds"] > by_name["Chutes"]["rounds"] == 1  # decided providers stop; the undecided get more probes
    assert len(verdicts["probe_ids"]) == 8 * max(p["rounds"] for p in verdicts["providers"])
    assert novita["completions"] == len(novita["e_path"]) and novita["power"]["mixture"] >= 0.95
    assert verdicts["cost_usd"] == pytest.approx(sum(p["cost_usd"] for p in verdicts["providers"]))
    assert verdicts["calibration"]["measured_for_model"] is True  # the sandbox's model: the margins' own
    for provider in verdicts["providers"]:
        assert provider["mlflow_run_id"]
        # Every completion asked for is measured or reported unusable with its reason (a
        # coarse provider's first token may not pair: counted, never dropped).
        asked = 8 * provider["rounds"] * (1 if provider["mode"] == "logprob" else 4)
        assert provider["completions"] + sum(provider["unusable"].values()) == asked, provider
        assert provider["failed_requests"] == sum(provider["unusable"].values()), provider
        if provider["mode"] == "logprob":
            replies = provider["completions"] + provider["failed_requests"] + provider["logprobs_reading"]["asked"]
            assert provider["served_by"] == {provider["provider"]: replies}
    assert (small.root / "reports/verify/plots/chutes-unknown.png").read_bytes()[:4] == b"\x89PNG"
    assert "Chutes" in (small.root / "reports/verify/report.html").read_text()

    client = small.mlflow()
    runs = client.search_runs(
        [client.get_experiment_by_name("quanthunt").experiment_id], filter_string="tags.`quanthunt.stage` = 'verify'"
    )
    (stage,) = runs
    nested = client.search_runs([stage.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{stage.info.run_id}'")
    assert sorted(r.data.tags["provider"] for r in nested) == ["Chutes", "Fireworks", "Moonshot AI", "Novita"]

    # A rerun (say after a changed margin) buys nothing it bought already: every probe reply
    # comes from the ledger (quanthunt.paid_replies), so the logprob-mode verdicts are the
    # same measurements. The sample-mode provider's reference samples are drawn again
    # (the reference is free), and batching may flip one of their tokens at a near-tie
    # (tests/sandbox/test_sampler.py): the round it is decided in may move by one.
    again = small.run("verify", "--params", "params.yaml")
    assert again.returncode == 0, again.stderr
    assert "were bought by an earlier run within verify.reuse_paid_replies_h and used again" in again.stderr
    repeat = json.loads((small.root / "reports/verify/verdicts.json").read_text())
    shorter, longer = sorted((verdicts["probe_ids"], repeat["probe_ids"]), key=len)
    assert longer[: len(shorter)] == shorter and len(longer) - len(shorter) <= 8
    assert [(p["provider"], p["verdict"]) for p in repeat["providers"]] == [
        (p["provider"], p["verdict"]) for p in verdicts["providers"]
    ]
    for first_run, second in zip(verdicts["providers"], repeat["providers"], strict=True):
        replies = first_run["completions"] + first_run["failed_requests"] + convention_asked(first_run)
        if second["rounds"] <= first_run["rounds"]:  # nothing new to buy
            assert second["reused_cost_usd"] == second["cost_usd"] > 0, second
            bought = second["completions"] + second["failed_requests"] + convention_asked(second)
            assert second["reused_replies"] == bought, second
        if first_run["mode"] == "logprob":
            assert (second["rounds"], second["reused_replies"], second["cost_usd"]) == (
                first_run["rounds"],
                replies,
                first_run["cost_usd"],
            )
            for name, effect in first_run["effects"].items():
                assert second["effects"][name]["value"] == pytest.approx(effect["value"], rel=1e-3, abs=1e-6), name
        else:
            for name, effect in first_run["effects"].items():
                assert effect["ci_low"] - 1e-9 <= second["effects"][name]["value"] <= effect["ci_high"] + 1e-9, name
    assert repeat["reused_cost_usd"] == pytest.approx(sum(p["reused_cost_usd"] for p in repeat["providers"]))
    assert "bought by an earlier run and used again" in (small.root / "reports/verify/report.html").read_text()


def convention_asked(verdict: dict[str, Any]) -> int:
    """Requests asked at the generation's temperature for how the provider reports logprobs."""
    reading = verdict["logprobs_reading"]
    return int(reading["asked"]) if reading else 0


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


def test_a_reference_that_cannot_score_is_named_before_any_paid_request(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    """Pointed at a server that is no reference deployment (here an OpenRouter API: it lists
    models but has no tokenize route), verify stops with one line naming the reference and
    the routes it tried, exit 2, before a single chat request is sent (before: every probe
    was bought, then every provider ended ``inconclusive``)."""
    sandbox = latency_sandbox(roster_dict(roster_provider("alpha"), roster_provider("beta")))
    project.set_param("api.base_url", sandbox.api_url)
    project.set_param("reference.base_url", sandbox.api_url)
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert sandbox.api_url in last and "POST /api/tokenize answered 404" in last and "POST /api/v1/tokenize answered 404" in last
    assert httpx.get(f"{sandbox.api_url}/sandbox/stats", headers=AUTH).json()["requests"] == 0
    assert not (project.root / "reports/verify/verdicts.json").exists()


def reasoning_sandbox(project: Project, start: Callable[..., SandboxProcess], **profile: object) -> SandboxProcess:
    """A latency-mode gateway and reference whose model thinks (the reasoning profile)."""
    model = {"reasoning": {"think_tokens": 3, **profile}}
    providers = (roster_provider("alpha"), roster_provider("beta", supports_logprobs=False))
    sandbox = start(roster_dict(*providers, model=model))
    project.set_param("api.base_url", sandbox.api_url)
    project.set_param("reference.base_url", sandbox.reference_url)
    project.set_param("verify.probes.prompts", 12)
    return sandbox


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_reasoning_model_is_audited_over_the_stream_it_was_asked_for(
    project: Project, latency_sandbox: Callable[..., SandboxProcess], mode: str
) -> None:
    """Thinking off: the gateway is asked for no reasoning and the reference renders the
    template with thinking off; on: reasoning, the end of the thinking block and the answer
    are scored as one stream. Either way every probe pairs and none fails."""
    reasoning_sandbox(project, latency_sandbox)
    project.set_param("reasoning.mode", mode)
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    verdicts = json.loads((project.root / "reports/verify/verdicts.json").read_text())
    for audited in verdicts["providers"]:
        assert audited["failed_requests"] == 0 and audited["errors"] == {}, audited
        assert audited["completions"] >= 12, audited
    logprob = next(p for p in verdicts["providers"] if p["mode"] == "logprob")
    assert logprob["verdict"] == "equivalent", logprob["reason"]  # synthetic logprobs: identical once paired


@pytest.mark.parametrize(
    ("mode", "mandatory", "message"),
    [
        ("none", False, "is a reasoning model"),
        ("off", True, "reasoning is mandatory (it cannot be turned off): use on"),
    ],
)
def test_a_reasoning_mode_that_does_not_fit_the_model_stops_the_survey(
    project: Project, latency_sandbox: Callable[..., SandboxProcess], mode: str, mandatory: bool, message: str
) -> None:
    reasoning_sandbox(project, latency_sandbox, mandatory=mandatory)
    project.set_param("reasoning.mode", mode)
    done = project.run("survey", "--params", "params.yaml")
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]


def test_adding_a_dataset_buys_only_its_probes(project: Project) -> None:
    """Issue 26: probes were drawn across every dataset, so one more dataset re-bought the
    whole audit. Now the plan keeps each dataset's seeded order (a prefix of it in each
    round) and the ledger answers every request bought before: a rerun buys the new
    dataset's probes, and others only for rounds the first run had not reached."""
    roster = {"providers": [ROSTER["providers"][0], ROSTER["providers"][2]]}  # faithful, and NVFP4 (decided at once)
    (project.root / "roster.yaml").write_text(yaml.safe_dump(roster))
    project.set_param("sandbox.roster", "roster.yaml")
    project.set_param("verify.probes.prompts", 8)
    project.set_param("verify.probes.max_tokens", 16)
    project.set_param("verify.decision.mixture_detection_tokens", 16)
    project.set_param("verify.margin.sampler_equivalence", 0.15)
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    first = project.run("verify", "--params", "params.yaml")
    assert first.returncode == 0, first.stderr
    before = json.loads((project.root / "reports/verify/verdicts.json").read_text())

    code = (project.root / "data/prompts/code.jsonl").read_text().splitlines()
    extra = [json.loads(line) | {"id": f"x{i}"} for i, line in enumerate(code[:20])]
    (project.root / "data/prompts/extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in extra))
    project.set_param("datasets", [*project.params()["datasets"], "extra"])
    again = project.run("verify", "--params", "params.yaml")
    assert again.returncode == 0, again.stderr
    after = json.loads((project.root / "reports/verify/verdicts.json").read_text())

    with sqlite3.connect(project.root / "state/ledger.sqlite") as db:
        rows = db.execute("SELECT tag, probe_id, run_id FROM probe_replies").fetchall()
    rounds = {p["tag"]: (b["rounds"], p["rounds"]) for b, p in zip(before["providers"], after["providers"], strict=True)}
    bought = [(tag, probe) for tag, probe, run in rows if run == after["verification_run_id"]]
    assert any(probe.startswith("extra:") for _, probe in bought)
    for tag, probe in bought:
        assert probe not in before["probe_ids"][: rounds[tag][0] * 8], (tag, probe)  # never bought twice
        if rounds[tag][1] <= rounds[tag][0]:  # no round the first run had not reached
            assert probe.startswith("extra:"), (tag, probe)
    asked = sum(p["completions"] + p["failed_requests"] + convention_asked(p) for p in after["providers"])  # none failed here
    assert asked - sum(p["reused_replies"] for p in after["providers"]) == len(bought) < asked
    assert [p["verdict"] for p in after["providers"]] == [p["verdict"] for p in before["providers"]]


def test_verify_decides_with_the_calibrated_margins_and_refuses_a_calibration_of_another_reference(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    """The calibration is checked against the reference before a probe is bought (the
    gateway has served no request), and once it fits, the verdicts record the margins they
    were decided with and the control they were measured on (what generate's monitor and
    the report then use)."""
    sandbox = latency_sandbox(roster_dict(roster_provider("alpha"), roster_provider("beta")))
    project.set_param("api.base_url", sandbox.api_url)
    project.set_param("reference.base_url", sandbox.reference_url)
    project.set_param("verify.probes.prompts", 12)
    assert project.run("survey", "--params", "params.yaml").returncode == 0
    params = load_params(project.params_path)
    model = httpx.get(f"{sandbox.reference_url}/models").json()["data"][0]["id"]
    server = httpx.get(f"{sandbox.reference_url.removesuffix('/v1')}/version").json()["version"]
    margin = changed(params.verify.margin, mean_abs_dlogprob=0.11, tail_p0=0.02)
    measured = calibrated(params, Key.of(params).model_copy(update={"reference_model": model, "reference_server": "0.1.0"}),
                          {"second-box": ("https://box.example/v1", control("second-box", 0.01))}, None,
                          {"second-box": sampled("second-box", z_mean=0.3)})  # fmt: skip
    path = project.root / params.paths.calibration
    path.parent.mkdir(parents=True)
    path.write_text(measured.model_copy(update={"margin": margin}).model_dump_json())

    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 2
    assert f"calibrated against reference {model} (server 0.1.0)" in done.stderr and f"(server {server})" in done.stderr
    assert httpx.get(f"{sandbox.api_url}/sandbox/stats", headers=AUTH).json()["requests"] == 0
    assert not (project.root / params.paths.verdicts).exists()

    fitting = measured.model_copy(update={"margin": margin, "key": measured.key.model_copy(update={"reference_server": server})})
    path.write_text(fitting.model_dump_json())
    done = project.run("verify", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    calibration = json.loads((project.root / params.paths.verdicts).read_text())["calibration"]
    assert calibration["margin"] == margin.model_dump() and calibration["measured_for_model"] is True
    assert calibration["measured_on"].endswith("second-box") and "second-box (288 completions)" in calibration["note"]
    assert measured.generation is not None  # the monitor's margins at the generation's settings travel with the verdicts
    assert calibration["monitor_margin"] == measured.generation.margin.model_dump() != calibration["margin"]
    assert measured.generation.settings["temperature"] == 0.7
    assert calibration["monitor_settings"] == measured.generation.settings
