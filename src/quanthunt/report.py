"""The human report: one self-contained HTML page (plots embedded as PNG data URIs)
built from the pipeline's artefacts, and the CSV series behind ``dvc plots``."""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quanthunt import figures
from quanthunt.params import Decision, Margins
from quanthunt.survey import ProviderRow
from quanthunt.verdicts import Verdicts


@dataclass(frozen=True)
class DatasetView:
    """A validated dataset as the report sees it."""

    name: str
    records: list[dict[str, Any]]
    card: dict[str, Any] | None
    validation: dict[str, Any] | None
    generation: dict[str, Any] | None


def cost_rows(datasets: Sequence[DatasetView]) -> list[dict[str, Any]]:
    """Cost and records per (dataset, endpoint), from each record's per-turn provenance (a
    record is counted for every endpoint that served one of its turns)."""
    cost: dict[tuple[str, str, str], float] = defaultdict(float)
    records: Counter[tuple[str, str, str]] = Counter()
    for d in datasets:
        for record in d.records:
            turns = record["provenance"].get("turns") or []
            for turn in turns:
                cost[(d.name, turn["endpoint_tag"], turn["provider"])] += float(turn.get("cost_usd") or 0.0)
            records.update({(d.name, t["endpoint_tag"], t["provider"]) for t in turns})
    return [
        {"dataset": ds, "tag": tag, "provider": p, "cost_usd": round(c, 8), "records": records[(ds, tag, p)]}
        for (ds, tag, p), c in sorted(cost.items())
    ]


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


