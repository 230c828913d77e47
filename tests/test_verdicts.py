"""``verdicts.json`` as the verify stage writes it and the later stages read it: a file
saved and loaded back is the same verdicts (fields older files lack take their defaults),
``eligible()`` keeps exactly the providers marked eligible, the model refuses values no
audit can produce (each refusal one line naming the file and the field), and the
provider's summaries (``unusable_text``, ``measured_precision``) say what was measured
against the margins. Corrupted files in general are fuzzed by ``test_verdicts_bad_inputs``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.params import SHIPPED
from fixtures.verdicts import provider_verdict, verdicts_of
from pydantic import ValidationError

from quanthunt.errors import ConfigError
from quanthunt.verdicts import Calibration, Estimate, Observed, Verdict, Verdicts, load_verdicts
from quanthunt.verdicts import TestResult as HypothesisTest  # not a pytest class

MARGIN = SHIPPED.verify.margin
"""mean |Δ logprob| margin 0.08; sampler: different beyond ½ ± 0.03, equivalent within ½ ± 0.1."""


def written(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "verdicts.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_verdicts_saved_and_loaded_back_are_the_same(tmp_path: Path) -> None:
    audited = provider_verdict(
        "alpha/int4",
        tests=[HypothesisTest(name="tail", kind="difference", statistic=1.5, p_value=0.2, p_adjusted=0.4, null="no shift")],
        effects={"mean_pit": Estimate(value=0.51, ci_low=0.45, ci_high=0.57)},
        power={"mixture": 0.97},
        rounds=3,
        e_value=2.5,
        e_path=[1.0, 1.5, 2.5],
        observed=Observed(shift=[0.01, 0.02], z=[0.3, -1.1]),
        unusable={"timeout": 2},
        failed_requests=2,
        possibly_billed=1,
        errors={"http_429": 4},
        served_by={"Alpha": 12},
        mlflow_run_id="run-alpha",
    )
    verdicts = verdicts_of(audited, provider_verdict("beta/fp8", "inconclusive", probes_needed=240))
    path = tmp_path / "verdicts.json"
    path.write_text(verdicts.model_dump_json(indent=2), encoding="utf-8")
    assert load_verdicts(path) == verdicts


def test_fields_an_older_file_lacks_take_their_defaults(tmp_path: Path) -> None:
    data = verdicts_of(provider_verdict("alpha/int4")).model_dump(mode="json")
    for key in ("rounds", "e_value", "e_path", "observed", "unusable", "possibly_billed", "mlflow_run_id"):
        del data["providers"][0][key]
    (loaded,) = load_verdicts(written(tmp_path, data)).providers
    assert (loaded.rounds, loaded.e_value, loaded.e_path, loaded.possibly_billed) == (1, 1.0, [], 0)
    assert loaded.observed == Observed(shift=[], z=[]) and loaded.unusable == {} and loaded.mlflow_run_id is None


def test_eligible_keeps_only_the_providers_marked_eligible_in_file_order() -> None:
    verdicts = verdicts_of(
        provider_verdict("beta/int4"),
        provider_verdict("gamma/nvfp4", "different"),
        provider_verdict("delta/fp8", eligible=False, survey_decision="excluded: declared fp8"),  # equivalent, excluded
        provider_verdict("alpha/int4"),
        provider_verdict("eta/int4", "inconclusive"),
    )
    assert [v.tag for v in verdicts.eligible()] == ["beta/int4", "alpha/int4"]
    assert verdicts_of().eligible() == []


@pytest.mark.parametrize(
    ("where", "key", "value", "field"),
    [
        ("provider", "verdict", "maybe", "providers.0.verdict"),
        ("provider", "mode", "chat", "providers.0.mode"),
        ("provider", "probes", -1, "providers.0.probes"),
        ("provider", "completions", -3, "providers.0.completions"),
        ("provider", "cost_usd", -0.01, "providers.0.cost_usd"),
        ("provider", "cost_usd", math.nan, "providers.0.cost_usd"),  # Python's json writes and reads NaN
        ("provider", "e_value", -1.0, "providers.0.e_value"),
        ("provider", "possibly_billed", -2, "providers.0.possibly_billed"),
        ("provider", "api_key", "sk-or-v1-secret", "providers.0.api_key"),  # no field the stage does not write
        ("file", "correction", "bonferroni", "correction"),
        ("file", "cost_usd", -1.0, "cost_usd"),
        ("file", "alpha", math.inf, "alpha"),
    ],
)
def test_values_no_audit_produces_are_refused_naming_the_file_and_field(
    tmp_path: Path, where: str, key: str, value: object, field: str
) -> None:
    data = verdicts_of(provider_verdict("alpha/int4")).model_dump(mode="json")
    (data["providers"][0] if where == "provider" else data)[key] = value
    path = written(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_verdicts(path)
    assert str(info.value).startswith(f"{path}: {field}: "), str(info.value)
    assert "secret" not in str(info.value)


def test_a_loaded_verdict_cannot_be_changed_in_memory() -> None:
    verdict = provider_verdict("gamma/nvfp4", "different")
    with pytest.raises(ValidationError):
        verdict.eligible = True
    assert verdict.eligible is False


def test_unusable_text_lists_the_most_frequent_reason_first() -> None:
    verdict = provider_verdict("alpha/int4", unusable={"timeout": 1, "no_logprobs": 3, "empty_completion": 1})
    assert verdict.unusable_text() == "no_logprobs ×3, empty_completion ×1, timeout ×1"  # ties by name
    assert provider_verdict("alpha/int4").unusable_text() == ""


PIT = "sampler: mean Φ(rank z)"


def effects(
    shift: tuple[float, float, float] | None = None, pit: tuple[float, float, float] | None = None
) -> dict[str, Estimate]:
    found = {}
    if shift is not None:
        found["mean_abs_dlogprob_clipped"] = Estimate(value=shift[0], ci_low=shift[1], ci_high=shift[2])
    if pit is not None:
        found["mean_pit"] = Estimate(value=pit[0], ci_low=pit[1], ci_high=pit[2])
    return found


@pytest.mark.parametrize(
    ("verdict", "measured", "text"),
    [
        ("equivalent", effects(shift=(0.012, 0.0, 0.03)), "equivalent: mean |Δlogprob| 0.012 (CI ≤ 0.03) < margin 0.08"),
        ("different", effects(shift=(0.3, 0.2, 0.4)), "different: mean |Δlogprob| 0.3 (CI ≥ 0.2) > margin 0.08"),
        ("inconclusive", effects(shift=(0.07, 0.05, 0.1)), "inconclusive: mean |Δlogprob| 0.07 (CI 0.05–0.1) vs margin 0.08"),
        ("equivalent", effects(pit=(0.49, 0.41, 0.57)), f"equivalent: {PIT} 0.49 (CI 0.41–0.57) within ½ ± 0.1"),
        ("different", effects(pit=(0.8, 0.7, 0.9)), f"different: {PIT} 0.8 (CI 0.7–0.9) off ½ by more than 0.03"),
        ("different", effects(pit=(0.2, 0.1, 0.3)), f"different: {PIT} 0.2 (CI 0.1–0.3) off ½ by more than 0.03"),
        ("inconclusive", effects(pit=(0.5, 0.3, 0.7)), f"inconclusive: {PIT} 0.5 (CI 0.3–0.7) vs ½ ± 0.1"),
        (
            "equivalent",
            effects(shift=(0.012, 0.0, 0.03), pit=(0.49, 0.41, 0.57)),
            f"equivalent: mean |Δlogprob| 0.012 (CI ≤ 0.03) < margin 0.08; {PIT} 0.49 (CI 0.41–0.57) within ½ ± 0.1",
        ),
        ("inconclusive", {}, "inconclusive: nothing measured"),
    ],
)
def test_the_measured_precision_names_each_effect_against_its_margin(
    verdict: Verdict, measured: dict[str, Estimate], text: str
) -> None:
    provider = provider_verdict("alpha/int4", verdict, effects=measured)
    assert provider.measured_precision(MARGIN) == text


def test_the_unclipped_logprob_effect_alone_is_not_the_measured_precision() -> None:
    """The sequential test bets on the clipped mean; the raw mean is reported elsewhere."""
    raw = {"mean_abs_dlogprob": Estimate(value=0.5, ci_low=0.4, ci_high=0.6)}
    assert provider_verdict("alpha/int4", effects=raw).measured_precision(MARGIN) == "equivalent: nothing measured"


def test_verdicts_on_another_model_than_the_calibration_say_their_figures_are_assumed() -> None:
    """Issue 25: the shipped margins and detection rates were measured on the sandbox's
    SmolLM2 only; a verdict on the team's own model must not pass them off as measured."""
    own = Calibration.of("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert own.measured_for_model and own.measured_on == own.model.lower() and "were measured on this model" in own.note
    kimi = Calibration.of("moonshotai/kimi-k2.5")
    assert not kimi.measured_for_model and kimi.model == "moonshotai/kimi-k2.5"
    assert "not measured for moonshotai/kimi-k2.5" in kimi.note and "assumed for it, not established" in kimi.note
    assert own.measured_on in kimi.note
    written = verdicts_of(provider_verdict("a/int4"), calibration=kimi.model_dump())
    assert Verdicts.model_validate_json(written.model_dump_json()).calibration == kimi
    assert verdicts_of(provider_verdict("a/int4")).calibration is None  # a file from before it was recorded


def test_the_margins_verify_decided_with_travel_in_the_verdicts() -> None:
    """Generate's monitor and the report take the margins and decision settings from the
    verdicts (a calibration may have widened them), and only a file from before they were
    recorded falls back to params.yaml's."""
    m, d = SHIPPED.verify.margin, SHIPPED.verify.decision
    wider = m.model_copy(update={"mean_abs_dlogprob": 0.2, "tail_dlogprob": 0.3})
    measured = d.model_copy(update={"mixture_detection_logprob": 0.8})
    calibration = Calibration.of("moonshotai/kimi-k2.5", controls=["second-box"], note="bounded on second-box",
                                 margin=wider, decision=measured)  # fmt: skip
    assert calibration.measured_for_model and calibration.measured_on == "control deployments of moonshotai/kimi-k2.5: second-box"
    written = Verdicts.model_validate_json(
        verdicts_of(provider_verdict("a/int4"), calibration=calibration.model_dump()).model_dump_json()
    )
    assert written.margin_or(m) == wider and written.decision_or(d) == measured
    old = verdicts_of(provider_verdict("a/int4"), calibration=Calibration.of("moonshotai/kimi-k2.5").model_dump())
    assert old.margin_or(m) == m and old.decision_or(d) == d
    assert verdicts_of(provider_verdict("a/int4")).margin_or(m) == m
