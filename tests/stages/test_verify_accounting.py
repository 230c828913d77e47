"""The verify stage accounts for every probe (issue 14, items 5 and 7): each completion it
asked for is either measured or reported unusable with its reason, in verdicts.json, the
metrics, the console and the report; the MLflow ``measured_precision`` tag names the effect
and its margin; ``metrics.json`` stays a handful of headline scalars."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from fixtures.audits import audit_at, verdicts_by_tag
from fixtures.project import Project
from fixtures.sandbox import provider as roster_provider
from fixtures.sandbox import roster_dict

from quanthunt.sandbox.server import SandboxProcess

PROMPTS = 12


def test_every_probe_is_measured_or_reported_unusable_with_its_reason(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    """A reply whose tokens all went to reasoning (the ``empty_answer`` fault) has nothing to
    measure: in logprob mode it carries no logprobs, in sample mode no text. Before, sample
    mode dropped it silently (fewer completions, 0 failed requests, nothing in the console)."""
    empty = {"faults": {"empty_answer": 0.4}}  # seeded draws: some of alpha's 12 and beta's 36
    sandbox = latency_sandbox(
        roster_dict(roster_provider("alpha", **empty), roster_provider("beta", supports_logprobs=False, **empty))
    )
    params = {
        "verify.probes.prompts": PROMPTS,
        "verify.max_probes_per_provider": PROMPTS,
        "verify.decision.max_failed_share": 0.9,  # keep auditing: this is about the accounting
    }
    done = audit_at(project, sandbox, params)
    assert done.returncode == 0, done.stderr
    by_tag = verdicts_by_tag(project)
    alpha, beta = by_tag["alpha/int4"], by_tag["beta/int4"]
    for audited, asked, reason in ((alpha, PROMPTS, "no_logprobs"), (beta, 3 * PROMPTS, "empty_completion")):
        assert set(audited["unusable"]) == {reason}, audited
        assert audited["completions"] + audited["unusable"][reason] == asked, audited
        assert audited["failed_requests"] == audited["unusable"][reason], audited
    unusable = alpha["unusable"]["no_logprobs"] + beta["unusable"]["empty_completion"]

    metrics = json.loads((project.root / "reports/verify/metrics.json").read_text())
    assert metrics["unusable_completions"] == unusable
    assert all(isinstance(v, int | float) for v in metrics.values()) and len(metrics) <= 10, metrics  # dvc metrics show
    console = re.sub(r"\s+", " ", done.stderr)
    assert f"no_logprobs ×{alpha['unusable']['no_logprobs']}" in console
    assert f"empty_completion ×{beta['unusable']['empty_completion']}" in console
    assert (
        f"empty_completion ×{beta['unusable']['empty_completion']}" in (project.root / "reports/verify/report.html").read_text()
    )


def test_measured_precision_names_the_effect_and_its_margin(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    sandbox = latency_sandbox(roster_dict(roster_provider("alpha")))
    done = audit_at(project, sandbox, {"verify.probes.prompts": PROMPTS})
    assert done.returncode == 0, done.stderr
    (alpha,) = json.loads((project.root / "reports/verify/verdicts.json").read_text())["providers"]
    assert alpha["verdict"] == "equivalent", alpha["reason"]

    client = project.mlflow()
    experiment = client.get_experiment_by_name("quanthunt").experiment_id
    (stage,) = client.search_runs([experiment], filter_string="tags.`quanthunt.stage` = 'verify'")
    (child,) = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{stage.info.run_id}'")
    margin = project.params()["verify"]["margin"]["mean_abs_dlogprob"]
    effect = alpha["effects"]["mean_abs_dlogprob_clipped"]  # what the equivalence test bets on
    expected = f"equivalent: mean |Δlogprob| {effect['value']:.3g} (CI ≤ {effect['ci_high']:.3g}) < margin {margin:g}"
    assert child.data.tags["measured_precision"].startswith(expected), child.data.tags["measured_precision"]
    assert stage.data.tags["measured_precision"].startswith(f"alpha/int4 {expected}"), stage.data.tags
    assert "sampler: mean Φ(rank z)" in child.data.tags["measured_precision"]
