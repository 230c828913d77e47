"""The pipeline's stage commands; DVC runs each as a stage's ``cmd``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ParamsOption = Annotated[Path, typer.Option("--params", help="The params file to run with.")]


def survey(params: ParamsOption = Path("params.yaml")) -> None:
    """List the model's providers, apply the policy and plan the budget."""
    from stages import survey as stage

    stage.main(params)


def calibrate(params: ParamsOption = Path("params.yaml")) -> None:
    """Measure the control deployments you trust as faithful and bound verify's margins on them."""
    from stages import calibrate as stage

    stage.main(params)


def verify(params: ParamsOption = Path("params.yaml")) -> None:
    """Measure each provider against the reference deployment and decide its verdict."""
    from stages import verify as stage

    stage.main(params)


def generate(
    dataset: Annotated[str, typer.Argument(help="A dataset named in params.yaml's datasets.")],
    params: ParamsOption = Path("params.yaml"),
) -> None:
    """Regenerate a dataset's assistant turns through the verified providers (resumable)."""
    from stages import generate as stage

    stage.main(dataset, params)


def validate(
    dataset: Annotated[str, typer.Argument(help="A dataset named in params.yaml's datasets.")],
    params: ParamsOption = Path("params.yaml"),
) -> None:
    """Check a generated dataset and export it for SpecForge with its provenance card."""
    from stages import validate as stage

    stage.main(dataset, params)


def report(params: ParamsOption = Path("params.yaml")) -> None:
    """Build reports/index.html and the series behind `dvc plots`."""
    from stages import report as stage

    stage.main(params)


def register(app: typer.Typer) -> None:
    for command in (survey, calibrate, verify, generate, validate, report):
        app.command(rich_help_panel="Pipeline stages")(command)
