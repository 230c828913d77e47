"""The calibrate stage on the sandbox: a faithful-but-noisy control (an fp8 KV cache) and a
coarse build (NVFP4) measured as verify measures providers, the file and MLflow run they
give, and verify refusing that calibration once a setting it was measured at changes."""

from __future__ import annotations

import json

from fixtures.params import SHIPPED
from fixtures.project import Project

CALIBRATION = SHIPPED.paths.calibration


def test_calibrate_bounds_the_margins_on_a_noisy_control_and_verify_refuses_it_for_other_settings(project: Project) -> None:
    project.set_param("calibrate.controls", {"fp8-kv": "sandbox:fp8-kv"})
    project.set_param("calibrate.coarse", "sandbox:coarse")
    project.set_param("calibrate.prompts", 8)
    project.set_param("calibrate.completions_per_prompt", 4)
    done = project.run("calibrate", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    assert "32 completions (≤ 64 tokens each) at each of 1 control(s) and the coarse build" in done.stderr
    assert "and 32 completions (≤ 64 tokens each) at each control at the generation's temperature 0.7" in done.stderr

    found = json.loads((project.root / CALIBRATION).read_text())
    assert found["measured"] and found["key"]["reference_server"].startswith("quanthunt-sandbox")
    (fp8,) = found["controls"]
    assert fp8["name"] == "fp8-kv" and fp8["url"] == "sandbox:fp8-kv"
    assert fp8["completions"] + sum(fp8["failed"].values()) == 32 and fp8["completions"] >= 26
    coarse = found["coarse"]
    assert coarse["mean_abs_dlogprob"] > 5 * fp8["mean_abs_dlogprob"] > 0  # NVFP4 is far coarser than the KV cache
    shipped, used = SHIPPED.verify.margin, found["margin"]
    assert used["mean_abs_dlogprob"] > shipped.mean_abs_dlogprob  # fp8 KV's noise is beyond the SmolLM2 margin
    assert used["tail_p0"] > 0.05  # 0 extreme of 32 bounds a faithful share only by ~15 % (one of 8 bounds at 95 %)
    assert all(used[name] >= value for name, value in shipped.model_dump().items())
    assert 0.5 < found["decision"]["mixture_detection_logprob"] < coarse["extreme_share"] <= 1.0  # its lower bound
    # the monitor's sampler margins: the same control ranked at the generation's T 0.7
    generation = found["generation"]
    assert generation["settings"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 384}
    (at_07,) = generation["controls"]
    assert at_07["name"] == "fp8-kv" and at_07["completions"] + sum(at_07["failed"].values()) == 32 and at_07["completions"] >= 26
    monitor = generation["margin"]
    assert monitor["sample_tail_p0"] >= used["sample_tail_p0"] and monitor["sampler_shift"] >= used["sampler_shift"]
    assert {k: v for k, v in monitor.items() if not k.startswith("sampler") and k != "sample_tail_p0"} == {
        k: v for k, v in used.items() if not k.startswith("sampler") and k != "sample_tail_p0"}  # fmt: skip
    assert "fp8-kv (" in found["note"] and "temperature 0.7" in found["note"]

    client = project.mlflow()
    (run,) = client.search_runs([client.get_experiment_by_name("quanthunt").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == found["run_id"]
    assert run.data.tags["dvc.stage"] == "calibrate" and run.data.tags["calibration_measured"] == "true"
    assert run.data.metrics["fp8-kv.mean_abs_dlogprob"] == used["mean_abs_dlogprob"]
    assert run.data.metrics["fp8-kv.sampler_shift.generation"] == monitor["sampler_shift"]
    assert "calibration.json" in {a.path for a in client.list_artifacts(run.info.run_id)}

    project.set_param("verify.probes.max_tokens", 96)  # other probes than the calibration measured
    before = (project.root / CALIBRATION).read_bytes()
    refused = project.run("verify", "--params", "params.yaml")
    assert refused.returncode == 2
    assert CALIBRATION in refused.stderr and "probes.max_tokens 64 (now 96)" in refused.stderr, refused.stderr
    assert "quanthunt calibrate" in refused.stderr
    assert not (project.root / SHIPPED.paths.verdicts).exists()
    assert (project.root / CALIBRATION).read_bytes() == before


def test_calibrate_without_controls_writes_the_shipped_values_saying_so(project: Project) -> None:
    done = project.run("calibrate", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    found = json.loads((project.root / CALIBRATION).read_text())
    assert not found["measured"] and found["bounds"] == [] and found["key"]["reference_model"] is None
    assert found["margin"] == SHIPPED.verify.margin.model_dump() and found["decision"] == SHIPPED.verify.decision.model_dump()
    assert "no control deployment" in found["note"] and "no control deployment" in done.stderr
