"""One verify run: which surveyed providers are audited and at what planned cost, the
audit in rounds against the reference (``audit_all``), the verdicts with their plots,
metrics and MLflow child runs, and the HTML report. ``stages/verify.py`` opens the
targets and writes the outputs.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quanthunt import decision, figures
from quanthunt.calibration_run import CalibrationFile, check_reference
from quanthunt.connection import Targets
from quanthunt.decision import Subject
from quanthunt.errors import ConfigError
from quanthunt.gateway import Gateway, check_gateway, resolve_api_key
from quanthunt.ledger import Ledger
from quanthunt.measurements import Audit, accounted, summary_values
from quanthunt.paid_replies import PaidReplies
from quanthunt.params import Margins, Params, section_digest
from quanthunt.probes import Design, Probe, select_probes
from quanthunt.prompts import load_prompts
from quanthunt.reference import Reference, ReferenceDown
from quanthunt.survey import CANDIDATE, ProviderRow, probe_cost, read_providers
from quanthunt.tracking import StageRun
from quanthunt.verdicts import Calibration, ProviderVerdict, Verdicts
from quanthunt.verification import Auditor, probe_limits, probe_timeout


@dataclass(frozen=True)
class Row:
    """A provider to audit, as the survey listed it."""

    surveyed: ProviderRow

    @property
    def subject(self) -> Subject:
        r = self.surveyed
        return Subject(r.provider, r.tag, r.declared_quantization, r.reason)

    @property
    def logprobs(self) -> bool:
        return self.surveyed.supports_logprobs


def subjects_to_audit(rows: list[ProviderRow], params: Params) -> list[Row]:
    keep = []
    for row in rows:
        if row.reason == CANDIDATE or (params.verify.audit_declared_excluded and row.reason.startswith("excluded: declared")):
            keep.append(Row(row))
    return keep


async def audit_all(
    params: Params,
    rows: list[Row],
    probes: list[Probe],
    targets: Targets,
    *,
    siblings: list[str],
    console: Console,
    ledger: Ledger,
    run_id: str,
    calibration: CalibrationFile,
) -> tuple[list[Audit], list[int], str]:
    """Audit every row in rounds until each is decided or has had every probe of the plan.
    A probe request that an earlier run bought within ``verify.reuse_paid_replies_h`` is
    answered from ``ledger``, and every reply bought is kept there at once."""
    v = params.verify
    design = Design.of(params)
    paid = PaidReplies(ledger, gateway=targets.gateway, run_id=run_id, max_age_s=v.reuse_paid_replies_h * 3600)
    async with (
        paid,
        Gateway(
            targets.api_url,
            api_key=resolve_api_key(targets.api_url),
            timeout=probe_timeout(v.request_timeout_s),
            limits=probe_limits(v.concurrency, endpoints=len(rows)),
        ) as gateway,
        Reference(targets.reference_url, model=params.reference.model, retry_for_s=v.reference_retry_for_s) as reference,
    ):
        reference_model = (await reference.check()).model
        if calibration.key.reference_model is not None:  # before anything is bought
            check_reference(calibration, model=reference_model, server=await reference.server_version(),
                            path=Path(params.paths.calibration))  # fmt: skip
        await check_gateway(gateway, targets.api_url)

        def on_cut(tag: str, before: int, after: int) -> None:
            console.print(
                f"verify: a probe request to {tag} timed out; its in-flight limit {before} → {after} "
                "(timed-out probes are retried)"
            )

        auditor = Auditor(gateway, reference, design, concurrency=v.concurrency, siblings=siblings, paid=paid, on_cut=on_cut)
        await auditor.scorer.check()
        audits = [Audit(r.subject.provider, r.subject.tag, "logprob" if r.logprobs else "sample") for r in rows]
        subjects = [r.subject for r in rows]

        def settled(audits: Sequence[Audit]) -> list[bool]:
            return [s.verdict is not None for s in decision.judge(subjects, audits, v.margin, v.decision)]

        def on_round(number: int, audits: Sequence[Audit], done: Sequence[bool]) -> None:
            left = [a.tag for a, d in zip(audits, done, strict=True) if not d]
            console.print(f"verify: round {number} done; " + (f"undecided: {', '.join(left)}" if left else "all decided"))

        try:
            rounds = await auditor.audit_rounds(audits, probes, round_size=v.probes.prompts, settled=settled, on_round=on_round)
        except ReferenceDown as exc:
            spent = sum(a.cost_usd - a.reused_cost_usd for a in audits)
            unknown = sum(a.possibly_billed for a in audits)
            again = (
                f"a rerun within verify.reuse_paid_replies_h ({v.reuse_paid_replies_h:g} h) uses them, not buying them again"
                if v.reuse_paid_replies_h > 0
                else "a rerun buys them again (verify.reuse_paid_replies_h is 0)"
            )
            raise ReferenceDown(
                f"{exc}. verify stopped before writing anything: ${spent:.4f} of probe replies were bought and are kept "
                "in the ledger" + (f" (and {unknown} timed-out requests possibly billed)" if unknown else "") + f"; {again}"
            ) from None
        if reference.retried:
            kinds = ", ".join(f"{k} ×{n}" for k, n in reference.retried.most_common())
            failed = reference.retried.total()
            console.print(f"verify: the reference failed {failed} requests ({kinds}); each was retried until it answered")
    if reused := sum(a.reused for a in audits):
        earlier = sum(a.reused_cost_usd for a in audits)
        bought = sum(a.cost_usd for a in audits) - earlier
        console.print(
            f"verify: {reused} probe replies (${earlier:.4f}) were bought by an earlier run within "
            f"verify.reuse_paid_replies_h and used again; ${bought:.4f} bought now"
        )
    return audits, rounds, reference_model


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
            f"<td>{v.completions} in {v.rounds} round(s); e-value {v.e_value:.3g}{_unusable_html(v)}</td>"
            f"<td>${v.cost_usd:.5f}</td></tr>"
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
sequential audit (testing by betting: the verdicts hold however many rounds were looked at), up to
{len(verdicts.probe_ids)} probe prompts, total probe cost ${verdicts.cost_usd:.5f}{_reused_html(verdicts)}.
MLflow run {verdicts.verification_run_id}.
Tests marked baseline are the fixed-sample tests on the first round, reported for comparison; they decide nothing.</p>
{_calibration_html(verdicts)}
<table><tr><th>provider</th><th>declares</th><th>mode</th><th>verdict</th><th>effects [95% CI]</th><th>tests</th><th>power</th>
<th>audit</th><th>cost</th></tr>{"".join(rows)}</table>{plots}</body></html>
"""


