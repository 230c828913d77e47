"""Validate stage: check a generated dataset and export it for SpecForge with its
provenance card. A failed check fails the stage (exit 2, the report names record and
check) and leaves the previous final file untouched. The exported turns' prompts are
rendered at the reference deployment (a sandbox in sandbox mode) to state in the card
how many match what the providers billed, and which template reproduces them.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from rich.console import Console

from quanthunt import schemas
from quanthunt.connection import open_targets
from quanthunt.errors import ConfigError, QuanthuntError
from quanthunt.generation import params_hash
from quanthunt.ledger import Ledger
from quanthunt.monitoring import UNLOGGED, monitor_card, suspect_checkpoints
from quanthunt.outputs import Outputs, write_atomic
from quanthunt.params import section_digest
from quanthunt.stage import Stage
from quanthunt.templates import check_prompts
from quanthunt.tracking import git_state, search_stage_runs
from quanthunt.validation import check
from quanthunt.verdicts import load_verdicts

HEADLINE = ("records", "cost_usd", "truncated_share", "near_duplicate_share")
"""The metrics file's numbers (``dvc metrics show`` reads a row per dataset), besides its
status, the share of exported prompts that render to the billed token count, and
failures: headline scalars only, so the row fits a terminal. Tokens, counts
and per-provider and per-kind detail are in the provenance card and the MLflow run."""


class ValidationFailed(QuanthuntError):
    """The dataset failed a check; the report says which records and why."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dumps(data: Any) -> str:
    import orjson

    return orjson.dumps(data).decode()


