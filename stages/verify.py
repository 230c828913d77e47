"""Verify stage: measure every candidate provider against the reference, decide.

Reads the survey's ``providers.csv`` and the prompt datasets; writes ``verdicts.json``
(validated), one plot per provider, a short HTML report and ``metrics.json``; one MLflow
run with a nested run per provider.
"""

from __future__ import annotations

import asyncio
import html
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quanthunt import figures
from quanthunt.connection import Targets, open_targets
from quanthunt.errors import ConfigError
from quanthunt.gateway import Gateway, resolve_api_key
from quanthunt.outputs import Outputs
from quanthunt.params import Params, load_params, section_digest
from quanthunt.prompts import load_prompts
from quanthunt.reference import Reference
from quanthunt.survey import CANDIDATE, read_providers
from quanthunt.terminal import stage_console
from quanthunt.tracking import StageRun, repo_root, stage_run
from quanthunt.verdicts import ProviderVerdict, Verdicts
from quanthunt.verification import Audit, Auditor, Design, Margins, Policy, Probe, Subject, decide, select_probes, summary_values


@dataclass(frozen=True)
class Row:
    """A provider to audit, as the survey listed it."""

    subject: Subject
    logprobs: bool
    prompt_usd_per_m: float
    completion_usd_per_m: float


def read_survey(path: Path) -> list[Row]:
    rows = read_providers(path)
    return [Row(Subject(r.provider, r.tag, r.declared_quantization, r.reason), r.supports_logprobs,
                r.prompt_usd_per_m, r.completion_usd_per_m) for r in rows]  # fmt: skip


def subjects_to_audit(rows: list[Row], params: Params) -> list[Row]:
    keep = []
    for row in rows:
        decision = row.subject.survey_decision
        if decision == CANDIDATE or (params.verify.audit_declared_excluded and decision.startswith("excluded: declared")):
            keep.append(row)
    return keep


def planned_cost(rows: list[Row], params: Params) -> float:
    probes = params.verify.probes
    total = 0.0
    for row in rows:
        k = probes.completions_per_prompt if row.logprobs else probes.sample_mode_completions_per_prompt
        per_request = probes.mean_prompt_tokens * row.prompt_usd_per_m + probes.max_tokens * row.completion_usd_per_m
        total += probes.prompts * k * per_request / 1e6
    return total


async def audit_all(
    params: Params, rows: list[Row], probes: list[Probe], targets: Targets, *, siblings: list[str]
) -> tuple[list[Audit], str]:
    p = params.verify.probes
    design = Design(
        model=params.survey.model,
        seed=params.verify.seed,
        completions_per_prompt=p.completions_per_prompt,
        sample_mode_completions_per_prompt=p.sample_mode_completions_per_prompt,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_logprobs=p.top_logprobs,
        max_attempts=params.verify.max_attempts,
        reasoning=params.reasoning,
    )
    async with (
        Gateway(targets.api_url, api_key=resolve_api_key(targets.api_url)) as gateway,
        Reference(targets.reference_url, model=params.reference.model) as reference,
    ):
        reference_model = (await reference.check()).model
        auditor = Auditor(gateway, reference, design, concurrency=params.verify.concurrency, siblings=siblings)
        audits = await asyncio.gather(
            *(auditor.audit(r.subject.provider, r.subject.tag, logprobs=r.logprobs, probes=probes) for r in rows)
        )
    return list(audits), reference_model