def _calibration_html(verdicts: Verdicts) -> str:
    c = verdicts.calibration
    if c is None:
        return ""
    return f"<p class='{'measured' if c.measured_for_model else 'caveat'}'>Calibration: {html.escape(c.note)}.</p>"


def _reused_html(verdicts: Verdicts) -> str:
    n = sum(v.reused_replies for v in verdicts.providers)
    return f" (${verdicts.reused_cost_usd:.5f} of it for {n} replies bought by an earlier run and used again)" if n else ""


def _unusable_html(v: ProviderVerdict) -> str:
    notes = [f"unusable: {html.escape(v.unusable_text())}"] if v.unusable else []
    notes += [f"{v.possibly_billed} timed out, possibly billed"] if v.possibly_billed else []
    return "".join(f"<br><small>{note}</small>" for note in notes)


def show(verdicts: Verdicts, console: Console) -> None:
    table = Table(title="Verification", title_justify="left")
    for column in ("provider", "tag", "declares", "mode", "completions", "unusable", "verdict", "reason"):
        table.add_column(column)
    for v in verdicts.providers:
        table.add_row(v.provider, v.tag, v.declared_quantization, v.mode, str(v.completions), str(v.failed_requests),
                      v.verdict, v.reason)  # fmt: skip
    console.print(table)
    for v in verdicts.providers:  # every probe that could not be used, and why
        notes = [f"{v.failed_requests} of {v.completions + v.failed_requests} completions unusable ({v.unusable_text()})"]
        notes = notes if v.unusable else []
        if v.possibly_billed:
            notes.append(f"{v.possibly_billed} requests timed out after they were sent (retried; they may have been billed)")
        if notes:
            console.print(f"verify: {v.tag}: " + "; ".join(notes), soft_wrap=True)
    if verdicts.calibration is not None and not verdicts.calibration.measured_for_model:
        console.print(f"[yellow]verify: {verdicts.calibration.note}[/]", soft_wrap=True)


def log_provider_runs(run: StageRun, verdicts: list[ProviderVerdict], margin: Margins) -> list[ProviderVerdict]:
    out = []
    for v in verdicts:
        child = run.child(
            v.tag, {"provider": v.provider, "tag": v.tag, "declared_precision": v.declared_quantization, "verdict": v.verdict}
        )
        child.log_metrics(
            {f"effect.{k}": e.value for k, e in v.effects.items()}
            | {f"power.{k}": p for k, p in v.power.items()}
            | {"completions": v.completions, "rounds": v.rounds, "e_value": v.e_value, "failed_requests": v.failed_requests}
            | {f"unusable.{k}": n for k, n in v.unusable.items()}
            | {"possibly_billed": v.possibly_billed, "cost_usd": v.cost_usd, "reused_replies": v.reused_replies}
        )
        child.set_tags({"reason": v.reason, "mode": v.mode, "measured_precision": v.measured_precision(margin)})
        out.append(v.model_copy(update={"mlflow_run_id": child.run_id}))
    return out