def power_curves(verdicts: Verdicts, margin: Margins, policy: Decision) -> bytes:
    """The sequential audit's power to catch a ``mixture_share`` mixture, by audited
    completions, in each mode (exact, from the calibrated per-completion detection rates),
    against ``min_power``; each provider is marked at the completions it was audited with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quanthunt.decision import mixture_power

    top = max([v.completions for v in verdicts.providers] + [60])
    fig, ax = plt.subplots(figsize=(6.5, 3.2), dpi=110)
    providers = len(verdicts.providers)
    for mode, color in (("logprob", "#4477aa"), ("sample", "#ee6677")):
        curve = mixture_power(mode, top, providers=providers, margin=margin, policy=policy)
        ax.plot(range(1, top + 1), curve, color=color, label=f"{mode} mode")
        for v in verdicts.providers:
            if v.mode == mode and v.completions:  # top covers every provider's audit
                ax.plot([v.completions], [curve[v.completions - 1]], "o", color=color, markersize=4)
                ax.annotate(v.provider, (v.completions, curve[v.completions - 1]), fontsize=6, rotation=30)
    ax.axhline(policy.min_power, color="grey", linewidth=0.8, linestyle="--", label=f"min_power {policy.min_power:g}")
    ax.set_xlabel("audited completions (dots: each provider's audit)")
    ax.set_ylabel(f"P(catch a {policy.mixture_share:.0%} mixture)")
    ax.set_title(f"Sequential tail test at α = {policy.alpha}, worst case of the correction", fontsize=9)
    ax.legend(fontsize=7)
    return figures.png(fig)


def token_histograms(datasets: Sequence[DatasetView]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.2), dpi=110)
    for d in datasets:
        tokens = [r["provenance"]["usage"]["completion_tokens"] for r in d.records]
        chars = [len(r["conversations"][-1]["content"]) for r in d.records]
        left.hist(tokens, bins=15, histtype="step", label=d.name)
        right.hist(chars, bins=15, histtype="step", label=d.name)
    left.set_xlabel("completion tokens per record")
    right.set_xlabel("characters in the last answer")
    left.legend(fontsize=6)
    return figures.png(fig)


def _img(png: bytes, alt: str) -> str:
    caption = html.escape(alt)
    return f"<figure><img alt='{caption}' src='{figures.data_uri(png)}'><figcaption>{caption}</figcaption></figure>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr class='{classes[i] if classes else ''}'>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><tr>{head}</tr>{body}</table>"


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
    if not rows:
        return "<p>No monitored generation yet.</p>"
    table = _table(["dataset", "provider", "monitored replies", "e-value", "stops at", "stopped", "records quarantined"], rows)
    return table + "".join(parts)


def render(
    *,
    model: str,
    providers: Sequence[ProviderRow],
    verdicts: Verdicts,
    provider_plots: Mapping[str, bytes],
    datasets: Sequence[DatasetView],
    margin: Margins,
    policy: Decision,
) -> str:
    """The whole page."""
    costs = cost_rows(datasets)
    by_endpoint: Counter[str] = Counter()
    by_dataset: Counter[str] = Counter()
    for row in costs:
        by_endpoint[row["tag"]] += row["cost_usd"]
        by_dataset[row["dataset"]] += row["cost_usd"]
    records = sum(len(d.records) for d in datasets)
    tokens = sum(r["provenance"]["usage"]["completion_tokens"] for d in datasets for r in d.records)
    generation_cost = sum(by_dataset.values())
    survey = _table(
        ["provider", "tag", "declares", "$/M in", "$/M out", "status", "uptime", "logprobs", "decision"],
        [
            [
                r.provider,
                r.tag,
                r.declared_quantization,
                f"{r.prompt_usd_per_m:.2f}",
                f"{r.completion_usd_per_m:.2f}",
                r.status,
                r.uptime_last_30m,
                "yes" if r.supports_logprobs else "no",
                r.reason,
            ]
            for r in providers
        ],
    )
    verdict_rows = []
    for v in verdicts.providers:
        effects = "; ".join(f"{k} {e.value:.3g} [{e.ci_low:.3g}, {e.ci_high:.3g}]" for k, e in v.effects.items())
        tests = "; ".join(
            f"{t.name}: p={t.p_value:.2g}" + (f" (adj {t.p_adjusted:.2g})" if t.p_adjusted is not None else "") for t in v.tests
        )
        power = ", ".join(f"{k} {p:.2f}" for k, p in v.power.items())
        verdict_rows.append(
            [
                v.provider,
                v.tag,
                v.declared_quantization,
                v.mode,
                v.verdict,
                v.reason,
                effects,
                tests,
                power,
                v.completions,
                f"${v.cost_usd:.5f}",
                v.mlflow_run_id or "",
            ]
        )
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
    )
    dataset_rows = []
    for d in datasets:
        validation = d.validation or {}
        dataset_rows.append(
            [
                d.name,
                len(d.records),
                sum(r["provenance"]["usage"]["completion_tokens"] for r in d.records),
                f"${by_dataset.get(d.name, 0.0):.5f}",
                validation.get("status", "not validated"),
                validation.get("truncated_share", ""),
                validation.get("near_duplicate_share", ""),
                (d.card or {}).get("mlflow", {}).get("validate_run_id", ""),
            ]
        )
    dataset_table = _table(
        ["dataset", "records", "output tokens", "cost", "validation", "truncated", "near-duplicates", "MLflow validate run"],
        dataset_rows,
    )
    plots = "".join(_img(png, f"distribution shift: {name}") for name, png in provider_plots.items())
    cost_plots = ""
    if by_endpoint:
        cost_plots += _img(figures.bars("Generation cost by endpoint (USD)", dict(by_endpoint), xlabel="USD"), "cost by endpoint")
        cost_plots += _img(figures.bars("Generation cost by dataset (USD)", dict(by_dataset), xlabel="USD"), "cost by dataset")
    token_plot = _img(token_histograms(datasets), "tokens and lengths per dataset") if records else ""
    monitoring = monitor_section(datasets)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>quanthunt report: {html.escape(model)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse;margin:1em 0;font-size:13px}}
td,th{{border:1px solid #ccc;padding:4px 6px;vertical-align:top}} th{{background:#f4f4f4}}
.equivalent{{background:#e8f5e9}} .different{{background:#ffebee}} .inconclusive{{background:#fff8e1}}
figure{{display:inline-block;margin:0.5em}} img{{max-width:680px}} figcaption{{font-size:12px;color:#555}}
</style></head>
<body>
<h1>quanthunt: {html.escape(model)}</h1>
<p id="summary">{records} training records ({tokens:,} output tokens) across {len(datasets)} datasets for ${generation_cost:.5f};
verification probes ${verdicts.cost_usd:.5f}. Reference deployment: {html.escape(verdicts.reference_model)}.
Verification MLflow run: {html.escape(verdicts.verification_run_id or "")}.</p>
<h2 id="providers">Providers (survey)</h2>{survey}
<h2 id="verdicts">Verdicts</h2>
<p>α = {verdicts.alpha}, {verdicts.correction} correction across providers; equivalence is only shown against a margin.</p>
{verdict_table}
<h2 id="shift">Distribution shift per provider</h2>{plots or "<p>No verification plots found.</p>"}
<h2 id="power">Power of the tests</h2>{_img(power_curves(verdicts, margin, policy), "power curves")}
<h2 id="datasets">Datasets</h2>{dataset_table}
<h2 id="monitoring">Monitoring during generation</h2>{monitoring}
<h2 id="cost">Cost</h2>{cost_plots or "<p>No generated records yet.</p>"}
<h2 id="tokens">Tokens and lengths</h2>{token_plot or "<p>No generated records yet.</p>"}
<script>
window.addEventListener("load", () => {{
  const loaded = [...document.images].filter((i) => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.imagesLoaded = String(loaded);
  document.body.dataset.imagesTotal = String(document.images.length);
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
