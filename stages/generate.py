"""Generate stage: regenerate one dataset's assistant turns through the eligible
providers, resumably, under the run's dollar cap.

``quanthunt generate DATASET``; DVC runs it once per dataset (a ``foreach`` stage).
Exit codes: 0 done (or the dataset's token budget reached), 75 out of money (top up and
rerun), 2 bad input or a gateway that cannot be reached or cannot serve the request, 130
stopped by Ctrl-C or SIGTERM (rerun to resume).

Records are made in a working file per sampling params (``paths.generating``); the DVC
output (``paths.generated``) is replaced by it only when a run finishes, so a failed or
interrupted run leaves the last good output and metrics as they were.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rich.console import Console

from quanthunt.connection import open_targets
from quanthunt.errors import ConfigError
from quanthunt.generate_run import detail, done_line, eligible_providers, log_run, run, run_failure, summary
from quanthunt.locking import exclusive
from quanthunt.outputs import write_atomic
from quanthunt.prompts import count_prompts
from quanthunt.records import publish
from quanthunt.stage import Stage


def main(dataset: str, params_path: Path, *, console: Console | None = None) -> None:
    """Run the generate stage for ``dataset`` with the params file at ``params_path``."""
    stage = Stage.open("generate", params_path, console, dataset=dataset)
    params, root, console = stage.params, stage.root, stage.console
    files = stage.paths.of(root, dataset)
    if not files.prompts.exists():
        raise ConfigError(f"{files.prompts}: prompt dataset not found")
    with exclusive(files.lock, what=f"quanthunt generate {dataset}"):
        # Inputs first, before a sandbox starts or a request is sent.
        eligible_providers(params, root)
        total = count_prompts(files.prompts, limit=params.generate.max_records)  # every record checked
        with stage.tracked(params.generate) as mlflow_run:
            mlflow_run.log_input(files.prompts, context="prompts")
            mlflow_run.log_input(root / stage.paths.verdicts, context="verdicts")
            with open_targets(params, root=root, stage=f"generate-{dataset}", needs_model=True) as targets:
                job, engine, signals, counts = asyncio.run(run(params, root, dataset, targets, console, total=total))
            headline = summary(job, engine)
            details = detail(engine, headline, counts)
            log_run(mlflow_run, job, engine, details)
            console.print(done_line(job, engine))
            failure = run_failure(job, engine, signals, resume=f"quanthunt generate {dataset} --params {params_path}")
            if failure is not None:
                raise failure
            working = files.working(job.params_hash)
            if working.exists():
                publish(working, files.generated)
                mlflow_run.log_output(files.generated)
            write_atomic(files.generate_detail, (json.dumps(details, indent=2) + "\n").encode())
            write_atomic(files.generate_report, (json.dumps(headline, indent=2) + "\n").encode())
