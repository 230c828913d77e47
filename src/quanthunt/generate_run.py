"""One generate run of one dataset, from params and files to a finished or resumable run:
which endpoints may serve (``eligible_providers``), resume and repair of the working file,
the engine with its monitors, progress on the terminal, and what the run reports
(``summary``, ``detail``, ``log_run``, ``run_failure``). ``stages/generate.py`` holds the
lock, opens the targets and writes the outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from quanthunt.aiohttp_chat import AiohttpChat
from quanthunt.connection import Targets
from quanthunt.coordinator import coordinate
from quanthunt.errors import EXIT_INTERRUPTED, EXIT_OUT_OF_BUDGET, ConfigError
from quanthunt.gateway import Gateway, Routing, check_gateway, resolve_api_key
from quanthunt.generation import Budget, Engine, StopRun
from quanthunt.interrupts import StopSignals
from quanthunt.jobs import Eligible, Job, Progress, dataset_params_hash
from quanthunt.ledger import LedgerWriter, open_ledger
from quanthunt.ledger_postgres import PostgresLedger
from quanthunt.measurements import RANK_TOP_K
from quanthunt.monitor import rank_temperature
from quanthunt.monitoring import (
    LOGPROB_TOP,
    UNLOGGED,
    Monitoring,
    check_reference,
    monitor_margin,
    monitors_for,
    stopped_providers,
    suspect_checkpoints,
)
from quanthunt.params import Params
from quanthunt.probes import convention_temperature
from quanthunt.prompts import PromptRecord, iter_prompts
from quanthunt.reconciliation import reconcile_earlier
from quanthunt.records import RecordSink, adopt_published, prepare_output
from quanthunt.reference import Reference
from quanthunt.refill import bad_endpoints, describe, set_aside, to_replace
from quanthunt.survey import read_providers
from quanthunt.tracking import StageRun
from quanthunt.verdicts import Verdicts, load_verdicts
from quanthunt.verification import Scorer


def eligible_providers(params: Params, root: Path) -> tuple[tuple[Eligible, ...], Verdicts]:
    verdicts = load_verdicts(root / params.paths.verdicts)
    if verdicts.model != params.survey.model:
        raise ConfigError(
            f"{root / params.paths.verdicts}: verdicts are for {verdicts.model}, not {params.survey.model}; rerun verify"
        )
    survey = {r.tag: r for r in read_providers(root / params.paths.survey_providers)}
    chosen = []
    for v in verdicts.eligible():
        if v.verdict != "equivalent":
            raise ConfigError(f"{root / params.paths.verdicts}: {v.tag} is eligible but verdict {v.verdict}; rerun verify")
        row = survey.get(v.tag)
        if row is None:
            raise ConfigError(f"{root / params.paths.survey_providers}: {v.tag} is verified but missing; rerun the survey")
        chosen.append(
            Eligible(
                judged=v,
                prompt_usd_per_token=row.prompt_usd_per_m / 1e6,
                completion_usd_per_token=row.completion_usd_per_m / 1e6,
                context_length=row.context_length,
                siblings=tuple(t for t in survey if t != v.tag),
            )
        )
    if not chosen:
        raise ConfigError(
            f"{root / params.paths.verdicts}: no provider was verified equivalent; nothing can generate training data"
        )
    return tuple(chosen), verdicts


def limited(path: Path, max_records: int | None, skip: frozenset[str]) -> Iterator[PromptRecord]:
    """Stream the dataset's first ``max_records`` records that are not finished yet (the
    file was checked whole by ``count_prompts`` before the run, so ids are not held)."""
    for index, record in enumerate(iter_prompts(path, unique_ids=False)):
        if max_records is not None and index >= max_records:
            return
        if record.id not in skip:
            yield record


def status_table(job: Job, p: Progress, budget: Budget) -> Table:
    elapsed = max(time.monotonic() - p.started, 1e-9)
    done = p.records_done_before + p.records_done
    table = Table.grid(padding=(0, 2))
    table.add_row(
        f"[b]{job.dataset}[/b]",
        f"records {done}/{p.records_total}",
        f"failed {p.records_failed}",
        f"skipped {p.records_skipped}",
        f"in flight {p.in_flight}",
    )
    token_cap = f"/{job.max_output_tokens:,}" if job.max_output_tokens else ""
    rate = p.requests_ok / elapsed
    left = p.records_total - done - p.records_failed - p.records_skipped
    eta = f"{left / (p.records_done / elapsed):.0f} s" if p.records_done else "?"
    table.add_row(
        f"tokens {p.output_tokens_before + p.output_tokens:,}{token_cap}",
        f"{money(budget)} of ${job.max_usd:g}",
        f"{rate:.1f} req/s",
        f"ETA {eta}",
    )
    retries = ", ".join(f"{k} {n}" for k, n in p.retries.most_common(4)) or "none"
    errors = ", ".join(f"{k} {n}" for k, n in p.errors.most_common(4)) or "none"
    table.add_row(f"retries: {retries}", f"errors: {errors}")
    return table


async def run(
    params: Params, root: Path, dataset: str, targets: Targets, console: Console, *, total: int
) -> tuple[Job, Engine, StopSignals, dict[str, int]]:
    paths, g = params.paths, params.generate
    ledger = open_ledger(params.ledger.url, root)
    providers, verdicts = eligible_providers(params, root)
    stopped = stopped_providers(ledger, verdicts)
    for tag, where in stopped.items():
        console.print(f"[yellow]monitor: not routing to {tag}: its monitor stopped it (dataset {where}); rerun verify[/]")
    providers = tuple(p for p in providers if p.tag not in stopped)
    if not providers:
        raise StopRun(
            f"every eligible provider was stopped by its monitor ({', '.join(sorted(stopped))}); rerun verify, then generate",
            EXIT_OUT_OF_BUDGET,
        )
    margin = monitor_margin(verdicts, g.sampling, params.verify.margin)  # verify's, its sampler's at generation's settings
    monitors = monitors_for(verdicts, ledger, dataset=dataset, datasets=len(params.datasets), margin=margin,
                            settings=g.monitor, sampling=g.sampling)  # fmt: skip
    params_hash = dataset_params_hash(params)
    job = Job(
        dataset=dataset,
        model=params.survey.model,
        providers=providers,
        routing=Routing(data_collection=g.data_collection, quantizations=g.quantizations),
        params_hash=params_hash,
        run_id=uuid.uuid4().hex,
        settings=g,
        concurrency=g.concurrency,
        verification_run_id=verdicts.verification_run_id,
        reasoning=params.reasoning.request(),
    )
    files = paths.of(root, dataset)
    prompts = files.prompts
    bad = bad_endpoints(verdicts)
    suspect = suspect_checkpoints(ledger.monitor_states(verdicts.verification_run_id or UNLOGGED), dataset)
    if isinstance(ledger, PostgresLedger):
        written = [line for _, line in ledger.done_records(dataset, params_hash).values()]
        if replacements := to_replace(written, bad=bad, suspect=suspect):
            ledger.close()
            raise ConfigError(
                f"{dataset}: {describe(replacements)} were served by providers found bad since "
                f"({replacements[0].why}); making them again is built for a local ledger only so far (until then "
                "validate refuses or quarantines them)"
            )
        try:
            return await coordinate(params, root, job, limited(prompts, g.max_records, frozenset()), targets=targets,
                                    console=console, ledger=ledger, total=total)  # fmt: skip
        finally:
            ledger.close()
    output = files.working(params_hash)
    adopt_published(files.generated, output, params_hash)
    recovered = ledger.recover(dataset)
    repair = prepare_output(output, ledger, dataset, params_hash)
    if repair.truncated_bytes or repair.adopted or repair.restored or recovered:
        console.print(
            f"resumed {dataset}: {len(repair.done_ids)} records already done; {recovered} requests were in flight "
            f"(counted as possibly billed); cut {repair.truncated_bytes} bytes of a half-written line; adopted "
            f"{repair.adopted} and restored {repair.restored} records"
        )
    written = output.read_text(encoding="utf-8").splitlines() if output.exists() else []
    replacements = to_replace(written, bad=bad, suspect=suspect)
    set_aside(ledger, output, files.set_aside(params_hash), dataset=dataset, params_hash=params_hash,
              replacements=replacements)  # fmt: skip
    if replacements:
        console.print(
            f"[yellow]refill: {describe(replacements)} made again from the providers still eligible "
            f"({replacements[0].why}); each line as it was is kept in {files.set_aside(params_hash)} and the ledger[/]",
            soft_wrap=True,
        )
    done_ids = repair.done_ids - {r.record_id for r in replacements}
    if repair.edited:
        example = repair.edited[0]
        console.print(
            f"[yellow]warning: {len(repair.edited)} records in {output} differ from the ledger (e.g. {example}); "
            "validation will name them[/]"
        )
    writer = LedgerWriter(ledger)
    writer.start()
    sink = RecordSink(output, writer, dataset, params_hash)
    sink.start()
    api_key = resolve_api_key(targets.api_url)
    try:
        async with (
            AiohttpChat(targets.api_url, api_key=api_key, timeout_s=g.request_timeout_s) as chat,
            Gateway(targets.api_url, api_key=api_key) as gateway,
            Reference(targets.reference_url, model=params.reference.model) as reference,
        ):
            await check_gateway(gateway, targets.api_url)
            monitoring = None
            if g.monitor.share > 0 and any(m.monitored for m in monitors.values()):
                await check_reference(reference, verdicts, targets.reference_url)
                horizon = verdicts.decision_or(params.verify.decision).mixture_detection_tokens
                # Ranked by the reference's top 20 in both modes: a +0.3 temperature drift at T 0.7 in
                # logprob mode was stopped after a median 38 monitored replies so (105 by the top 5).
                # Each reply's logprobs are read raw or after temperature, as their gaps say.
                scorer = Scorer(reference, params.reasoning, top_logprobs=LOGPROB_TOP, attempts=params.verify.max_attempts,
                                horizon=horizon, temperature=rank_temperature(g.sampling), rank_top=RANK_TOP_K,
                                processed_at=convention_temperature(g.sampling.temperature, g.sampling.top_p))  # fmt: skip
                await scorer.check()
                monitoring = Monitoring(
                    monitors, scorer, writer, verification_run_id=verdicts.verification_run_id or UNLOGGED,
                    dataset=dataset, settings=g.monitor, say=lambda line: console.print(f"[red]{line}[/]"),
                )  # fmt: skip
            for tag in sorted(t for t, m in monitors.items() if not m.monitored):
                console.print(f"[yellow]monitor: {tag} is not monitored (sample mode; its rank test needs top-p 1 and "
                              "a temperature in (0, 1])[/]")  # fmt: skip
            await reconcile_earlier(ledger, dataset, gateway.generation)
            engine = Engine(job, chat, ledger, writer, sink, done_turns=ledger.done_turns(dataset, params_hash),
                            monitoring=monitoring)  # fmt: skip
            engine.progress.records_total = total
            engine.progress.records_done_before = len(done_ids)
            engine.progress.output_tokens_before = ledger.output_tokens(dataset, params_hash)
            records = limited(prompts, g.max_records, done_ids)
            display = asyncio.ensure_future(show_progress(engine, job, console, g.progress_interval_s))
            work = asyncio.ensure_future(engine.run(records))
            try:
                with StopSignals(work, grace_s=g.stop_grace_s, on_first=engine.stop) as signals:
                    with contextlib.suppress(asyncio.CancelledError):
                        await work
                    if signals.received:
                        ended = "were cut off" if signals.cut_short else "finished"
                        console.print(f"[yellow]{signals.reason}: sent nothing more; the requests in flight {ended}[/]")
                    if work.cancelled() and not signals.cut_short:
                        raise asyncio.CancelledError
                    if monitoring is not None and not signals.cut_short:
                        await monitoring.close()
            finally:
                display.cancel()
            if not signals.cut_short:
                await engine.reconcile(gateway.generation)
    finally:
        await sink.close()
        await writer.close()
    counts = ledger.state_counts(dataset)
    ledger.close()
    return job, engine, signals, counts


async def show_progress(engine: Engine, job: Job, console: Console, interval_s: float) -> None:
    if console.is_terminal:
        with Live(status_table(job, engine.progress, engine.budget), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(0.25)
                live.update(status_table(job, engine.progress, engine.budget))
    while True:
        await asyncio.sleep(interval_s)
        p = engine.progress
        console.print(
            f"{job.dataset}: {p.records_done_before + p.records_done}/{p.records_total} records, "
            f"{p.in_flight} in flight, {p.output_tokens} tokens, {money(engine.budget)}, "
            f"retries {sum(p.retries.values())}, errors {sum(p.errors.values())}"
        )


def summary(job: Job, engine: Engine) -> dict[str, object]:
    """The run's headline figures: the DVC metrics (narrow: the detail file has the rest)."""
    progress = engine.progress
    return {
        "records_total": progress.records_total,
        "records_done": progress.records_done_before + progress.records_done,
        "records_new": progress.records_done,
        "records_failed": progress.records_failed,
        "records_skipped": progress.records_skipped,
        "output_tokens_new": progress.output_tokens,
        "spent_usd_run": round(engine.budget.settled_usd, 8),
        "possibly_billed_usd_run": round(engine.budget.unknown_usd, 8),
        "requests_ok": progress.requests_ok,
        "retries_total": sum(progress.retries.values()),
        "errors_total": sum(progress.errors.values()),
        "quarantined": progress.quarantined,
        "monitor_stops_total": len(progress.monitor_stops),
        "stop_reason": progress.stop_reason,
        "params_sha256": job.params_hash,
    }


