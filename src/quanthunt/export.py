"""The validate stage's work: read a generated dataset with what it must agree with (the
verdicts, the ledger, the monitors), check it (``validation.check``), and build the final
rows, the stage report and the provenance card that goes beside them.

Usage (``stages/validate.py``)::

    inputs = read_inputs(params, root, "chat")   # ConfigError naming the file
    checked = check_dataset(inputs, params)
    card = provenance_card(inputs, checked, params, prompts, final_text=..., validate_run_id=...)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from quanthunt import schemas
from quanthunt.errors import ConfigError, QuanthuntError
from quanthunt.jobs import dataset_params_hash
from quanthunt.ledger import Spend, open_ledger
from quanthunt.monitor import sampler_testable
from quanthunt.monitoring import UNLOGGED, monitor_card, suspect_checkpoints
from quanthunt.params import DatasetFiles, Params, section_digest
from quanthunt.templates import PromptCheck
from quanthunt.tracking import git_state, search_stage_runs
from quanthunt.validation import Checked, check
from quanthunt.verdicts import ProviderVerdict, Verdicts, load_verdicts

HEADLINE = ("records", "cost_usd", "truncated_share", "near_duplicate_share")
"""The metrics file's numbers (``dvc metrics show`` reads a row per dataset), besides its
status, the share of exported prompts that render to the billed token count, and
failures: headline scalars only, so the row fits a terminal. Tokens, counts
and per-provider and per-kind detail are in the provenance card and the MLflow run."""


class ValidationFailed(QuanthuntError):
    """The dataset failed a check; the report says which records and why."""


@dataclass(frozen=True)
class Inputs:
    """A generated dataset and everything it is checked against."""

    dataset: str
    files: DatasetFiles
    root: Path
    lines: list[str]
    verdicts: Verdicts
    eligible: dict[str, ProviderVerdict]
    """Verified-equivalent endpoints by tag."""
    params_hash: str
    recorded: dict[str, tuple[str, str]]
    """Record id -> (line sha256, line) as generation wrote them to the ledger."""
    costs: dict[str, float]
    spend: Spend
    """Every attempt of the dataset at these sampling params, by billing (the ledger's)."""
    monitors: dict[tuple[str, str], dict[str, Any]]
    replaced: list[tuple[str, str, int, str, float]] = field(default_factory=list)
    """Records generate set aside and made again (``Ledger.replaced``)."""


def read_inputs(params: Params, root: Path, dataset: str) -> Inputs:
    """Read and schema-check the generated file, the verdicts and the ledger's records."""
    paths, files = params.paths, params.paths.of(root, dataset)
    if not files.generated.exists():
        raise ConfigError(f"{files.generated}: generated dataset not found; run `quanthunt generate {dataset}` first")
    verdicts = load_verdicts(root / paths.verdicts)
    verdict_rows = [v.model_dump() for v in verdicts.providers]
    table = schemas.frame(verdict_rows, schemas.verdicts_table.columns)
    if failures := schemas.failures(schemas.verdicts_table, table, id_column="provider"):
        raise ConfigError(f"{root / paths.verdicts}: {failures[0].line()}")
    hashed = dataset_params_hash(params)
    ledger = open_ledger(params.ledger.url, root)
    try:
        recorded = ledger.done_records(dataset, hashed)
        costs = ledger.record_costs(dataset, hashed)
        spend = ledger.spend(dataset=dataset, params_hash=hashed)
        monitors = ledger.monitor_states(verdicts.verification_run_id or UNLOGGED)
        replaced = ledger.replaced(dataset, hashed)
    finally:
        ledger.close()
    export = schemas.frame(
        [{"record_id": r, "cost_usd": costs.get(r, 0.0), "line_sha256": sha} for r, (sha, _) in recorded.items()],
        ["record_id", "cost_usd", "line_sha256"],
    )
    if failures := schemas.failures(schemas.ledger_export, export, id_column="record_id"):
        raise ConfigError(f"{ledger.where}: {failures[0].line()}")
    return Inputs(
        dataset=dataset,
        files=files,
        root=root,
        lines=files.generated.read_text(encoding="utf-8").splitlines(),
        verdicts=verdicts,
        eligible={v.tag: v for v in verdicts.eligible()},
        params_hash=hashed,
        recorded=recorded,
        costs=costs,
        spend=spend,
        monitors=monitors,
        replaced=replaced,
    )


def check_dataset(inputs: Inputs, params: Params) -> Checked:
    """``validation.check`` with the ``validate`` params and what ``inputs`` hold."""
    v = params.validate_
    return check(
        inputs.lines,
        max_tokens=params.generate.sampling.max_tokens,
        eligible=[(e.tag, e.provider) for e in inputs.eligible.values()],
        params_sha256=inputs.params_hash,
        ledger_lines={r: sha for r, (sha, _) in inputs.recorded.items()},
        ledger_costs=inputs.costs,
        max_truncated_share=v.max_truncated_share,
        reasoning=params.reasoning.mode == "on",
        drop_unfinished=v.unfinished == "drop",
        suspect=suspect_checkpoints(inputs.monitors, inputs.dataset),
        first=v.max_failure_examples,
    )


def report(checked: Checked) -> dict[str, Any]:
    """The stage's metrics file: pass or fail, the headline figures, the failures."""
    return {
        "status": "passed" if checked.ok else "failed",
        **{k: checked.metrics[k] for k in HEADLINE},
        "failures": [f.__dict__ for f in checked.failures],
    }


def failed(inputs: Inputs, checked: Checked) -> ValidationFailed:
    first = checked.failures[0].line()
    return ValidationFailed(
        f"validation of {inputs.dataset} failed {len(checked.failures)} check(s); first: {first}; "
        f"see {inputs.files.validate_report} (the previous final file is untouched)"
    )


def final_text(checked: Checked) -> str:
    """The final file: one SpecForge row per line."""
    return "".join(orjson.dumps(row).decode() + "\n" for row in checked.records)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def provenance_card(
    inputs: Inputs, checked: Checked, params: Params, prompts: PromptCheck, *, final: str, validate_run_id: str
) -> dict[str, Any]:
    """What the final file is, where every record came from and what was removed or checked."""
    m = checked.metrics
    commit, dirty = git_state(inputs.root)
    generation_runs = [
        r["run_id"]
        for r in search_stage_runs(inputs.root, params.tracking.experiment, stage="generate", last=50)
        if r["tags"].get("dataset") == inputs.dataset
    ]
    return {
        "dataset": inputs.dataset,
        "records": m["records"],
        "records_generated": m["records_generated"],
        "turns": m["turns_exported"],
        "turns_generated": m["turns"],
        "tokens": {"prompt": m["prompt_tokens"], "completion": m["completion_tokens"]},
        "cost_usd": m["cost_usd"],
        "spend": {
            "settled_usd": round(inputs.spend.settled_usd, 8),
            "possibly_billed_usd": round(inputs.spend.unknown_usd, 8),
            "attempts": inputs.spend.attempts,
            "possibly_billed_attempts": inputs.spend.unknown_attempts,
            "why": (
                "every attempt at these sampling params, exported or not (cost_usd: the exported records' replies); "
                "possibly billed: sent, then timed out or cut off, and not yet confirmed through /generation "
                "(counted at their reservations, a worst-case bound); generate reconciles them when it learns their ids"
            ),
        },
        "model": params.survey.model,
        "reference_model": inputs.verdicts.reference_model,
        "providers": _providers(inputs, m["endpoints"]),
        "sampling": params.generate.sampling.model_dump(mode="json"),
        "calibration": inputs.verdicts.calibration.model_dump() if inputs.verdicts.calibration else None,
        "verified_sampling": verified_sampling(params, [v for t, v in inputs.eligible.items() if m["endpoints"].get(t)]),
        "params_sha256": {
            "generation": inputs.params_hash,
            "validate": section_digest(params.validate_),
            "verify": inputs.verdicts.params_sha256,
        },
        "git": {"commit": commit, "dirty": dirty},
        "digests": {
            "prompts_sha256": sha256_file(inputs.files.prompts),
            "generated_sha256": sha256_file(inputs.files.generated),
            "final_sha256": hashlib.sha256(final.encode()).hexdigest(),
        },
        "mlflow": {
            "validate_run_id": validate_run_id,
            "verification_run_id": inputs.verdicts.verification_run_id,
            "generation_run_ids": generation_runs[:5],
        },
        "removed": {
            "records_cut": m["records_cut"],
            "records_dropped": m["records_dropped"],
            "turns": m["turns_removed"],
            "turns_by_finish_reason": m["turns_removed_by_reason"],
            "cost_usd": m["cost_usd_removed"],
            "why": "a turn that did not finish is never exported as complete (trainers append the end-of-turn token)",
        },
        "prompts": prompts.card(),
        "replaced": replaced_card(inputs),
        "quarantined": {
            "records": m["records_quarantined"],
            "by_provider": m["quarantined_by_provider"],
            "why": "served by a provider after its monitor's estimated change (not exported)",
        },
        "checks": {
            "passed": True,
            **{k: m[k] for k in ("truncated_share", "near_duplicate_share", "finish_reasons", "mean_answer_chars")},
            "ledger_cost_usd": m["ledger_cost_usd"],
        },
    }


def replaced_card(inputs: Inputs) -> dict[str, Any]:
    """The records generate made again because a provider was found bad after it served
    them (``quanthunt.refill``): how many, whose turns, why, and where each line is kept."""
    by_provider: dict[str, int] = {}
    for _, line, from_turn, _, _ in inputs.replaced:
        turns = json.loads(line)["provenance"]["turns"]
        tag = str(turns[from_turn]["endpoint_tag"]) if from_turn < len(turns) else "(unknown)"
        by_provider[tag] = by_provider.get(tag, 0) + 1
    return {
        "records": len(inputs.replaced),
        "by_provider": by_provider,
        "reasons": sorted({why for _, _, _, why, _ in inputs.replaced}),
        "kept_in": ["the ledger's replaced_records", str(inputs.files.set_aside(inputs.params_hash))],
        "why": "made again from the providers still eligible from their first bad turn on; each line as it was is kept, "
        "and what it cost counts in the record made again",
    }


def verified_sampling(params: Params, eligible: Iterable[ProviderVerdict]) -> dict[str, Any]:
    """What the audit and the monitor verified of the sampling the dataset was generated
    with, said plainly.

    The audit samples the raw distribution (temperature 1, top-p 1). Generation at another
    temperature in (0, 1] with top-p 1 is checked by the generate stage's monitor, whose
    rank tests read each monitored reply under the tempered distribution
    (``monitor.sampler_testable``), in both modes. A nucleus cut or a temperature above 1
    (or the monitor off) leaves only what does not depend on them: the weights' precision
    (logprob mode, and the monitor keeps comparing the providers' logprobs); that each
    provider applies the temperature and top-p as the reference does is then not measured,
    and a sample-mode provider is not monitored at all. It also names the providers whose
    logprobs the audit read as after temperature (``ProviderVerdict.logprobs_reading``), and
    any read at another temperature than generation's."""
    probes, sampling = params.verify.probes, params.generate.sampling
    audit = {"temperature": probes.temperature, "top_p": 1.0, "max_tokens": probes.max_tokens}
    generation = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    differs = [k for k in ("temperature", "top_p") if audit[k] != generation[k]]
    monitored = sampler_testable(sampling) and params.generate.monitor.share > 0
    unmonitored = sorted(v.tag for v in eligible if v.mode == "sample") if differs and not monitored else []
    said = (
        f"the audit verified each provider at temperature {probes.temperature:g}, top-p 1 (the raw distribution); "
        f"generation samples at temperature {sampling.temperature:g}, top-p {sampling.top_p:g}. "
    )
    if not differs:
        note = "generation samples the distribution the audit verified (temperature 1, top-p 1)"
    elif monitored:
        note = said + (
            f"The monitor tests each monitored reply's sampler at temperature {sampling.temperature:g} (its rank under "
            "the reference's tempered distribution) and, in logprob mode, its logprobs"
        )
    else:
        note = said + (
            "Verified: the weights' precision (and, in logprob mode, the monitor compares every monitored reply's "
            "logprobs). Not verified: that each provider applies this temperature and top-p as the reference does"
            + (f"; not monitored (sample mode): {', '.join(unmonitored)}" if unmonitored else "")
        )
    readings = {v.tag: v.logprobs_reading for v in eligible if v.logprobs_reading is not None}
    read_as = {tag: r.read_as for tag, r in sorted(readings.items())}
    processed = [tag for tag, how in read_as.items() if how in ("processed", "mixed")]
    if processed:
        note += (f". Logprobs reported after temperature (read so, against the reference's tempered logprobs): "
                 f"{', '.join(processed)}")  # fmt: skip
    elsewhere = sorted(tag for tag, r in readings.items() if r.temperature != sampling.temperature)
    if elsewhere:
        note += (f". The audit read these providers' logprob convention at another temperature than generation's "
                 f"{sampling.temperature:g}: {', '.join(elsewhere)} (the monitor reads each reply's own)")  # fmt: skip
    return {"audit": audit, "generation": generation, "differs": differs, "not_monitored": unmonitored,
            "logprobs_read_as": read_as, "note": note}  # fmt: skip


def _providers(inputs: Inputs, served: Mapping[str, int]) -> list[dict[str, Any]]:
    """Each endpoint that served a record, with its declaration, verdict and monitor."""
    return [
        {
            "provider": v.provider,
            "tag": tag,
            "declared_quantization": v.declared_quantization,
            "verdict": v.verdict,
            "verification_mode": v.mode,
            "measured": {k: e.value for k, e in v.effects.items()},
            "verdict_run_id": v.mlflow_run_id,
            "records_served": served[tag],
            "monitor": monitor_card(inputs.monitors.get((inputs.dataset, tag))),
        }
        for tag, v in inputs.eligible.items()
        if served.get(tag)
    ]
