"""One verify run's pure parts: which surveyed endpoints are audited, the planned probe
cost checked before any money moves, the probes drawn (real files in tmp_path); and what
the run reports: metrics, tags, the console table and the HTML report. The audit itself
(``audit_all``) runs in the stage tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.params import SHIPPED, changed
from fixtures.verdicts import provider_verdict, verdicts_of
from rich.console import Console

from quanthunt.audit_run import metrics, plan, render_report, show, subjects_to_audit, tags
from quanthunt.errors import ConfigError
from quanthunt.params import Params
from quanthunt.survey import CANDIDATE, ProviderRow, providers_csv
from quanthunt.verdicts import Calibration


def surveyed(name: str, reason: str = CANDIDATE, *, usd_per_m: tuple[float, float] = (0.5, 2.0), logprobs: bool = True,
             quantization: str = "int4") -> ProviderRow:  # fmt: skip
    """A row of ``providers.csv``; ``usd_per_m``: (prompt, completion) price per million tokens."""
    return ProviderRow(
        provider=name, tag=f"{name.lower()}/{quantization}", declared_quantization=quantization,
        prompt_usd_per_m=usd_per_m[0], completion_usd_per_m=usd_per_m[1], discount=0.0, price_note="", status=0,
        uptime_last_30m=99.0, context_length=8192, max_completion_tokens=None, supports_logprobs=logprobs,
        decision=CANDIDATE if reason == CANDIDATE else "excluded", reason=reason,
    )  # fmt: skip


ROWS = [
    surveyed("Faithful"),
    surveyed("Sampler", logprobs=False),
    surveyed("Lower", "excluded: declared nvfp4", quantization="nvfp4"),
    surveyed("Dear", "excluded: price above max", usd_per_m=(1000.0, 5000.0)),
    surveyed("Ignored", "excluded: ignored by policy", quantization="nvfp4"),
    surveyed("Down", "excluded: status -3"),
]
"""The shipped verify params plan 180 probes each, 60 prompt and 64 completion tokens a
request: $0.5/$2 per M costs 180 × (60 × 0.5 + 64 × 2) / 1e6 = $0.02844 in sample mode's
completions, three times that ($0.08532) as it takes three a prompt; logprob mode asks 2 more
at the generation's temperature, 182 × 158 / 1e6 = $0.028756."""
AUDITED_USD = 0.028756 + 0.08532 + 0.028756
"""Faithful, Sampler and Lower (declared below the policy, audited by default): $0.142832."""


def params_with(*, datasets: tuple[str, ...] = ("chat", "code"), **verify: Any) -> Params:
    return SHIPPED.model_copy(update={"datasets": datasets, "verify": changed(SHIPPED.verify, **verify)})


def write_inputs(root: Path, rows: list[ProviderRow], prompts: dict[str, int]) -> Path:
    """``providers.csv`` as the survey wrote it and ``prompts[name]`` records per dataset."""
    table = root / SHIPPED.paths.survey_providers
    table.parent.mkdir(parents=True)
    table.write_text(providers_csv(rows))
    for name, count in prompts.items():
        path = SHIPPED.paths.prompt_file(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"{name} question {i}?"}]} for i in range(count)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return table


# -- who is audited --------------------------------------------------------------------------


def test_candidates_and_endpoints_excluded_for_their_declared_precision_are_audited() -> None:
    rows = subjects_to_audit(ROWS, SHIPPED)
    assert [r.surveyed.provider for r in rows] == ["Faithful", "Sampler", "Lower"]
    lower = rows[2].subject
    assert (lower.provider, lower.tag, lower.declared_quantization) == ("Lower", "lower/nvfp4", "nvfp4")
    assert lower.survey_decision == "excluded: declared nvfp4"
    assert [r.logprobs for r in rows] == [True, False, True]


def test_declared_exclusions_stay_out_when_the_params_say_so() -> None:
    params = params_with(audit_declared_excluded=False)
    assert [r.surveyed.provider for r in subjects_to_audit(ROWS, params)] == ["Faithful", "Sampler"]


def test_an_ignored_provider_is_never_audited_whatever_it_declares() -> None:
    ignored = [r for r in ROWS if r.provider == "Ignored"]
    assert subjects_to_audit(ignored, SHIPPED) == []


# -- the plan and its cost -------------------------------------------------------------------


def test_the_plan_keeps_every_surveyed_row_audits_some_and_draws_probes_from_every_dataset(tmp_path: Path) -> None:
    write_inputs(tmp_path, ROWS, {"chat": 5, "code": 2})
    surveyed_rows, rows, probes = plan(params_with(), tmp_path)
    assert surveyed_rows == ROWS
    assert [r.surveyed.tag for r in rows] == ["faithful/int4", "sampler/int4", "lower/nvfp4"]
    assert sorted(p.id for p in probes) == sorted([f"chat:r{i}" for i in range(5)] + ["code:r0", "code:r1"])
    assert {p.id.split(":")[0] for p in probes[:2]} == {"chat", "code"}  # round-robin: both datasets early
    assert plan(params_with(), tmp_path)[2] == probes  # the same inputs draw the same probes


def test_the_plan_draws_at_most_the_probes_one_provider_may_get(tmp_path: Path) -> None:
    write_inputs(tmp_path, ROWS, {"chat": 30, "code": 30})
    probes = plan(params_with(max_probes_per_provider=13), tmp_path)[2]
    assert len(probes) == 13 and len({p.id for p in probes}) == 13