def render_report(verdicts: Verdicts, images: dict[str, bytes]) -> str:
    rows = []
    for v in verdicts.providers:
        effects = "<br>".join(f"{html.escape(k)}: {e.value:.4g} [{e.ci_low:.4g}, {e.ci_high:.4g}]" for k, e in v.effects.items())
        tests = "<br>".join(
            f"{html.escape(t.name)}: p={t.p_value:.3g}" + (f", adj {t.p_adjusted:.3g}" if t.p_adjusted is not None else "")
            for t in v.tests
        )
        rows.append(
            f"<tr class='{v.verdict}'><td>{html.escape(v.provider)}<br><small>{html.escape(v.tag)}</small></td>"
            f"<td>{v.declared_quantization}</td><td>{v.mode}</td>"
            f"<td><b>{v.verdict}</b><br><small>{html.escape(v.reason)}</small></td><td><small>{effects}</small></td>"
            f"<td><small>{tests}</small></td><td>{', '.join(f'{k} {p:.2f}' for k, p in v.power.items())}</td>"
            f"<td>{v.completions}</td><td>${v.cost_usd:.5f}</td></tr>"
        )
    plots = "".join(
        f"<figure><img alt='{html.escape(name)}' src='{figures.data_uri(png)}'>"
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, png in images.items()
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>quanthunt verification</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px;vertical-align:top}}
.equivalent{{background:#e8f5e9}}.different{{background:#ffebee}}.inconclusive{{background:#fff8e1}}img{{max-width:760px}}</style></head><body>
<h1>Verification of {html.escape(verdicts.model)}</h1>
<p>Reference: {html.escape(verdicts.reference_model)}. α = {verdicts.alpha}, {verdicts.correction} correction across providers,
{len(verdicts.probe_ids)} probe prompts, total probe cost ${verdicts.cost_usd:.5f}. MLflow run {verdicts.verification_run_id}.</p>
<table><tr><th>provider</th><th>declares</th><th>mode</th><th>verdict</th><th>effects [95% CI]</th><th>tests</th><th>power</th>
<th>completions</th><th>cost</th></tr>{"".join(rows)}</table>{plots}</body></html>
"""


def show(verdicts: Verdicts, console: Console) -> None:
    table = Table(title="Verification", title_justify="left")
    for column in ("provider", "tag", "declares", "mode", "verdict", "reason"):
        table.add_column(column)
    for v in verdicts.providers:
        table.add_row(v.provider, v.tag, v.declared_quantization, v.mode, v.verdict, v.reason)
    console.print(table)


def log_provider_runs(run: StageRun, verdicts: list[ProviderVerdict]) -> list[ProviderVerdict]:
    out = []
    for v in verdicts:
        child = run.child(
            v.tag, {"provider": v.provider, "tag": v.tag, "declared_precision": v.declared_quantization, "verdict": v.verdict}
        )
        child.log_metrics(
            {f"effect.{k}": e.value for k, e in v.effects.items()}
            | {f"power.{k}": p for k, p in v.power.items()}
            | {"completions": v.completions, "failed_requests": v.failed_requests, "cost_usd": v.cost_usd}
        )
        child.set_tags({"reason": v.reason, "mode": v.mode, "measured_precision": _measured(v)})
        out.append(v.model_copy(update={"mlflow_run_id": child.run_id}))
    return out


def _measured(v: ProviderVerdict) -> str:
    if v.verdict == "equivalent":
        return "reference-equivalent"
    return "differs-from-reference" if v.verdict == "different" else "unknown"


def main(params_path: Path, *, console: Console | None = None) -> None:
    """Run the verify stage with the params file at ``params_path``."""
    console = console or stage_console()
    params = load_params(params_path)
    root = repo_root(params_path)
    paths = params.paths
    surveyed = read_survey(root / paths.survey_providers)
    rows = subjects_to_audit(surveyed, params)
    if not rows:
        raise ConfigError(f"{root / paths.survey_providers}: no provider to verify (the survey found no candidate)")
    cost = planned_cost(rows, params)
    if cost > params.verify.max_cost_usd:
        raise ConfigError(f"the planned probe cost ${cost:.4f} exceeds verify.max_cost_usd ${params.verify.max_cost_usd:g}")
    datasets = {name: load_prompts(paths.prompt_file(root, name)) for name in params.datasets}
    probes = select_probes(datasets, count=params.verify.probes.prompts, seed=params.verify.seed)
    with stage_run("verify", params=params, section=params.verify, root=root, experiment=params.tracking.experiment) as run:
        with open_targets(params, root=root, stage="verify", needs_model=True) as targets:
            audits, reference_model = asyncio.run(
                audit_all(params, rows, probes, targets, siblings=[r.subject.tag for r in surveyed])
            )
        m, d = params.verify.margin, params.verify.decision
        decided = decide(
            [r.subject for r in rows],
            audits,
            Margins(
                m.mean_abs_dlogprob,
                m.tail_dlogprob,
                m.tail_p0,
                m.sample_mean_z,
                m.sample_tail_z,
                m.sample_tail_p0,
                m.sample_equivalence_z,
            ),
            Policy(d.alpha, d.correction, d.min_power, d.mixture_share, d.max_failed_share),
            seed=params.verify.seed,
        )
        decided = log_provider_runs(run, decided)
        verdicts = Verdicts(
            model=params.survey.model,
            reference_model=reference_model,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            params_sha256=section_digest(params.verify),
            alpha=d.alpha,
            correction=d.correction,
            probe_ids=[p.id for p in probes],
            verification_run_id=run.run_id,
            cost_usd=round(sum(a.cost_usd for a in audits), 8),
            providers=decided,
        )
        images: dict[str, bytes] = {}
        for audit, verdict in zip(audits, verdicts.providers, strict=True):
            series = summary_values(audit)
            title = f"{verdict.tag} (declares {verdict.declared_quantization}): {verdict.verdict}"
            if audit.mode == "logprob":
                images[verdict.tag] = figures.logprob_audit(title, series["deltas"], series["completion_means"],
                                                            margin=m.mean_abs_dlogprob, tail=m.tail_dlogprob)  # fmt: skip
            else:
                images[verdict.tag] = figures.sample_audit(title, series["provider"], series["reference"])
        counts = {k: sum(1 for v in verdicts.providers if v.verdict == k) for k in ("equivalent", "different", "inconclusive")}
        metrics = {**counts, "eligible": len(verdicts.eligible()), "cost_usd": verdicts.cost_usd, "probes": len(probes)}
        with Outputs() as out:
            out.write_text(root / paths.verdicts, Verdicts.model_validate(verdicts.model_dump()).model_dump_json(indent=2) + "\n")
            for tag, png in images.items():
                out.write_bytes(root / paths.verify_plots / figures.file_name(tag), png)
            out.write_text(root / paths.verify_report, render_report(verdicts, images))
            out.write_json(root / paths.verify_metrics, metrics)
        show(verdicts, console)
        run.log_metrics(metrics)
        run.set_tags(
            {
                "providers": ",".join(v.tag for v in verdicts.providers),
                "eligible": ",".join(v.tag for v in verdicts.eligible()),
                "declared_precision": ",".join(f"{v.tag}={v.declared_quantization}" for v in verdicts.providers),
                "measured_precision": ",".join(f"{v.tag}={_measured(v)}" for v in verdicts.providers),
                "cost_usd": f"{verdicts.cost_usd:.6f}",
            }
        )
        run.log_input(root / paths.survey_providers, context="survey")
        for name in params.datasets:
            run.log_input(paths.prompt_file(root, name), context="prompts")
        for path in (paths.verdicts, paths.verify_report, paths.verify_metrics):
            run.log_artifact(root / path)
