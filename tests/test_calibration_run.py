"""The calibration file's contract: margins bounded on controls reach verify (and through
the verdicts generate and report) only for the settings they were measured at; every
refusal names the file and what differs. (``tests/test_calibration.py`` tests the bounds themselves; the stage on the
sandbox: ``tests/stages/test_calibrate_stage.py``.)"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fixtures.controls import coarse, control, sampled
from fixtures.params import SHIPPED, changed

from quanthunt.calibration import Faithful, Sampled
from quanthunt.calibration_run import (
    Completions,
    Key,
    SamplerCompletions,
    applied,
    calibrated,
    check_reference,
    deployment_url,
    metric_name,
    reach,
    shipped,
)
from quanthunt.errors import ConfigError
from quanthunt.params import Params
from quanthunt.reference import Reference
from quanthunt.verdicts import Calibration

REFERENCE_URL = "http://127.0.0.1:8000/v1"


def write(root: Path, params: Params, calibration_json: str) -> Path:
    path = root / params.paths.calibration
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration_json)
    return path


def test_without_a_calibration_file_the_shipped_values_stand_and_say_where_they_come_from(tmp_path: Path) -> None:
    params, found = applied(SHIPPED, tmp_path)
    assert params == SHIPPED
    assert not found.measured and found.bounds == []
    assert "shipped values" in found.note and "smollm2-135m" in found.note
    assert found == shipped(SHIPPED)


def test_a_noisy_control_widens_the_margins_verify_generate_and_report_use(tmp_path: Path) -> None:
    key = Key.of(SHIPPED).model_copy(update={"reference_model": "m", "reference_server": "0.32.0"})
    result = calibrated(SHIPPED, key, {"second-box": ("https://box.example/v1", control("second-box", 0.1))},
                        ("sandbox:coarse", coarse()))  # fmt: skip
    shipped_margin = SHIPPED.verify.margin
    assert result.measured and result.margin.mean_abs_dlogprob > shipped_margin.mean_abs_dlogprob
    assert result.margin.tail_p0 > shipped_margin.tail_p0  # 0 of 288 bounds it only by ~1.7 %, not 0.1 %
    assert all(getattr(result.margin, f) >= getattr(shipped_margin, f) for f in type(shipped_margin).model_fields)
    assert result.decision.mixture_detection_logprob < 1.0 and {b.control for b in result.bounds} == {"second-box", "coarse"}
    assert "second-box (288 completions)" in result.note and "coarse build (96 completions)" in result.note
    write(tmp_path, SHIPPED, result.model_dump_json())

    params, found = applied(SHIPPED, tmp_path)
    assert params.verify.margin == result.margin and params.verify.decision == result.decision
    assert params.verify.seed == SHIPPED.verify.seed and params.generate == SHIPPED.generate
    assert found == result
    verdict_calibration = Calibration.of(params.survey.model, controls=["second-box"], note=found.note,
                                         margin=found.margin, decision=found.decision)  # fmt: skip
    assert verdict_calibration.measured_for_model and "second-box" in verdict_calibration.measured_on


def test_controls_at_the_generations_settings_set_the_monitors_sampler_margins(tmp_path: Path) -> None:
    """The monitor's margins are verify's with the sampler's widened to what the control
    showed at the generation's temperature; verify decides with its own, and the confidence
    is split over one more part."""
    key = Key.of(SHIPPED)
    noisy = {"box": ("reference", control("box", 0.02))}
    audit_only = calibrated(SHIPPED, key, noisy, None)
    assert audit_only.generation is None and "no control was measured there" in audit_only.note
    result = calibrated(SHIPPED, key, noisy, None, {"box": sampled("box", z_mean=0.4)})
    assert result.generation is not None
    assert result.generation.settings == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 384}
    monitor = result.generation.margin
    assert monitor.sampler_shift > result.margin.sampler_shift and monitor.sample_tail_p0 > result.margin.sample_tail_p0
    assert monitor.mean_abs_dlogprob == result.margin.mean_abs_dlogprob and monitor.tail_p0 == result.margin.tail_p0
    assert {b.margin for b in result.bounds if b.margin.endswith("(generation)")} == {
        "sample_tail_p0 (generation)", "sampler_shift (generation)"}  # fmt: skip
    assert result.margin.tail_p0 > audit_only.margin.tail_p0  # each bound at 97.5 % now, not 95 %
    assert "box (288)" in result.note and "temperature 0.7" in result.note
    assert f"sample_tail_p0 {monitor.sample_tail_p0:.3g}, sampler_shift {monitor.sampler_shift:.3g}" in result.note
    (box,) = result.generation.controls
    assert box.completions == 288 and box.mean_pit > 0.55 and box.failed == {"timeout": 2}
    with pytest.raises(ConfigError, match=r"calibrate.controls.box: no completion at the generation's settings .*timeout ×2"):
        calibrated(SHIPPED, key, noisy, None, {"box": SamplerCompletions(Sampled("box", [], []), Counter(timeout=2))})


def test_a_new_generation_temperature_keeps_verifys_calibration(tmp_path: Path) -> None:
    """Verify's margins do not depend on how generation samples: a temperature experiment
    needs no new audit (the monitor's margins are checked by generate, ``test_monitoring``)."""
    write(tmp_path, SHIPPED, shipped(SHIPPED).model_dump_json())
    hotter = SHIPPED.model_copy(update={"generate": changed(SHIPPED.generate, sampling=changed(SHIPPED.generate.sampling,
                                                                                              temperature=0.8))})  # fmt: skip
    params, _ = applied(hotter, tmp_path)
    assert params.verify.margin == SHIPPED.verify.margin


def test_two_controls_split_the_confidence_and_the_noisier_one_sets_the_margin() -> None:
    key = Key.of(SHIPPED)
    quiet = {"quiet": ("reference", control("quiet", 0.01))}
    one = calibrated(SHIPPED, key, {"noisy": ("reference", control("noisy", 0.12))}, None)
    both = calibrated(SHIPPED, key, {**quiet, "noisy": ("reference", control("noisy", 0.12))}, None)
    assert both.margin.mean_abs_dlogprob > one.margin.mean_abs_dlogprob  # same data, each bound at 97.5 % instead of 95 %
    assert calibrated(SHIPPED, key, quiet, None).margin.mean_abs_dlogprob == SHIPPED.verify.margin.mean_abs_dlogprob


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("survey.model", "moonshotai/kimi-k2.5", "model"),
        ("verify.probes.max_tokens", 96, "max_tokens"),
        ("verify.margin.tail_p0", 0.002, "shipped_sha256"),
        ("reasoning.mode", "off", "reasoning"),
        ("calibrate.prompts", 12, "calibrate.prompts 24 (now 12)"),
        ("calibrate.controls", {"box": "reference"}, "calibrate.controls.box None (now 'reference')"),
    ],
)
def test_a_calibration_made_for_other_settings_is_refused_naming_the_file_and_the_setting(
    tmp_path: Path, field: str, value: object, named: str
) -> None:
    path = write(tmp_path, SHIPPED, shipped(SHIPPED).model_dump_json())
    data = SHIPPED.model_dump(by_alias=True)
    node = data
    *parents, last = field.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    changed = Params.model_validate(data)
    with pytest.raises(ConfigError) as caught:
        applied(changed, tmp_path)
    assert str(path) in str(caught.value) and named in str(caught.value) and "quanthunt calibrate" in str(caught.value)