def plan(params: Params, root: Path) -> tuple[list[ProviderRow], list[Row], list[Probe]]:
    """The surveyed endpoints, the ones to audit and the probes, after the cost check."""
    paths = params.paths
    surveyed = read_providers(root / paths.survey_providers)
    rows = subjects_to_audit(surveyed, params)
    if not rows:
        raise ConfigError(f"{root / paths.survey_providers}: no provider to verify (the survey found no candidate)")
    cost = sum(probe_cost(r.surveyed, params.verify) for r in rows)
    if cost > params.verify.max_cost_usd:
        raise ConfigError(f"the planned probe cost ${cost:.4f} exceeds verify.max_cost_usd ${params.verify.max_cost_usd:g}")
    datasets = {name: load_prompts(paths.prompt_file(root, name)) for name in params.datasets}
    return surveyed, rows, select_probes(datasets, count=params.verify.max_probes_per_provider, seed=params.verify.seed)


def decide(
    params: Params,
    run: StageRun,
    *,
    rows: list[Row],
    probes: list[Probe],
    audits: list[Audit],
    rounds: list[int],
    reference_model: str,
    calibration: CalibrationFile,
) -> Verdicts:
    """The verdicts of the audits (each provider's child run logged), as ``verdicts.json`` holds them."""
    v, m, d = params.verify, params.verify.margin, params.verify.decision
    decided = decision.verdicts([r.subject for r in rows], audits, m, d, rounds=rounds, seed=v.seed)
    decided = log_provider_runs(run, [accounted(p, a) for p, a in zip(decided, audits, strict=True)], m)
    verdicts = Verdicts(
        model=params.survey.model,
        reference_model=reference_model,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        params_sha256=section_digest(v),
        alpha=d.alpha,
        correction=d.correction,
        probe_ids=[p.id for p in probes[: max(rounds, default=0) * v.probes.prompts]],
        verification_run_id=run.run_id,
        cost_usd=round(sum(a.cost_usd for a in audits), 8),
        reused_cost_usd=round(sum(a.reused_cost_usd for a in audits), 8),
        calibration=Calibration.of(
            params.survey.model,
            controls=[c.name for c in calibration.controls],
            note=calibration.note if calibration.measured else "",
            margin=m,
            decision=d,
            monitor_margin=calibration.generation.margin if calibration.generation else None,
            monitor_settings=calibration.generation.settings if calibration.generation else None,
        ),
        providers=decided,
    )
    return Verdicts.model_validate(verdicts.model_dump())


def plots(params: Params, audits: list[Audit], verdicts: Verdicts) -> dict[str, bytes]:
    """One PNG per provider: its measurements and its e-process against Holm's first threshold."""
    m = params.verify.margin
    images: dict[str, bytes] = {}
    threshold = len(audits) / params.verify.decision.alpha  # Holm's first step: the most a provider's e-process must reach
    for audit, verdict in zip(audits, verdicts.providers, strict=True):
        series = summary_values(audit)
        title = f"{verdict.tag} (declares {verdict.declared_quantization}): {verdict.verdict}"
        if audit.mode == "logprob":
            images[verdict.tag] = figures.logprob_audit(title, series["deltas"], series["completion_means"],
                                                        margin=m.mean_abs_dlogprob, tail=m.tail_dlogprob,
                                                        wealth=verdict.e_path, threshold=threshold)  # fmt: skip
        else:
            images[verdict.tag] = figures.sample_audit(title, series["provider"], series["reference"],
                                                       wealth=verdict.e_path, threshold=threshold)  # fmt: skip
    return images


def metrics(verdicts: Verdicts) -> dict[str, float | int]:
    """The metrics file: verdict counts, eligible endpoints, cost, probes, unusable replies."""
    counts = {k: sum(1 for v in verdicts.providers if v.verdict == k) for k in ("equivalent", "different", "inconclusive")}
    return {
        **counts,
        "eligible": len(verdicts.eligible()),
        "cost_usd": verdicts.cost_usd,
        "probes": len(verdicts.probe_ids),
        "unusable_completions": sum(v.failed_requests for v in verdicts.providers),
        "possibly_billed_requests": sum(v.possibly_billed for v in verdicts.providers),
    }


def tags(verdicts: Verdicts, margin: Margins) -> dict[str, str]:
    """The run's tags: who was audited, who is eligible, declared and measured precision."""
    return {
        "providers": ",".join(v.tag for v in verdicts.providers),
        "eligible": ",".join(v.tag for v in verdicts.eligible()),
        "declared_precision": ",".join(f"{v.tag}={v.declared_quantization}" for v in verdicts.providers),
        "measured_precision": " | ".join(f"{v.tag} {v.measured_precision(margin)}" for v in verdicts.providers),
        "cost_usd": f"{verdicts.cost_usd:.6f}",
    }
