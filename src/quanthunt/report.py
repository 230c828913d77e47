"""The human report: one self-contained HTML page (plots embedded as PNG data URIs)
built from the pipeline's artefacts, and the CSV series behind ``dvc plots``.

The page tells the audit in order: who was surveyed, excluded and why; who was audited
and with what result (the overview figure); who served how much data at what cost; the
budget plan against the spend; then the detail behind each."""

from __future__ import annotations

import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quanthunt import figures
from quanthunt.params import Decision, Margins, PurchasePlan
from quanthunt.survey import ProviderRow, price_scenario
from quanthunt.verdicts import Estimate, ProviderVerdict, Verdicts


@dataclass(frozen=True)
class DatasetView:
    """A validated dataset as the report sees it: its final records, provenance card and
    validation metrics (each None or empty until the stage has run)."""

    name: str
    records: list[dict[str, Any]]
    card: dict[str, Any] | None
    validation: dict[str, Any] | None

    @property
    def cost_usd(self) -> float:
        """The card's cost of the exported records (0 before validation)."""
        return float((self.card or {}).get("cost_usd", 0.0))

    @property
    def possibly_billed_usd(self) -> float:
        """What the card's ledger figures say may have been billed beyond the settled spend."""
        return float(((self.card or {}).get("spend") or {}).get("possibly_billed_usd", 0.0))


@dataclass(frozen=True)
class Served:
    """What one endpoint served across the datasets, from the final records' turns."""

    provider: str
    tag: str
    records: Counter[str]
    """Records per dataset with at least one turn from this endpoint."""
    turns: int
    output_tokens: int
    cost_usd: dict[str, float]
    """USD of its replies per dataset."""

    @property
    def cost(self) -> float:
        return sum(self.cost_usd.values())


def served(datasets: Sequence[DatasetView]) -> list[Served]:
    """Per endpoint, in order of records served: records, turns, output tokens and cost of
    its replies (a record counts for every endpoint that served one of its turns)."""
    records: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    cost: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    turns: Counter[tuple[str, str]] = Counter()
    tokens: Counter[tuple[str, str]] = Counter()
    for d in datasets:
        for record in d.records:
            seen = set()
            for turn in record["provenance"].get("turns") or []:
                key = (turn["provider"], turn["endpoint_tag"])
                seen.add(key)
                turns[key] += 1
                tokens[key] += int(turn.get("completion_tokens") or 0)
                cost[key][d.name] += float(turn.get("cost_usd") or 0.0)
            for key in seen:
                records[key][d.name] += 1
    rows = [Served(p, tag, records[(p, tag)], turns[(p, tag)], tokens[(p, tag)], dict(cost[(p, tag)])) for p, tag in turns]
    return sorted(rows, key=lambda s: (-s.records.total(), s.tag))


def cost_rows(datasets: Sequence[DatasetView]) -> list[dict[str, Any]]:
    """Cost and records per (dataset, endpoint) for ``dvc plots``."""
    rows = [
        {"dataset": name, "tag": s.tag, "provider": s.provider, "cost_usd": round(s.cost_usd[name], 8), "records": n}
        for s in served(datasets)
        for name, n in s.records.items()
    ]
    return sorted(rows, key=lambda r: (r["dataset"], r["tag"], r["provider"]))


def sampler_effect(v: ProviderVerdict) -> Estimate | None:
    """Mean Φ(rank z): ½ for the reference's own sampler (both modes)."""
    return v.effects.get("mean_pit")


def logprob_effect(v: ProviderVerdict) -> Estimate | None:
    """Mean |Δ logprob| per completion, clipped at the tail as the test bets on it (logprob mode)."""
    return v.effects.get("mean_abs_dlogprob_clipped") or v.effects.get("mean_abs_dlogprob")


def verification_rows(verdicts: Verdicts) -> list[dict[str, Any]]:
    rows = []
    for v in verdicts.providers:
        effect = v.effects.get("mean_abs_dlogprob") or v.effects.get("rank_z")
        rows.append(
            {
                "tag": v.tag,
                "provider": v.provider,
                "verdict": v.verdict,
                "mode": v.mode,
                "effect": effect.value if effect else 0.0,
                "ci_low": effect.ci_low if effect else 0.0,
                "ci_high": effect.ci_high if effect else 0.0,
            }
        )
    return rows


