"""``quanthunt compare``: runs of one stage side by side, from MLflow."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from quanthunt.params import load_params
from quanthunt.tracking import latest_stage, repo_root, search_stage_runs

SHOWN_TAGS = (
    "providers",
    "candidates",
    "cost_usd",
    "measured_precision",
    "dvc.exp_name",
    "git.commit",
    "quanthunt.error",
)


def differing(runs: list[dict[str, Any]], field: str) -> list[str]:
    """Keys of ``field`` whose values are not the same in every run."""
    keys = sorted({k for r in runs for k in r[field]})
    return [k for k in keys if len({json.dumps(r[field].get(k)) for r in runs}) > 1]


def label(run: dict[str, Any]) -> str:
    """``validate@chat 24626e18``: the DVC stage name (with its dataset) and the short run id."""
    stage = f"{run['stage']}@{run['dataset']}" if run["dataset"] else run["stage"]
    return f"{stage} {run['run_id'][:8]}"


def compare(
    stage: Annotated[
        str | None,
        typer.Option(help="Runs of this stage (survey, verify, generate, validate, report); default: the latest run's."),
    ] = None,
    dataset: Annotated[str | None, typer.Option(help="Only runs of this dataset (generate, validate).")] = None,
    last: Annotated[int, typer.Option(help="How many of the newest runs.", min=1)] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    params: Annotated[Path, typer.Option("--params", help="The params file (locates the repo and experiment).")] = Path(
        "params.yaml"
    ),
) -> None:
    """Show runs of one stage side by side: params that differ, metrics, cost and providers.

    Usage: `quanthunt compare` (the latest stage), `quanthunt compare --stage validate --dataset chat`.
    """
    settings = load_params(params)
    root = repo_root(params)
    experiment = settings.tracking.experiment
    stage = stage or latest_stage(root, experiment)
    runs = search_stage_runs(root, experiment, stage=stage, dataset=dataset, last=last) if stage else []
    if as_json:
        json.dump(runs, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not runs:
        console.print("No stage runs recorded yet." if stage is None else f"No runs of stage {stage} recorded yet.")
        return
    title = f"{len(runs)} run(s) of stage {stage}" + (f", dataset {dataset}" if dataset else "")
    table = Table(title=title, title_justify="left")
    table.add_column("field")
    for run in runs:
        table.add_column(f"{label(run)}\n{run['started']}")
    table.add_row("status", *(r["status"] for r in runs))
    for key in differing(runs, "params") if len(runs) > 1 else sorted(runs[0]["params"]):
        table.add_row(f"param {key}", *(str(r["params"].get(key, "")) for r in runs))
    for key in sorted({k for r in runs for k in r["metrics"]}):
        table.add_row(f"metric {key}", *(f"{r['metrics'][key]:g}" if key in r["metrics"] else "" for r in runs))
    for tag in SHOWN_TAGS:
        if any(tag in r["tags"] for r in runs):
            table.add_row(tag, *(r["tags"].get(tag, "") for r in runs))
    console.print(table)