def detail(engine: Engine, headline: dict[str, object], counts: dict[str, int]) -> dict[str, object]:
    """The detail file: the headline plus every breakdown (retries, errors, providers, monitor)."""
    progress = engine.progress
    return {
        **headline,
        "skipped_reasons": dict(progress.skipped_reasons),
        "retries": dict(progress.retries),
        "errors": dict(progress.errors),
        "retired_endpoints": progress.retired,
        "limit_cuts": progress.limit_cuts,
        "monitor_stops": progress.monitor_stops,
        "providers": dict(progress.providers),
        "request_states": counts,
        "monitor": engine.monitoring.summary() if engine.monitoring is not None else {"enabled": False},
        "workers": progress.workers,
    }


def money(budget: Budget) -> str:
    """The run's settled spend and, beside it when there is any, what may have been billed."""
    settled = f"${budget.settled_usd:.4f} spent"
    if budget.unknown_usd <= 0:
        return settled
    return f"{settled} + ${budget.unknown_usd:.4f} possibly billed"


def done_line(job: Job, engine: Engine) -> str:
    p = engine.progress
    unknown = (" (possibly billed: sent, then timed out or cut off, no charge confirmed through /generation yet; "
               "at most their reservations, reconciled at the next run)") if engine.budget.unknown_usd > 0 else ""  # fmt: skip
    return (f"{job.dataset}: {p.records_done_before + p.records_done}/{p.records_total} records done ({p.records_done} new, "
            f"{p.output_tokens:,} new output tokens, {money(engine.budget)} this run){unknown}")  # fmt: skip


