"""Validate stage: check a generated dataset and export it for SpecForge with its
provenance card. A failed check fails the stage (exit 2, the report names record and
check) and leaves the previous final file untouched. The exported turns' prompts are
rendered at the reference deployment (a sandbox in sandbox mode) to state in the card
how many match what the providers billed, and which template reproduces them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from rich.console import Console

from quanthunt import export
from quanthunt.connection import open_targets
from quanthunt.outputs import Outputs, write_atomic
from quanthunt.stage import Stage
from quanthunt.templates import check_prompts


def main(dataset: str, params_path: Path, *, console: Console | None = None) -> None:
    """Run the validate stage for ``dataset`` with the params file at ``params_path``."""
    stage = Stage.open("validate", params_path, console, dataset=dataset)
    params, console = stage.params, stage.console
    inputs = export.read_inputs(params, stage.root, dataset)
    files = inputs.files
    with stage.tracked(params.validate_) as run:
        checked = export.check_dataset(inputs, params)
        report = export.report(checked)
        run.set_tags({"dataset": dataset, "status": report["status"], "cost_usd": f"{checked.metrics['cost_usd']:.8f}",
                      "providers": ",".join(sorted(checked.metrics["endpoints"]))})  # fmt: skip
        run.log_metrics({k: v for k, v in checked.metrics.items() if isinstance(v, int | float)})
        run.log_input(files.generated, context="generated")
        if not checked.ok:
            write_atomic(files.validate_report, orjson.dumps(report) + b"\n")
            run.log_artifact(files.validate_report)
            for failure in checked.failures:
                console.print(f"[red]{dataset}: {failure.line()}[/]")
            raise export.failed(inputs, checked)
        final = export.final_text(checked)
        with open_targets(params, root=stage.root, stage=f"validate-{dataset}", needs_model=True) as targets:
            prompts = asyncio.run(check_prompts(targets.reference_url, params.reference.model, checked.records,
                                                params.reasoning.reference_kwargs()))  # fmt: skip
        run.log_metrics({"prompt_match_share": prompts.fidelity.share})
        report["prompt_match"] = round(prompts.fidelity.share, 4)
        if prompts.fidelity.share < 1:
            console.print(f"[yellow]{dataset}: {prompts.fidelity.matched} of {prompts.fidelity.turns} prompts render to "
                          f"the token count the provider billed; see the card's prompts section[/]")  # fmt: skip
        card = export.provenance_card(inputs, checked, params, prompts, final=final, validate_run_id=run.run_id)
        with Outputs() as out:
            out.write_text(files.final, final)
            out.write_json(files.card, card)
            out.write_json(files.validate_report, report)
        run.log_output(files.final)
        run.log_artifact(files.card)
        run.log_artifact(files.validate_report)
        console.print(f"{dataset}: {checked.metrics['records']} records passed validation -> {files.final}")
        if (verified := card["verified_sampling"])["differs"]:
            console.print(f"[yellow]{dataset}: {verified['note']} (the card's verified_sampling)[/]", soft_wrap=True)
