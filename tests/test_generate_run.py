"""The pure parts of one generate run, without a gateway or a model: which endpoints may
serve (``eligible_providers``: the verdicts joined with the survey's ``providers.csv``, and
one clear ``ConfigError`` naming the file when the two disagree), which prompt records a
run streams (``limited``), the live status line, the run's figures (``summary``,
``detail``, ``done_line``) and why an unfinished run stops with which exit code
(``run_failure``). Whole runs against the sandbox are ``tests/stages/test_generate_stage.py``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
from pathlib import Path

import httpx
import pytest
from fixtures.generation import write_prompts
from fixtures.params import SHIPPED, changed
from fixtures.records import writing
from fixtures.signals import deliver
from fixtures.verdicts import eligible, provider_verdict, verdicts_of
from rich.console import Console

from quanthunt.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OUT_OF_BUDGET, ConfigError
from quanthunt.gateway import ApiKey, Gateway, GatewayError, Routing, check_gateway
from quanthunt.generate_run import (
    detail,
    done_line,
    eligible_providers,
    limited,
    run_failure,
    status_table,
    summary,
)
from quanthunt.generation import Engine, StopRun
from quanthunt.interrupts import StopSignals
from quanthunt.jobs import Job
from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.replies import ChatReply
from quanthunt.survey import ProviderRow, providers_csv
from quanthunt.verdicts import Verdict, Verdicts

PARAMS = SHIPPED
RESUME = "quanthunt generate chat --params params.yaml"
HOUR = 3600.0
"""A grace no test waits out: only a second signal cuts the run short."""


# -- which endpoints may serve ---------------------------------------------------------------------------------------


def surveyed(
    tag: str, *, prompt: float = 0.5, completion: float = 2.0, context: int = 8192, reason: str = "candidate"
) -> ProviderRow:
    """A row of ``providers.csv`` (``alpha/int4`` -> provider ``Alpha``, declaring int4)."""
    name, quantization = tag.split("/")
    decision = "candidate" if reason == "candidate" else "excluded"
    return ProviderRow(provider=name.capitalize(), tag=tag, declared_quantization=quantization,
                       prompt_usd_per_m=prompt, completion_usd_per_m=completion, discount=0.0, price_note="", status=0,
                       uptime_last_30m=99.5, context_length=context, max_completion_tokens=None, supports_logprobs=True,
                       decision=decision, reason=reason)  # fmt: skip


def project(root: Path, verdicts: Verdicts, rows: list[ProviderRow]) -> Path:
    """``root`` with the verify stage's verdicts and the survey's providers table written where params.yaml says."""
    for path, text in ((PARAMS.paths.verdicts, verdicts.model_dump_json(indent=2)),
                       (PARAMS.paths.survey_providers, providers_csv(rows))):  # fmt: skip
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    return root


def test_each_eligible_verdict_becomes_an_endpoint_priced_as_the_survey_found_it(tmp_path: Path) -> None:
    verdicts = verdicts_of(
        provider_verdict("beta/fp8", declared_quantization="fp8", mlflow_run_id="run-beta"),
        provider_verdict("gamma/nvfp4", "different", declared_quantization="nvfp4"),
        provider_verdict("delta/int4", eligible=False, survey_decision="excluded: status -5"),  # equivalent, excluded
        provider_verdict("alpha/int4", mlflow_run_id="run-alpha"),
    )
    rows = [
        surveyed("alpha/int4", prompt=0.5, completion=2.0, context=8192),
        surveyed("beta/fp8", prompt=1.25, completion=4.0, context=32768),
        surveyed("gamma/nvfp4", reason="excluded: declared nvfp4"),
        surveyed("delta/int4", reason="excluded: status -5"),
    ]
    chosen, loaded = eligible_providers(PARAMS, project(tmp_path, verdicts, rows))
    assert loaded == verdicts
    beta, alpha = chosen  # in the verdicts' order
    assert (beta.name, beta.tag, beta.declared_quantization, beta.verdict) == ("Beta", "beta/fp8", "fp8", "equivalent")
    assert (beta.prompt_usd_per_token, beta.completion_usd_per_token) == pytest.approx((1.25e-6, 4e-6), rel=1e-12)
    assert (beta.context_length, beta.verdict_run_id) == (32768, "run-beta")
    assert (alpha.prompt_usd_per_token, alpha.completion_usd_per_token) == pytest.approx((0.5e-6, 2e-6), rel=1e-12)
    assert (alpha.context_length, alpha.verdict_run_id) == (8192, "run-alpha")
    # every other surveyed endpoint is a sibling the pinned routing must keep out, excluded ones included
    assert beta.siblings == ("alpha/int4", "gamma/nvfp4", "delta/int4")
    assert alpha.siblings == ("beta/fp8", "gamma/nvfp4", "delta/int4")


def test_verdicts_for_another_model_are_refused_naming_the_verdicts_file(tmp_path: Path) -> None:
    root = project(tmp_path, verdicts_of(provider_verdict("alpha/int4"), model="other/model"), [surveyed("alpha/int4")])
    with pytest.raises(ConfigError) as info:
        eligible_providers(PARAMS, root)
    expected = f"{root / PARAMS.paths.verdicts}: verdicts are for other/model, not {PARAMS.survey.model}; rerun verify"
    assert str(info.value) == expected


def test_a_verified_endpoint_missing_from_the_survey_is_refused_naming_the_survey_file(tmp_path: Path) -> None:
    verdicts = verdicts_of(provider_verdict("alpha/int4"), provider_verdict("beta/int4"))
    root = project(tmp_path, verdicts, [surveyed("alpha/int4")])
    with pytest.raises(ConfigError) as info:
        eligible_providers(PARAMS, root)
    assert str(info.value) == f"{root / PARAMS.paths.survey_providers}: beta/int4 is verified but missing; rerun the survey"


@pytest.mark.parametrize("verdict", ["different", "inconclusive"])
def test_an_endpoint_marked_eligible_without_an_equivalent_verdict_is_refused(tmp_path: Path, verdict: Verdict) -> None:
    """``verdicts.json`` edited or damaged: nothing is bought from an endpoint the audit did not find equivalent
    (the validate stage would refuse the whole file after the money was spent)."""
    verdicts = verdicts_of(provider_verdict("alpha/int4"), provider_verdict("beta/int4", verdict, eligible=True))
    root = project(tmp_path, verdicts, [surveyed("alpha/int4"), surveyed("beta/int4")])
    with pytest.raises(ConfigError) as info:
        eligible_providers(PARAMS, root)
    assert str(info.value) == f"{root / PARAMS.paths.verdicts}: beta/int4 is eligible but verdict {verdict}; rerun verify"


def test_with_no_eligible_endpoint_nothing_can_generate(tmp_path: Path) -> None:
    verdicts = verdicts_of(provider_verdict("alpha/int4", "inconclusive"), provider_verdict("gamma/nvfp4", "different"))
    root = project(tmp_path, verdicts, [surveyed("alpha/int4"), surveyed("gamma/nvfp4")])
    with pytest.raises(ConfigError, match="no provider was verified equivalent") as info:
        eligible_providers(PARAMS, root)
    assert str(info.value).startswith(f"{root / PARAMS.paths.verdicts}: ")


# -- which records a run streams ---------------------------------------------------------------------------------------


def test_max_records_counts_the_files_first_records_finished_or_not(tmp_path: Path) -> None:
    prompts = tmp_path / "chat.jsonl"
    write_prompts(prompts, 6)
    done = frozenset({"r0001", "r0004"})
    assert [r.id for r in limited(prompts, 4, done)] == ["r0000", "r0002", "r0003"]  # a resumed run goes no further
    assert [r.id for r in limited(prompts, None, done)] == ["r0000", "r0002", "r0003", "r0005"]
    assert [r.id for r in limited(prompts, 0, frozenset())] == []


# -- an engine that has run (its counters set as a run leaves them) -------------------------------------------------------

ALPHA = eligible("Alpha", "alpha/int4", "int4", 0.5e-6, 2e-6, 8192)
JOB = Job(dataset="chat", model=PARAMS.survey.model, providers=(ALPHA,), routing=Routing(data_collection="deny"),
          params_hash="p" * 64, run_id="run", concurrency=4, verification_run_id="verify-run",
          settings=changed(PARAMS.generate, max_usd_per_run=5.0, max_output_tokens=100_000, concurrency=4))  # fmt: skip


class NoChat:
    """The engines here are never run: a request would be a bug in the test."""

    async def chat(self, body: object, *, on_headers: object = None) -> ChatReply:
        raise AssertionError("no request expected")


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    """A run of 10 records of ``chat``: 3 done by earlier runs, 4 now, 1 failed; $0.1234 settled."""
    ledger = SqliteLedger(tmp_path / "ledger.sqlite")

    async def made() -> Engine:
        async with writing(ledger, tmp_path / "out.jsonl", JOB.params_hash) as (writer, sink):
            return Engine(JOB, NoChat(), ledger, writer, sink, done_turns={})

    try:
        ran = asyncio.run(made())
    finally:
        ledger.close()
    p = ran.progress
    p.records_total, p.records_done_before, p.records_done, p.records_failed, p.records_skipped = 10, 3, 4, 1, 1
    p.requests_ok, p.output_tokens_before, p.output_tokens, p.quarantined = 6, 500, 1234, 2
    p.retries.update({"http_429": 3, "timeout": 1})
    p.errors.update({"http_500": 2, "timeout": 1, "malformed": 1, "finish_error": 1})
    p.providers.update({"alpha/int4": 6})
    p.skipped_reasons.update({"prompt over the context length": 1})
    assert ran.budget.reserve(0.2)
    ran.budget.settle(0.1, 0.123456789012)  # one request settled for less than it reserved ...
    ran.budget.unknown(0.1)  # ... one lost after it was sent
    return ran


def test_the_summary_counts_earlier_runs_records_and_only_this_runs_money(engine: Engine) -> None:
    headline = summary(JOB, engine)
    assert headline == {
        "records_total": 10, "records_done": 7, "records_new": 4, "records_failed": 1, "records_skipped": 1,
        "output_tokens_new": 1234, "spent_usd_run": 0.12345679, "possibly_billed_usd_run": 0.1, "requests_ok": 6,
        "retries_total": 4, "errors_total": 5, "quarantined": 2, "monitor_stops_total": 0, "stop_reason": None,
        "params_sha256": "p" * 64,
    }  # fmt: skip
    assert all(isinstance(v, int | float | str | None) for v in headline.values())  # DVC metrics: flat figures only
    # The $0.10 lost after it was sent shows beside the settled spend (it was left out of this line)
    assert done_line(JOB, engine).startswith(
        "chat: 7/10 records done (4 new, 1,234 new output tokens, $0.1235 spent + $0.1000 possibly billed this run) "
        "(possibly billed: sent, then timed out or cut off"
    )
    engine.budget.reconciled(0.1, 0.02)
    assert done_line(JOB, engine) == "chat: 7/10 records done (4 new, 1,234 new output tokens, $0.1435 spent this run)"


def test_the_detail_adds_every_breakdown_to_the_headline_as_plain_json(engine: Engine) -> None:
    headline = summary(JOB, engine)
    full = detail(engine, headline, {"done": 6, "failed": 1})
    assert {k: full[k] for k in headline} == headline
    assert json.loads(json.dumps(full)) == full  # what the detail file holds is what the run counted
    assert full["retries"] == {"http_429": 3, "timeout": 1} and full["providers"] == {"alpha/int4": 6}
    assert full["skipped_reasons"] == {"prompt over the context length": 1}
    assert full["request_states"] == {"done": 6, "failed": 1} and full["monitor"] == {"enabled": False}


def status_text(engine: Engine) -> str:
    console = Console(file=io.StringIO(), width=200, record=True, color_system=None)
    console.print(status_table(JOB, engine.progress, engine.budget))
    return console.export_text()


def test_the_status_shows_progress_across_runs_against_the_runs_limits(engine: Engine) -> None:
    text = status_text(engine)
    assert "records 7/10" in text and "failed 1" in text and "skipped 1" in text
    assert "tokens 1,734/100,000" in text  # earlier runs' tokens count against the dataset's budget
    assert "$0.1235 spent + $0.1000 possibly billed of $5" in text  # each shown, neither hidden in the other
    assert "retries: http_429 3, timeout 1" in text and "errors: http_500 2, " in text


def test_the_status_of_a_run_that_finished_nothing_yet_guesses_no_eta(engine: Engine) -> None:
    engine.progress.records_done = 0
    engine.progress.retries.clear()
    engine.progress.errors.clear()
    text = status_text(engine)
    assert "ETA ?" in text and "retries: none" in text and "errors: none" in text


# -- why a run did not finish ------------------------------------------------------------------------------------------


def signals_of(engine: Engine, *sent: signal.Signals) -> StopSignals:
    """The stop signals of a run that was sent ``sent`` (real signals to this process, handled
    by the run's event loop as in ``generate_run.run``); none: a run that ended by itself."""

    async def scenario() -> StopSignals:
        work = asyncio.ensure_future(asyncio.Event().wait())  # the run's work: ends only when cancelled
        with StopSignals(work, grace_s=HOUR, on_first=engine.stop) as signals:
            for sig in sent:
                await deliver(sig, signals)
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return signals

    return asyncio.run(scenario())


def failure(engine: Engine, *sent: signal.Signals) -> StopRun:
    found = run_failure(JOB, engine, signals_of(engine, *sent), resume=RESUME)
    assert found is not None
    return found


SO_FAR = "7 of 10 records of chat are done"
KEPT = "(finished records are kept and not paid for again)"


def test_a_finished_run_is_no_failure(engine: Engine) -> None:
    engine.progress.records_failed = 0
    assert run_failure(JOB, engine, signals_of(engine), resume=RESUME) is None


def test_a_run_that_reached_the_datasets_token_budget_finished(engine: Engine) -> None:
    engine.progress.records_failed = 0
    engine.stop("the dataset's output-token budget is reached")
    assert run_failure(JOB, engine, signals_of(engine), resume=RESUME) is None


def test_one_signal_stops_the_run_resumably_and_says_nothing_was_cut_off(engine: Engine) -> None:
    stopped = failure(engine, signal.SIGTERM)
    assert engine.progress.stop_reason == "interrupted by SIGTERM"  # the engine was asked to stop
    assert stopped.exit_code == EXIT_INTERRUPTED
    assert str(stopped) == f"interrupted by SIGTERM: {SO_FAR}; resume with `{RESUME}` {KEPT}"


def test_a_second_signal_cuts_the_requests_in_flight_off_as_possibly_billed(engine: Engine) -> None:
    stopped = failure(engine, signal.SIGINT, signal.SIGINT)
    assert stopped.exit_code == EXIT_INTERRUPTED
    assert str(stopped).startswith(f"interrupted by SIGINT: {SO_FAR}; requests still in flight were cut off (counted as "
                                   "possibly billed); resume with")  # fmt: skip


def test_a_key_out_of_credit_says_top_up_then_resume(engine: Engine) -> None:
    engine.stop("the gateway refused for lack of money (openrouter_credits)", fatal=StopRun("", EXIT_OUT_OF_BUDGET, top_up=True))
    stopped = failure(engine)
    assert stopped.exit_code == EXIT_OUT_OF_BUDGET
    assert str(stopped) == (f"stopped: the gateway refused for lack of money (openrouter_credits). {SO_FAR}; top up the key, "
                            f"then resume with `{RESUME}` {KEPT}")  # fmt: skip


def test_every_provider_stopped_by_its_monitor_says_rerun_verify_not_top_up(engine: Engine) -> None:
    why = "every eligible provider was stopped by its monitor (alpha/int4: stopped by its monitor); rerun verify, then generate"
    engine.stop("every eligible provider was stopped by its monitor", fatal=StopRun(why, EXIT_OUT_OF_BUDGET))
    stopped = failure(engine)
    assert stopped.exit_code == EXIT_OUT_OF_BUDGET  # resumable once verified again
    assert "top up" not in str(stopped) and f"{why}. {SO_FAR}; resume with `{RESUME}` once that is fixed" in str(stopped)


def test_a_configuration_that_cannot_work_keeps_its_exit_code_and_reason(engine: Engine) -> None:
    engine.stop("the gateway refused the key", fatal=StopRun("the gateway refused the key: HTTP 401", EXIT_BAD_INPUT))
    stopped = failure(engine)
    assert stopped.exit_code == EXIT_BAD_INPUT
    assert str(stopped) == f"stopped: the gateway refused the key: HTTP 401. {SO_FAR}; resume with `{RESUME}` once that is fixed"


def test_failed_records_end_the_run_resumably_naming_the_commonest_errors(engine: Engine) -> None:
    stopped = failure(engine)
    assert stopped.exit_code == EXIT_OUT_OF_BUDGET
    assert str(stopped) == (f"1 records of chat failed this run (http_500 ×2, timeout ×1, malformed ×1); {SO_FAR}; "
                            f"retry them with `{RESUME}`")  # fmt: skip


def test_the_runs_spending_cap_says_which_param_to_raise(engine: Engine) -> None:
    engine.progress.records_failed = 0
    engine.stop("the run's spending cap (generate.max_usd_per_run $5) would be exceeded")
    stopped = failure(engine)
    assert stopped.exit_code == EXIT_OUT_OF_BUDGET
    assert "raise generate.max_usd_per_run or resume with" in str(stopped) and SO_FAR in str(stopped)


# -- the gateway check before any money moves -------------------------------------------------------------------------


def test_a_gateway_that_answers_with_an_error_is_not_reported_as_unreachable() -> None:
    """Only a gateway that cannot be reached becomes the ``api.base_url`` ConfigError; a refused key stays itself."""

    async def scenario() -> None:
        refusing = httpx.MockTransport(lambda request: httpx.Response(401, json={"error": {"code": 401, "message": "no"}}))
        async with Gateway("https://gateway.example/api/v1", ApiKey("sk-test"), transport=refusing) as gateway:
            await check_gateway(gateway, "https://gateway.example/api/v1")

    with pytest.raises(GatewayError) as info:
        asyncio.run(scenario())
    assert info.value.kind == "http_401" and not isinstance(info.value, ConfigError)
