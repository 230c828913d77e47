"""Calibrate stage: measure the control deployments the team trusts as verify measures a
provider, and bound what a faithful deployment of their model does.

Writes ``paths.calibration``: the margins and mixture detection rates verify uses (its
verdicts carry them to generate and report), every confidence bound behind them, and the key
(model, reference and its server version, reasoning, probe and calibrate settings) they hold
for. With no control and no coarse build it writes the shipped values, saying where they were
measured. One MLflow run.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from rich.console import Console

from quanthunt.calibration_run import measure_all, metric_name, plan_lines, shipped, show_calibration
from quanthunt.connection import open_targets
from quanthunt.outputs import Outputs
from quanthunt.probes import select_probes
from quanthunt.prompts import load_prompts
from quanthunt.sandbox.server import deployment_url
from quanthunt.stage import Stage


def main(params_path: Path, *, console: Console | None = None) -> None:
    """Run the calibrate stage with the params file at ``params_path``."""
    stage = Stage.open("calibrate", params_path, console)
    params, root, paths, console = stage.params, stage.root, stage.paths, stage.console
    c = params.calibrate
    with stage.tracked(c) as run:
        if c.controls or c.coarse is not None:
            for line in plan_lines(params):
                console.print(line)
            datasets = {name: load_prompts(paths.prompt_file(root, name)) for name in params.datasets}
            probes = select_probes(datasets, count=c.prompts, seed=params.verify.seed)
            with open_targets(params, root=root, stage="calibrate", needs_model=True) as targets:
                base = targets.sandbox_url
                result = asyncio.run(
                    measure_all(params, probes, reference_url=targets.reference_url,
                                sandbox_url=functools.partial(deployment_url, base) if base else None,
                                on_progress=console.print)
                )  # fmt: skip
            for name in params.datasets:
                run.log_input(paths.prompt_file(root, name), context="prompts")
        else:
            result = shipped(params)
        result = result.model_copy(update={"run_id": run.run_id})
        with Outputs() as out:
            out.write_json(root / paths.calibration, result.model_dump(mode="json"))
        show_calibration(result, console)
        run.log_metrics({metric_name(b): b.used for b in result.bounds})
        run.set_tags({"calibration_measured": str(result.measured).lower(), "controls": ",".join(c.controls),
                      "calibration_note": result.note[:4000]})  # fmt: skip
        run.log_artifact(root / paths.calibration)