@pytest.mark.parametrize("text", ["{", "[]", '{"key": 1}', json.dumps({"measured": True})])
def test_a_damaged_calibration_file_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, SHIPPED, text)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="not a calibration quanthunt wrote") as caught:
        applied(SHIPPED, tmp_path)
    assert str(path) in str(caught.value) and path.read_bytes() == before


def test_a_calibration_measured_against_another_reference_is_refused(tmp_path: Path) -> None:
    key = Key.of(SHIPPED).model_copy(update={"reference_model": "kimi", "reference_server": "0.31.0"})
    result = calibrated(SHIPPED, key, {"box": ("reference", control("box", 0.05))}, None)
    check_reference(result, model="kimi", server="0.31.0", path=tmp_path / "c.json")
    with pytest.raises(ConfigError, match=r"calibrated against reference kimi \(server 0.31.0\).*serves kimi \(server 0.32.0\)"):
        check_reference(result, model="kimi", server="0.32.0", path=tmp_path / "c.json")
    check_reference(shipped(SHIPPED), model="other", server="x", path=tmp_path / "c.json")  # nothing measured


def test_a_control_that_gave_nothing_or_too_little_is_an_error_naming_it() -> None:
    key = Key.of(SHIPPED)
    empty = Completions(Faithful("box", [], [], []), Counter({"http_503": 4}))
    with pytest.raises(ConfigError, match=r"calibrate.controls.box: no completion could be measured \(http_503 ×4\)"):
        calibrated(SHIPPED, key, {"box": ("reference", empty)}, None)
    with pytest.raises(ConfigError, match=r"calibrate.controls.box: .*measure more completions"):
        calibrated(SHIPPED, key, {"box": ("reference", control("box", 0.5, n=6))}, None)
    flat = Completions(Faithful("coarse", [0.0] * 20, [], [0.0] * 20), Counter())
    with pytest.raises(ConfigError, match=r"calibrate.coarse: .*never flagged"):
        calibrated(SHIPPED, key, {}, ("sandbox:coarse", flat))


