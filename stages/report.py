"""Report stage: ``reports/index.html`` for people, and the CSV series ``dvc plots``
draws (verification effects, cost by dataset and provider)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from quanthunt.outputs import Outputs
from quanthunt.report import DatasetView, cost_rows, csv_text, json_lines, render, verification_rows
from quanthunt.stage import Stage
from quanthunt.survey import read_providers
from quanthunt.verdicts import load_verdicts


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def main(params_path: Path, *, console: Console | None = None) -> None:
    """Build the report from whatever the pipeline has produced."""
    stage = Stage.open("report", params_path, console)
    params, root, paths, console = stage.params, stage.root, stage.paths, stage.console
    providers = read_providers(root / paths.survey_providers)
    verdicts = load_verdicts(root / paths.verdicts)
    plots = {}
    for v in verdicts.providers:
        png = paths.plot(root, v.tag)
        if png.exists():
            plots[v.tag] = png.read_bytes()
    datasets = []
    for name in params.datasets:
        files = paths.of(root, name)
        records = json_lines(files.final.read_text(encoding="utf-8")) if files.final.exists() else []
        datasets.append(DatasetView(name, records, _json(files.card), _json(files.validate_report)))
    m, d = verdicts.margin_or(params.verify.margin), verdicts.decision_or(params.verify.decision)  # what verify decided with
    with stage.tracked(params.verify.decision) as run:
        page = render(
            model=params.survey.model,
            providers=providers,
            verdicts=verdicts,
            provider_plots=plots,
            datasets=datasets,
            margin=m,
            policy=d,
            plan=_json(root / paths.survey_plan),
        )
        costs = cost_rows(datasets)
        with Outputs() as out:
            out.write_text(root / paths.report, page)
            out.write_text(
                root / paths.plots_verification,
                csv_text(verification_rows(verdicts), ["tag", "provider", "verdict", "mode", "effect", "ci_low", "ci_high"]),
            )
            out.write_text(root / paths.plots_cost, csv_text(costs, ["dataset", "tag", "provider", "cost_usd", "records"]))
        run.log_artifact(root / paths.report)
        run.log_metrics({"records": sum(len(x.records) for x in datasets), "cost_usd": sum(r["cost_usd"] for r in costs)})
        console.print(f"report: {root / paths.report}")