def overview_figure(verdicts: Verdicts, margin: Margins) -> bytes:
    def interval(e: Estimate | None) -> figures.Interval | None:
        return (e.value, e.ci_low, e.ci_high) if e else None

    rows = [
        figures.OverviewRow(
            f"{v.provider} ({v.completions})",
            v.verdict,
            interval(sampler_effect(v)),
            interval(logprob_effect(v)) if v.mode == "logprob" else None,
            "sample mode: no logprobs" if v.mode == "sample" else "no completion measured",
        )
        for v in verdicts.providers
    ]
    return figures.overview(
        rows,
        sampler_shift=margin.sampler_shift,
        sampler_equivalence=margin.sampler_equivalence,
        logprob_margin=margin.mean_abs_dlogprob,
        tail=margin.tail_dlogprob,
    )


def power_curves(verdicts: Verdicts, margin: Margins, policy: Decision) -> bytes:
    """The sequential audit's power to catch a ``mixture_share`` mixture, by audited
    completions, in each mode (exact, from the calibrated per-completion detection rates),
    against ``min_power``; the providers are marked at the completions they were audited
    with (one marker and legend entry per mode and count)."""
    from quanthunt.decision import mixture_power

    audited: dict[tuple[str, int], list[str]] = defaultdict(list)
    for v in verdicts.providers:
        if v.completions:
            audited[(v.mode, v.completions)].append(v.provider)
    top = max([n for _, n in audited] + [60])
    top = int(top * 1.1) + 1
    fig, ax = figures.subplots(height=3.4)
    providers = len(verdicts.providers)
    markers = "osD^v<>p*h"
    for mode, color in (("logprob", "#4477aa"), ("sample", "#ee6677")):
        curve = mixture_power(mode, top, providers=providers, margin=margin, policy=policy)
        ax.plot(range(1, top + 1), curve, color=color, label=f"{mode} mode")
        groups = sorted((n, names) for (m, n), names in audited.items() if m == mode)
        for number, (n, names) in enumerate(groups):
            ax.plot([n], [curve[n - 1]], markers[number % len(markers)], color=color, markersize=7,
                    markeredgecolor="black", label=f"audited: {', '.join(names)} ({n})")  # fmt: skip
    ax.axhline(policy.min_power, color="#222222", linewidth=1, linestyle="--",
               label=f"min_power {policy.min_power:g} (verify.decision.min_power)")  # fmt: skip
    ax.set_xlim(0, top)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("audited completions")
    ax.set_ylabel(f"P(catch a {policy.mixture_share:.0%} mixture)")
    ax.set_title(f"Sequential tail test at α = {policy.alpha:g}, worst case of the {policy.correction} correction",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figures.png(fig)


def token_histograms(datasets: Sequence[DatasetView]) -> bytes:
    fig, (left, right) = figures.subplots(2, height=3.0)
    for d in datasets:
        if not d.records:
            continue
        tokens = [r["provenance"]["usage"]["completion_tokens"] for r in d.records]
        chars = [len(r["conversations"][-1]["content"]) for r in d.records]
        left.hist(tokens, bins=15, histtype="step", linewidth=1.5, label=d.name)
        right.hist(chars, bins=15, histtype="step", linewidth=1.5, label=d.name)
    left.set_xlabel("completion tokens per record")
    left.set_ylabel("records")
    right.set_xlabel("characters in the last answer")
    right.set_ylabel("records")
    right.legend(title="dataset", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figures.png(fig)


def _img(png: bytes, caption: str) -> str:
    text = html.escape(caption)
    return f"<figure><img alt='{text}' src='{figures.data_uri(png)}'><figcaption>{text}</figcaption></figure>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] | None = None, *, kind: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr class='{classes[i] if classes else ''}'>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<div class='wide'><table class='{kind}'><tr>{head}</tr>{body}</table></div>"


def _usd(value: float) -> str:
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:,.4f}"


def _estimate(e: Estimate | None) -> str:
    return f"{e.value:.3g} [{e.ci_low:.3g}, {e.ci_high:.3g}]" if e else "—"


def _section(anchor: str, title: str, body: str) -> str:
    return f"<section id='{anchor}'><h2>{html.escape(title)}</h2>{body}</section>"


def monitor_section(datasets: Sequence[DatasetView]) -> str:
    """Each dataset's monitors (from its card): the e-process of every provider over the
    run, and what was stopped and quarantined."""
    parts = []
    rows = []
    for d in datasets:
        card = d.card or {}
        monitored = {p["tag"]: p["monitor"] for p in card.get("providers", []) if p.get("monitor")}
        paths = {tag: m["e_path"] for tag, m in monitored.items() if m["e_path"]}
        if paths:
            thresholds = {tag: m["threshold"] for tag, m in monitored.items() if m["threshold"] is not None}
            parts.append(_img(figures.monitors(f"{d.name}: monitors", paths, thresholds), f"monitors of {d.name}"))
        quarantined = card.get("quarantined", {}).get("by_provider", {})
        for tag, m in monitored.items():
            stop = m["stopped"]
            e_value = f"{m['e_path'][-1][1]:.3g}" if m["e_path"] else ""
            threshold = f"{m['threshold']:.3g}" if m["threshold"] is not None else ""
            stopped = "no" if stop is None else f"at reply {stop['at']} ({stop['test']})"
            rows.append([d.name, tag, m["replies"], e_value, threshold, stopped, quarantined.get(tag, 0)])
    caveats = sampling_caveats(datasets)
    if not rows:
        return "<p>No monitored generation yet.</p>" + caveats
    table = _table(["dataset", "provider", "monitored replies", "e-value", "stops at", "stopped", "records quarantined"], rows)
    return table + caveats + "".join(parts)


def sampling_caveats(datasets: Sequence[DatasetView]) -> str:
    """What the audit did not verify of the sampling each dataset was generated with (the
    card's ``verified_sampling``), one paragraph per distinct note with its datasets."""
    by_note: dict[str, list[str]] = {}
    for d in datasets:
        verified = (d.card or {}).get("verified_sampling") or {}
        if verified.get("differs"):
            by_note.setdefault(verified["note"], []).append(d.name)
    return "".join(
        f"<p class='caveat'><b>{html.escape(', '.join(names))}</b>: {html.escape(note)}.</p>" for note, names in by_note.items()
    )


def survey_section(providers: Sequence[ProviderRow], verdicts: Verdicts, by_tag: Mapping[str, Served]) -> str:
    """Every surveyed endpoint: the survey's decision and why, whether it was audited and
    the verdict, and whether it served data."""
    audited = {v.tag: v for v in verdicts.providers}
    excluded = [r for r in providers if not r.is_candidate]
    checked = [r.provider for r in excluded if r.tag in audited]
    rows, classes = [], []
    for r in providers:
        v = audited.get(r.tag)
        s = by_tag.get(r.tag)
        rows.append([r.provider, r.tag, r.declared_quantization, f"{r.prompt_usd_per_m:.2f}", f"{r.completion_usd_per_m:.2f}",
                     "" if r.status is None else r.status, "" if r.uptime_last_30m is None else r.uptime_last_30m,
                     "yes" if r.supports_logprobs else "no", r.reason,
                     f"audited: {v.verdict}" if v else "not audited", s.records.total() if s else 0])  # fmt: skip
        classes.append(v.verdict if v else "skipped")
    lead = (
        f"<p>{len(providers)} endpoints surveyed; {len(providers) - len(excluded)} candidate(s); {len(excluded)} excluded by "
        f"the policy ({html.escape('; '.join(f'{r.provider}: {r.reason}' for r in excluded)) or 'none'}). "
        f"{len(audited)} audited, {len(checked)} of them excluded ones audited to check what they declare"
        f"{' (' + html.escape(', '.join(checked)) + ')' if checked else ''}; "
        f"{sum(not r.is_candidate and r.tag not in audited for r in providers)} not audited; "
        "only candidates found equivalent serve training data.</p>"
    )
    headers = ["provider", "tag", "declares", "$/M in", "$/M out", "status", "uptime %", "logprobs", "survey decision",
               "audit", "records served"]  # fmt: skip
    return lead + _table(headers, rows, classes)


def overview_section(verdicts: Verdicts, margin: Margins) -> str:
    if not verdicts.providers:
        return "<p>No provider was audited.</p>"
    caption = (
        "Every audited provider's effects with 95 % intervals, coloured by verdict. Left: the sampler, mean Φ(rank z) "
        f"of its tokens − ½ (0 for the reference), equivalent within ±{margin.sampler_equivalence:g} (shaded), "
        f"different beyond ±{margin.sampler_shift:g} (dotted). Right (logprob mode): the numbers, mean |Δ logprob| "
        f"per completion clipped at {margin.tail_dlogprob:g} (dotted: extreme), equivalent within "
        f"{margin.mean_abs_dlogprob:g} (shaded). Margins: those verify decided with (verify.margin, or a "
        "calibration's, as the note below says)."
    )
    rows = [
        [
            v.provider,
            v.tag,
            v.verdict,
            v.mode,
            v.completions,
            _estimate(sampler_effect(v)),
            _estimate(logprob_effect(v)) if v.mode == "logprob" else "—",
            _estimate(v.effects.get("mean_abs_dlogprob")) if v.mode == "logprob" else "—",
            f"{math.log10(v.e_value):.1f}" if v.e_value > 0 else "−∞",
            v.reason,
        ]
        for v in verdicts.providers
    ]
    # As tested, every completion past the tail counts as the tail: all coarse providers read
    # the same (0.25); unclipped, how far off each one is can be told apart.
    headers = ["provider", "tag", "verdict", "mode", "completions", "mean Φ(rank z) [95% CI]",
               f"mean |Δ logprob| as tested, clipped at {margin.tail_dlogprob:g} [95% CI]",
               "mean |Δ logprob| unclipped [95% CI]", "log10 e-value (largest)", "why"]  # fmt: skip
    table = _table(headers, rows, [v.verdict for v in verdicts.providers])
    calibration = verdicts.calibration
    if calibration is None:
        note = "<p class='caveat'>Calibration: not recorded (verdicts from before quanthunt recorded it).</p>"
    else:
        kind = "measured" if calibration.measured_for_model else "caveat"
        note = f"<p class='{kind}'>Calibration: {html.escape(calibration.note)}.</p>"
    return _img(overview_figure(verdicts, margin), caption) + note + table


def served_section(
    rows: Sequence[Served], verdicts: Verdicts, datasets: Sequence[DatasetView], providers: Sequence[ProviderRow]
) -> str:
    """Who served the exported records and what their replies cost: per output token as
    paid (the prompts' cost included, so above the list price of an output token), beside
    the endpoint's list prices from the survey."""
    if not rows:
        return "<p>No generated records yet.</p>"
    audited = {v.tag: v for v in verdicts.providers}
    listed = {r.tag: r for r in providers}
    table = []
    for s in rows:
        v = audited.get(s.tag)
        cost = s.cost
        per_m = f"{cost / s.output_tokens * 1e6:.2f}" if s.output_tokens else "—"
        price = listed.get(s.tag)
        list_price = f"{price.prompt_usd_per_m:.2f} / {price.completion_usd_per_m:.2f}" if price else "—"
        table.append([s.provider, s.tag, v.declared_quantization if v else "?", v.verdict if v else "not audited",
                      s.records.total(), s.turns, f"{s.output_tokens:,}", _usd(cost), per_m, list_price,
                      ", ".join(f"{name} {n}" for name, n in sorted(s.records.items()))])  # fmt: skip
    headers = ["provider", "tag", "declares", "verdict", "records", "turns", "output tokens", "cost of its replies",
               "$ per M output tokens paid (prompts included)", "list $/M in / out", "records by dataset"]  # fmt: skip
    paid = sum(d.cost_usd for d in datasets)
    replies = sum(s.cost for s in rows)
    lead = (
        f"<p>{sum(len(d.records) for d in datasets)} validated records from {len(rows)} endpoints. Paid for generation "
        f"(validate cards, every attempt): {_usd(paid)}; of it the exported replies: {_usd(replies)}.</p>"
    )
    figure = figures.served({s.provider: dict(s.records) for s in rows}, {s.provider: dict(s.cost_usd) for s in rows})
    return lead + _table(headers, table) + _img(figure, "records and cost per provider, by dataset")


def budget_section(
    plan: Mapping[str, Any] | None, verdicts: Verdicts, datasets: Sequence[DatasetView], providers: Sequence[ProviderRow]
) -> str:
    """The survey's budget plan (``budget_plan.json``) against the spend: the audit's cost
    against its worst case, the tokens bought against the target, and the price paid
    projected to the whole target. The survey planned over every candidate before the
    audit; each scenario says what the audit found of its endpoint, and the plan is priced
    again at the cheapest endpoint the audit found eligible (the one generation can use)."""
    if not plan:
        return "<p>No budget plan found (run the survey stage).</p>"
    budget = float(plan["budget_usd"])
    target = int(plan["target_output_tokens"])
    bought = sum(int((d.card or {}).get("tokens", {}).get("completion", 0)) for d in datasets)
    paid = sum(d.cost_usd for d in datasets)
    unknown = sum(d.possibly_billed_usd for d in datasets)
    why = "sent, then timed out or cut off, no charge confirmed yet (at most their reservations; reconciled through /generation)"
    unknown_rows = [["generation, possibly billed", _usd(unknown), why]] if unknown else []
    planned_audit = float(plan["verification"]["cost_usd"])
    per_token = paid / bought if bought else 0.0
    projected = per_token * target
    rows = [["budget (survey.budget.usd)", _usd(budget), f"{target:,} output tokens ({plan['datasets']} datasets × "
             f"{plan['output_tokens_per_dataset']:,})"]]  # fmt: skip
    audited = {v.tag: v for v in verdicts.providers}
    for s in plan["scenarios"]:
        v = audited.get(s["tag"])
        found = f"audited {v.verdict}" + ("" if v.eligible else ": not bought from") if v else "not audited"
        rows.append([f"plan at the {s['scenario']} candidate", _usd(s["total_cost_usd"]),
                     f"{s['tag']} at ${s['completion_usd_per_m']:.2f}/M out; "
                     f"{'within' if s['within_budget'] else 'over'} budget; affords {s['affordable_output_tokens']:,} "
                     f"tokens; {found}"])  # fmt: skip
    eligible = sorted((r for r in providers if r.tag in audited and audited[r.tag].eligible),
                      key=lambda r: (r.completion_usd_per_m, r.prompt_usd_per_m))  # fmt: skip
    if eligible:
        purchase = PurchasePlan(usd=budget, datasets=int(plan["datasets"]),
                                output_tokens_per_dataset=int(plan["output_tokens_per_dataset"]),
                                input_tokens_per_output_token=float(plan["input_tokens_per_output_token"]))  # fmt: skip
        best = price_scenario("cheapest eligible", eligible[0], purchase)
        rows.append(["plan at the cheapest eligible endpoint", _usd(best.total_cost_usd),
                     f"{best.tag} at ${best.completion_usd_per_m:.2f}/M out; {'within' if best.within_budget else 'over'} "
                     f"budget; affords {best.affordable_output_tokens:,} tokens"])  # fmt: skip
    elif verdicts.providers:
        rows.append(["plan at the cheapest eligible endpoint", "—", "the audit found no endpoint eligible"])
    rows += [
        ["audit, planned worst case", _usd(planned_audit), f"{plan['verification']['requests']:,} probe requests"],
        ["audit, spent", _usd(verdicts.cost_usd), f"{sum(v.probes for v in verdicts.providers):,} probes"],
        ["generation, spent", _usd(paid), f"{bought:,} output tokens of the {target:,} target ({bought / target:.4%})"],
        *unknown_rows,
        [
            "generation, projected to the target",
            _usd(projected) if bought else "—",
            f"at the ${per_token * 1e6:.2f}/M paid so far" if bought else "nothing bought yet",
        ],
        [
            "spent in all",
            _usd(verdicts.cost_usd + paid),
            f"{_usd(budget - verdicts.cost_usd - paid)} of the budget left"
            + (f", {_usd(budget - verdicts.cost_usd - paid - unknown)} if all that was possibly billed was" if unknown else ""),
        ],
    ]
    bars = [(f"plan: {s['scenario']} ({s['tag']})", float(s["total_cost_usd"]), "plan") for s in plan["scenarios"]]
    bars += [("audit, planned worst case", planned_audit, "plan"), ("audit, spent", verdicts.cost_usd, "spent"),
             ("generation, spent", paid, "spent")]  # fmt: skip
    if bought:
        bars.append(("generation, projected to the target", projected, "projected"))
    figure = figures.budget(bars, budget_usd=budget)
    return _table(["", "USD", "what"], rows) + _img(figure, "budget plan against the spend (log scale)")


def render(
    *,
    model: str,
    providers: Sequence[ProviderRow],
    verdicts: Verdicts,
    provider_plots: Mapping[str, bytes],
    datasets: Sequence[DatasetView],
    margin: Margins,
    policy: Decision,
    plan: Mapping[str, Any] | None,
) -> str:
    """The whole page."""
    endpoints = served(datasets)
    by_tag = {s.tag: s for s in endpoints}
    records = sum(len(d.records) for d in datasets)
    tokens = sum(r["provenance"]["usage"]["completion_tokens"] for d in datasets for r in d.records)
    paid = sum(d.cost_usd for d in datasets)
    unknown = sum(d.possibly_billed_usd for d in datasets)
    counts = Counter(v.verdict for v in verdicts.providers)
    excluded = sum(not r.is_candidate for r in providers)
    verdict_rows = []
    for v in verdicts.providers:
        effects = "\n".join(f"{k} {e.value:.3g} [{e.ci_low:.3g}, {e.ci_high:.3g}]" for k, e in v.effects.items())
        tests = "\n".join(
            f"{t.name}: p={t.p_value:.2g}" + (f" (adj {t.p_adjusted:.2g})" if t.p_adjusted is not None else "") for t in v.tests
        )
        power = ", ".join(f"{k} {p:.2f}" for k, p in v.power.items())
        verdict_rows.append([v.provider, v.tag, v.declared_quantization, v.mode, v.verdict, v.reason, effects, tests, power,
                             v.completions, _usd(v.cost_usd), v.mlflow_run_id or ""])  # fmt: skip
    verdict_table = _table(
        [
            "provider",
            "tag",
            "declares",
            "mode",
            "verdict",
            "why",
            "effects [95% CI]",
            "tests",
            "power",
            "completions",
            "probe cost",
            "MLflow run",
        ],
        verdict_rows,
        [v.verdict for v in verdicts.providers],
        kind="detail",
    )
    dataset_rows = []
    for d in datasets:
        validation, card = d.validation or {}, d.card or {}
        removed = card.get("removed") or {}
        by_reason = ", ".join(f"{n} {reason}" for reason, n in (removed.get("turns_by_finish_reason") or {}).items())
        dropped = (f"{removed.get('records_cut', 0)} cut, {removed.get('records_dropped', 0)} dropped ({by_reason})"
                   if by_reason else "none")  # fmt: skip
        match = (card.get("prompts") or {}).get("match_share")
        run_id = card.get("mlflow", {}).get("validate_run_id", "")
        dataset_rows.append([d.name, len(d.records), sum(r["provenance"]["usage"]["completion_tokens"] for r in d.records),
                             _usd(d.cost_usd), _usd(d.possibly_billed_usd),
                             validation.get("status", "not validated"),
                             validation.get("truncated_share", ""), dropped, "" if match is None else f"{match:.1%}",
                             validation.get("near_duplicate_share", ""), run_id])  # fmt: skip
    dataset_table = _table(
        ["dataset", "records", "output tokens", "cost", "possibly billed", "validation", "truncated", "unfinished turns removed",
         "prompts match", "near-duplicates", "MLflow validate run"],
        dataset_rows,
    )  # fmt: skip
    plots = "".join(_img(png, f"distribution shift: {name}") for name, png in provider_plots.items())
    power_caption = (
        f"Power to catch a {policy.mixture_share:.0%} mixture by audited completions; dashed: verify.decision.min_power "
        f"= {policy.min_power:g} (an equivalent verdict needs it); markers: the completions each provider was audited with."
    )
    summary = (
        f"{len(providers)} endpoints surveyed, {excluded} excluded; {len(verdicts.providers)} audited: "
        + ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
        + f". {records} training records ({tokens:,} output tokens) across {len(datasets)} dataset(s) from "
        f"{len(endpoints)} endpoints for {_usd(paid)}"
        + (f" (and {_usd(unknown)} possibly billed)" if unknown else "")
        + f"; verification probes {_usd(verdicts.cost_usd)}"
        + (f"; budget {_usd(float(plan['budget_usd']))}" if plan else "")
        + f". Reference deployment: {verdicts.reference_model}. Verification MLflow run: "
        f"{verdicts.verification_run_id or ''}."
    )
    sections = [
        _section("overview", "The audit at a glance", overview_section(verdicts, margin)),
        _section("providers", "Providers: surveyed, excluded, audited", survey_section(providers, verdicts, by_tag)),
        _section("served", "Who served the data, at what cost", served_section(endpoints, verdicts, datasets, providers)),
        _section("budget", "Budget plan against the spend", budget_section(plan, verdicts, datasets, providers)),
        _section(
            "verdicts",
            "Verdicts in detail",
            f"<p>α = {verdicts.alpha}, {verdicts.correction} correction across providers; equivalence is only shown "
            f"against a margin.</p>{verdict_table}",
        ),
        _section("shift", "Distribution shift per provider", plots or "<p>No verification plots found.</p>"),
        _section("power", "Power of the audit", _img(power_curves(verdicts, margin, policy), power_caption)),
        _section("datasets", "Datasets", dataset_table),
        _section("monitoring", "Monitoring during generation", monitor_section(datasets)),
        _section(
            "tokens",
            "Tokens and lengths",
            _img(token_histograms(datasets), "tokens and lengths per dataset") if records else "<p>No generated records yet.</p>",
        ),
    ]
    colors = "".join(f".{v}{{background:{c}22}}" for v, c in figures.VERDICT_COLORS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>quanthunt report: {html.escape(model)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1040px;padding:0 1em;color:#222;line-height:1.4}}
h2{{margin-top:1.6em;border-bottom:1px solid #ddd}} .wide{{overflow-x:auto}}
table{{border-collapse:collapse;margin:0.8em 0;font-size:13px;width:100%}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top;white-space:pre-line;overflow-wrap:anywhere}}
table.detail{{font-size:12px}}
th{{background:#f4f4f4;text-align:left}}
{colors} .skipped{{color:#777}}
figure{{margin:0.8em 0}} img{{display:block;max-width:100%;height:auto}} figcaption{{font-size:13px;color:#555}}
</style></head>
<body>
<h1>quanthunt: {html.escape(model)}</h1>
<section id="summary"><p>{html.escape(summary)}</p></section>
{"".join(sections)}
<script>
window.addEventListener("load", () => {{
  const images = [...document.images];
  const width = document.documentElement.clientWidth;
  document.body.dataset.imagesLoaded = String(images.filter((i) => i.complete && i.naturalWidth > 0).length);
  document.body.dataset.imagesTotal = String(images.length);
  document.body.dataset.imagesOverflowing = String(images.filter((i) => i.getBoundingClientRect().right > width).length);
  const tables = [...document.querySelectorAll("div.wide")];
  document.body.dataset.tablesTotal = String(tables.length);
  document.body.dataset.tablesOverflowing = String(tables.filter((t) => t.scrollWidth > t.clientWidth + 1).length);
}});
</script>
</body></html>
"""


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def json_lines(path_text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path_text.splitlines() if line.strip()]