def log_run(mlflow_run: StageRun, job: Job, engine: Engine, detail: dict[str, object]) -> None:
    progress = engine.progress
    mlflow_run.log_metrics({k: v for k, v in detail.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    mlflow_run.log_metrics(
        {f"provider.{k}": v for k, v in progress.providers.items()} | {f"errors.{k}": v for k, v in progress.errors.items()}
    )
    mlflow_run.log_dict(detail, "summary.json")
    for worker in progress.workers:  # a shared ledger's hosts, each under its own prefix
        mlflow_run.log_metrics({f"worker.{worker['id']}.{k}": v for k, v in worker.items()
                                if isinstance(v, int | float) and k != "id"})  # fmt: skip
    mlflow_run.set_tags(
        {
            "dataset": job.dataset,
            "providers": ",".join(sorted(progress.providers)),
            "cost_usd": f"{engine.budget.settled_usd:.6f}",
            "possibly_billed_usd": f"{engine.budget.unknown_usd:.6f}",
            "stop_reason": progress.stop_reason or "",
        }
    )
    if engine.monitoring is not None:
        for tag, monitor in engine.monitoring.monitors.items():
            mlflow_run.log_series(f"monitor.{tag}.e_value", monitor.path)
        if engine.monitoring.events:
            mlflow_run.set_tags({"monitor.stopped": ",".join(e.tag for e in engine.monitoring.events)})
            mlflow_run.log_dict({"stops": [{"tag": e.tag, **e.stop.__dict__} for e in engine.monitoring.events]},
                                "monitor_events.json")  # fmt: skip


def run_failure(job: Job, engine: Engine, signals: StopSignals, *, resume: str) -> StopRun | None:
    """Why the run did not finish, as the error the stage exits with (None: it finished)."""
    progress = engine.progress
    so_far = (
        f"{progress.records_done_before + progress.records_done} of {progress.records_total} records of {job.dataset} are done"
    )
    kept = "finished records are kept and not paid for again"
    if signals.received:
        cut = "requests still in flight were cut off (counted as possibly billed); " if signals.cut_short else ""
        return StopRun(f"{signals.reason}: {so_far}; {cut}resume with `{resume}` ({kept})", EXIT_INTERRUPTED)
    fatal = engine.fatal
    if fatal is not None:
        if fatal.top_up:  # out of money: the stop reason says why
            return StopRun(f"stopped: {progress.stop_reason}. {so_far}; top up the key, then resume with `{resume}` ({kept})",
                           EXIT_OUT_OF_BUDGET)  # fmt: skip
        return StopRun(f"stopped: {fatal}. {so_far}; resume with `{resume}` once that is fixed", fatal.exit_code)
    if progress.records_failed:
        errors = ", ".join(f"{k} ×{n}" for k, n in progress.errors.most_common(3))
        return StopRun(f"{progress.records_failed} records of {job.dataset} failed this run ({errors}); {so_far}; "
                       f"retry them with `{resume}`", EXIT_OUT_OF_BUDGET)  # fmt: skip
    if progress.stop_reason and "cap" in progress.stop_reason:
        return StopRun(f"stopped: {progress.stop_reason}. {so_far}; raise generate.max_usd_per_run or resume with `{resume}`",
                       EXIT_OUT_OF_BUDGET)  # fmt: skip
    return None
