"""Verify stage: measure every candidate provider against the reference, decide.

Reads the survey's ``providers.csv`` and the prompt datasets; writes ``verdicts.json``
(validated), one plot per provider, a short HTML report and ``metrics.json``; one MLflow
run with a nested run per provider.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from rich.console import Console

from quanthunt.audit_run import audit_all, decide, metrics, plan, plots, render_report, show, tags
from quanthunt.calibration_run import applied
from quanthunt.connection import open_targets
from quanthunt.ledger import open_ledger
from quanthunt.outputs import Outputs
from quanthunt.stage import Stage


def main(params_path: Path, *, console: Console | None = None) -> None:
    """Run the verify stage with the params file at ``params_path``."""
    stage = Stage.open("verify", params_path, console)
    params, calibration = applied(stage.params, stage.root)
    stage = stage.with_params(params)
    params, root, paths, console = stage.params, stage.root, stage.paths, stage.console
    surveyed, rows, probes = plan(params, root)
    with stage.tracked(params.verify) as run:
        with (
            open_targets(params, root=root, stage="verify", needs_model=True) as targets,
            contextlib.closing(open_ledger(params.ledger.url, root)) as ledger,
        ):
            siblings = [r.tag for r in surveyed]
            audits, rounds, reference_model = asyncio.run(
                audit_all(params, rows, probes, targets, siblings=siblings, console=console, ledger=ledger,
                          run_id=run.run_id, calibration=calibration)
            )  # fmt: skip
        verdicts = decide(params, run, rows=rows, probes=probes, audits=audits, rounds=rounds,
                          reference_model=reference_model, calibration=calibration)  # fmt: skip
        images = plots(params, audits, verdicts)
        figures = metrics(verdicts)
        with Outputs() as out:
            out.write_text(root / paths.verdicts, verdicts.model_dump_json(indent=2) + "\n")
            out.write_dir(root / paths.verify_plots, {paths.plot(root, tag).name: png for tag, png in images.items()})
            out.write_text(root / paths.verify_report, render_report(verdicts, images))
            out.write_json(root / paths.verify_metrics, figures)
        show(verdicts, console)
        run.log_metrics(figures)
        run.set_tags(tags(verdicts, params.verify.margin))
        run.log_input(root / paths.survey_providers, context="survey")
        if (root / paths.calibration).exists():
            run.log_input(root / paths.calibration, context="calibration")
        for name in params.datasets:
            run.log_input(paths.prompt_file(root, name), context="prompts")
        for path in (paths.verdicts, paths.verify_report, paths.verify_metrics):
            run.log_artifact(root / path)