def test_control_urls_resolve_to_the_reference_the_sandbox_or_themselves() -> None:
    def sandbox(name: str) -> str:
        return f"http://127.0.0.1:9/deployments/{name}/v1"

    assert deployment_url("reference", reference_url=REFERENCE_URL, sandbox_url=None) == REFERENCE_URL
    assert deployment_url("sandbox:fp8-kv", reference_url=REFERENCE_URL, sandbox_url=sandbox).endswith("/fp8-kv/v1")
    assert deployment_url("https://box.example/v1", reference_url=REFERENCE_URL, sandbox_url=None) == "https://box.example/v1"
    with pytest.raises(ConfigError, match="sandbox:fp8-kv names a sandbox deployment"):
        deployment_url("sandbox:fp8-kv", reference_url=REFERENCE_URL, sandbox_url=None)


def test_bound_names_are_valid_mlflow_metric_names() -> None:
    result = calibrated(SHIPPED, Key.of(SHIPPED), {"box": ("reference", control("box", 0.05))}, None)
    names = [metric_name(b) for b in result.bounds]
    assert "box.sample_tail_p0.listed" in names and all("(" not in n and " " not in n for n in names)


def test_a_control_that_cannot_be_reached_or_serves_another_model_stops_the_stage_naming_it() -> None:
    """Checked once before any completion is asked: otherwise every one of its completions
    would fail the same way, slowly."""

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def other_model(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "kimi-k2.5-fp8"}]})

    async def reach_with(handler: Callable[[httpx.Request], httpx.Response]) -> None:
        async with Reference("https://box.example/v1", transport=httpx.MockTransport(handler)) as box:
            await reach(box, "kimi-k2.5", field="calibrate.controls.box")

    with pytest.raises(ConfigError, match=r"^calibrate.controls.box: cannot reach the reference deployment at box.example"):
        asyncio.run(reach_with(refused))
    with pytest.raises(ConfigError, match=r"serves kimi-k2.5-fp8, not the reference's model kimi-k2.5 \(serve it under"):
        asyncio.run(reach_with(other_model))


def test_controls_named_but_never_measured_are_an_error_not_the_shipped_values(tmp_path: Path) -> None:
    """Named controls promise a calibration: running verify before calibrate must not fall
    back to the shipped margins silently."""
    named = SHIPPED.model_copy(update={"calibrate": SHIPPED.calibrate.model_copy(update={"controls": {"box": "reference"}})})
    with pytest.raises(ConfigError, match="not found, but calibrate names deployments to measure: run `quanthunt calibrate`"):
        applied(named, tmp_path)


def test_a_removed_control_makes_the_calibration_stale() -> None:
    named = SHIPPED.calibrate.model_copy(update={"controls": {"a": "reference"}})
    measured = Key.of(SHIPPED.model_copy(update={"calibrate": named}))
    assert Key.of(SHIPPED).differences(measured) == ["calibrate.controls.a 'reference' (now None)"]