def main(dataset: str, params_path: Path, *, console: Console | None = None) -> None:
    """Run the validate stage for ``dataset`` with the params file at ``params_path``."""
    stage = Stage.open("validate", params_path, console, dataset=dataset)
    params, root, paths, console = stage.params, stage.root, stage.paths, stage.console
    files = paths.of(root, dataset)
    generated = files.generated
    if not generated.exists():
        raise ConfigError(f"{generated}: generated dataset not found; run `quanthunt generate {dataset}` first")
    verdicts = load_verdicts(root / paths.verdicts)
    verdict_rows = [v.model_dump() for v in verdicts.providers]
    table_failures = schemas.failures(
        schemas.verdicts_table, schemas.frame(verdict_rows, schemas.verdicts_table.columns), id_column="provider"
    )
    if table_failures:
        raise ConfigError(f"{root / paths.verdicts}: {table_failures[0].line()}")
    eligible = {v.tag: v for v in verdicts.eligible()}
    sampling = params.generate.sampling
    hashed = params_hash(params.survey.model, sampling.model_dump(mode="json"), params.reasoning.mode)
    ledger = Ledger(root / paths.ledger)
    try:
        recorded = ledger.done_records(dataset, hashed)
        costs = ledger.record_costs(dataset, hashed)
        monitors = ledger.monitor_states(verdicts.verification_run_id or UNLOGGED)
    finally:
        ledger.close()
    export = schemas.frame(
        [{"record_id": r, "cost_usd": costs.get(r, 0.0), "line_sha256": sha} for r, (sha, _) in recorded.items()],
        ["record_id", "cost_usd", "line_sha256"],
    )
    ledger_failures = schemas.failures(schemas.ledger_export, export, id_column="record_id")
    if ledger_failures:
        raise ConfigError(f"{root / paths.ledger}: {ledger_failures[0].line()}")
    lines = generated.read_text(encoding="utf-8").splitlines()
    report_path = files.validate_report
    with stage.tracked(params.validate_) as run:
        checked = check(
            lines,
            max_tokens=sampling.max_tokens,
            eligible=[(v.tag, v.provider) for v in eligible.values()],
            params_sha256=hashed,
            ledger_lines={r: sha for r, (sha, _) in recorded.items()},
            ledger_costs=costs,
            max_truncated_share=params.validate_.max_truncated_share,
            reasoning=params.reasoning.mode == "on",
            drop_unfinished=params.validate_.unfinished == "drop",
            suspect=suspect_checkpoints(monitors, dataset),
            first=params.validate_.max_failure_examples,
        )
        report: dict[str, Any] = {
            "status": "passed" if checked.ok else "failed",
            **{k: checked.metrics[k] for k in HEADLINE},
            "failures": [f.__dict__ for f in checked.failures],
        }
        run.set_tags(
            {
                "dataset": dataset,
                "status": report["status"],
                "providers": ",".join(sorted(checked.metrics["endpoints"])),
                "cost_usd": f"{checked.metrics['cost_usd']:.8f}",
            }
        )
        run.log_metrics({k: v for k, v in checked.metrics.items() if isinstance(v, int | float)})
        run.log_input(generated, context="generated")
        if not checked.ok:
            write_atomic(report_path, (dumps(report) + "\n").encode())
            run.log_artifact(report_path)
            for failure in checked.failures:
                console.print(f"[red]{dataset}: {failure.line()}[/]")
            raise ValidationFailed(
                f"validation of {dataset} failed {len(checked.failures)} check(s); first: {checked.failures[0].line()}; "
                f"see {report_path} (the previous final file is untouched)"
            )
        final_path, card_path = files.final, files.card
        final_text = "".join(dumps(row) + "\n" for row in checked.records)
        with open_targets(params, root=root, stage=f"validate-{dataset}", needs_model=True) as targets:
            prompts = asyncio.run(check_prompts(targets.reference_url, params.reference.model, checked.records,
                                                params.reasoning.reference_kwargs()))  # fmt: skip
        run.log_metrics({"prompt_match_share": prompts.fidelity.share})
        report = {**report, "prompt_match": round(prompts.fidelity.share, 4)}
        if prompts.fidelity.share < 1:
            console.print(f"[yellow]{dataset}: {prompts.fidelity.matched} of {prompts.fidelity.turns} prompts render to "
                          f"the token count the provider billed; see the card's prompts section[/]")  # fmt: skip
        commit, dirty = git_state(root)
        generation_runs = [
            r["run_id"]
            for r in search_stage_runs(root, params.tracking.experiment, stage="generate", last=50)
            if r["tags"].get("dataset") == dataset
        ]
        card = {
            "dataset": dataset,
            "records": checked.metrics["records"],
            "records_generated": checked.metrics["records_generated"],
            "turns": checked.metrics["turns_exported"],
            "turns_generated": checked.metrics["turns"],
            "tokens": {"prompt": checked.metrics["prompt_tokens"], "completion": checked.metrics["completion_tokens"]},
            "cost_usd": checked.metrics["cost_usd"],
            "model": params.survey.model,
            "reference_model": verdicts.reference_model,
            "providers": [
                {
                    "provider": v.provider,
                    "tag": tag,
                    "declared_quantization": v.declared_quantization,
                    "verdict": v.verdict,
                    "verification_mode": v.mode,
                    "measured": {k: e.value for k, e in v.effects.items()},
                    "verdict_run_id": v.mlflow_run_id,
                    "records_served": checked.metrics["endpoints"][tag],
                    "monitor": monitor_card(monitors.get((dataset, tag))),
                }
                for tag, v in eligible.items()
                if checked.metrics["endpoints"].get(tag)
            ],
            "sampling": sampling.model_dump(mode="json"),
            "params_sha256": {
                "generation": hashed,
                "validate": section_digest(params.validate_),
                "verify": verdicts.params_sha256,
            },
            "git": {"commit": commit, "dirty": dirty},
            "digests": {
                "prompts_sha256": sha256_file(files.prompts),
                "generated_sha256": sha256_file(generated),
                "final_sha256": hashlib.sha256(final_text.encode()).hexdigest(),
            },
            "mlflow": {
                "validate_run_id": run.run_id,
                "verification_run_id": verdicts.verification_run_id,
                "generation_run_ids": generation_runs[:5],
            },
            "removed": {
                "records_cut": checked.metrics["records_cut"],
                "records_dropped": checked.metrics["records_dropped"],
                "turns": checked.metrics["turns_removed"],
                "turns_by_finish_reason": checked.metrics["turns_removed_by_reason"],
                "cost_usd": checked.metrics["cost_usd_removed"],
                "why": "a turn that did not finish is never exported as complete (trainers append the end-of-turn token)",
            },
            "prompts": prompts.card(),
            "quarantined": {
                "records": checked.metrics["records_quarantined"],
                "by_provider": checked.metrics["quarantined_by_provider"],
                "why": "served by a provider after its monitor's estimated change (not exported)",
            },
            "checks": {
                "passed": True,
                "truncated_share": checked.metrics["truncated_share"],
                "near_duplicate_share": checked.metrics["near_duplicate_share"],
                "finish_reasons": checked.metrics["finish_reasons"],
                "mean_answer_chars": checked.metrics["mean_answer_chars"],
                "ledger_cost_usd": checked.metrics["ledger_cost_usd"],
            },
        }
        with Outputs() as out:
            out.write_text(final_path, final_text)
            out.write_json(card_path, card)
            out.write_json(report_path, report)
        run.log_output(final_path)
        run.log_artifact(card_path)
        run.log_artifact(report_path)
        console.print(f"{dataset}: {checked.metrics['records']} records passed validation -> {final_path}")