@pytest.mark.parametrize(("limit", "refused"), [(0.15, False), (0.1429, False), (0.1428, True), (0.05, True)])
def test_the_planned_cost_of_the_audited_rows_is_checked_against_the_limit(tmp_path: Path, limit: float, refused: bool) -> None:
    """Dear's prices would cost $69.16 to audit (182 × $0.38): excluded for its price, it is not counted."""
    write_inputs(tmp_path, ROWS, {"chat": 3, "code": 3})
    params = params_with(max_cost_usd=limit)
    if not refused:
        assert len(plan(params, tmp_path)[1]) == 3
        return
    with pytest.raises(ConfigError) as info:
        plan(params, tmp_path)
    assert str(info.value) == f"the planned probe cost ${AUDITED_USD:.4f} exceeds verify.max_cost_usd ${limit:g}"


def test_the_cost_is_checked_before_any_prompt_file_is_read(tmp_path: Path) -> None:
    write_inputs(tmp_path, ROWS, {})  # no prompt files at all
    with pytest.raises(ConfigError, match=r"^the planned probe cost"):
        plan(params_with(max_cost_usd=0.01), tmp_path)


def test_no_row_to_audit_is_refused_naming_the_providers_table(tmp_path: Path) -> None:
    table = write_inputs(tmp_path, [r for r in ROWS if r.provider in ("Dear", "Down")], {"chat": 1, "code": 1})
    with pytest.raises(ConfigError) as info:
        plan(params_with(), tmp_path)
    assert str(info.value) == f"{table}: no provider to verify (the survey found no candidate)"


def test_a_missing_survey_or_prompt_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"providers.csv: providers table not found; run the survey stage first"):
        plan(params_with(), tmp_path)
    write_inputs(tmp_path, ROWS, {"chat": 2})
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'data/prompts/code.jsonl'}: "):
        plan(params_with(), tmp_path)


# -- what the run reports ----------------------------------------------------------------


VERDICTS = verdicts_of(
    provider_verdict("faithful/int4", cost_usd=0.002),
    provider_verdict("lower/nvfp4", "different", declared_quantization="nvfp4", survey_decision="excluded: declared nvfp4",
                     failed_requests=3, unusable={"no_logprobs": 2, "timeout": 1}, possibly_billed=1),
    provider_verdict("sampler/int4", "inconclusive", mode="sample", probes_needed=40),
    provider_verdict("unproven/int4", "equivalent", eligible=False, survey_decision="excluded: declared unknown"),
)  # fmt: skip


def test_metrics_count_verdicts_eligible_endpoints_and_unusable_replies() -> None:
    assert metrics(VERDICTS) == {
        "equivalent": 2, "different": 1, "inconclusive": 1, "eligible": 1, "cost_usd": 0.005, "probes": 2,
        "unusable_completions": 3, "possibly_billed_requests": 1,
    }  # fmt: skip


def test_tags_list_the_audited_and_the_eligible_with_their_precisions() -> None:
    found = tags(VERDICTS, SHIPPED.verify.margin)
    assert found["providers"] == "faithful/int4,lower/nvfp4,sampler/int4,unproven/int4"
    assert found["eligible"] == "faithful/int4"
    assert found["declared_precision"].split(",")[1] == "lower/nvfp4=nvfp4"
    assert found["measured_precision"].split(" | ")[2] == "sampler/int4 inconclusive: nothing measured"
    assert found["cost_usd"] == "0.005000"


def test_the_console_names_every_unusable_completion_and_possibly_billed_request() -> None:
    console = Console(record=True, width=300)
    show(VERDICTS, console)
    notes = [line for line in console.export_text().splitlines() if line.startswith("verify: ")]
    assert notes == [
        "verify: lower/nvfp4: 3 of 15 completions unusable (no_logprobs ×2, timeout ×1); "
        "1 requests timed out after they were sent (retried; they may have been billed)"
    ]


def test_the_html_report_escapes_what_providers_and_the_gateway_named() -> None:
    hostile = verdicts_of(
        provider_verdict("evil/int4", "different", provider="<script>alert(1)</script>", reason="p < 0.01 & <b>bold</b>",
                         failed_requests=1, unusable={"<img src=x>": 1}),
        model="a/<i>model</i>",
    )  # fmt: skip
    page = render_report(hostile, {"evil/int4 <svg onload=x>": b"\x89PNG"})
    assert "<script>" not in page and "<img src=x>" not in page and "<svg" not in page and "<i>model" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "p &lt; 0.01 &amp; &lt;b&gt;bold&lt;/b&gt;" in page
    assert "data:image/png;base64,iVBORw==" in page


def test_the_html_report_has_a_row_per_provider_classed_by_its_verdict() -> None:
    page = render_report(VERDICTS, {})
    for verdict in VERDICTS.providers:
        assert f"<tr class='{verdict.verdict}'><td>{verdict.provider}<br><small>{verdict.tag}</small>" in page
    assert "unusable: no_logprobs ×2, timeout ×1" in page and "1 timed out, possibly billed" in page
    assert "total probe cost $0.00500" in page and "<figure>" not in page


def test_verify_says_when_its_margins_were_not_measured_for_the_model_audited() -> None:
    kimi = verdicts_of(*VERDICTS.providers, calibration=Calibration.of("moonshotai/kimi-k2.5").model_dump())
    console = Console(record=True, width=2000)
    show(kimi, console)
    assert (
        "verify: verify.margin and the mixture detection rates are not measured for moonshotai/kimi-k2.5" in console.export_text()
    )
    assert "<p class='caveat'>Calibration: verify.margin and the mixture detection rates are not measured" in render_report(
        kimi, {}
    )
    own = verdicts_of(*VERDICTS.providers, calibration=Calibration.of(SHIPPED.survey.model).model_dump())
    console = Console(record=True, width=2000)
    show(own, console)
    assert "Calibration" not in console.export_text() and "not measured" not in console.export_text()
    assert "<p class='measured'>Calibration: the shipped verify.margin" in render_report(own, {})
