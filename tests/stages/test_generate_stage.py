"""The generate stage against a latency-mode sandbox: records, provenance, resume,
faults, money running out, and bad input."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest
from fixtures.generation import GenerationBed
from fixtures.sandbox import provider

Bed = Callable[..., GenerationBed]


def assert_consistent(bed: GenerationBed, *, expected: int | None = None) -> list[dict[str, object]]:
    records = bed.records()
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), Counter(ids).most_common(3)
    if expected is not None:
        assert len(ids) == expected
    settled, unknown = bed.ledger_spend()
    charged = bed.charged_usd()
    assert settled - 1e-9 <= charged <= settled + unknown + 1e-9, (settled, unknown, charged)
    return records


def test_clean_run_then_nothing_to_redo(generation_bed: Bed) -> None:
    bed = generation_bed(records=40)
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    records = assert_consistent(bed, expected=40)
    settled, unknown = bed.ledger_spend()
    assert unknown == 0 and round(settled, 10) == round(bed.charged_usd(), 10)  # to the cent, and well beyond
    first = next(r for r in records if r["id"] == "r0000")  # records are written as they finish, not in file order
    assert [t["role"] for t in first["conversations"]] == ["user", "assistant", "user", "assistant"]  # regenerated, multi-turn
    assert first["conversations"][1]["content"] != "old answer"
    provenance = first["provenance"]
    # Each turn may go to either eligible provider; a record's provenance lists every one it used, and each
    # turn names its own provider, precision and verdict.
    used = list(dict.fromkeys(t["endpoint_tag"] for t in provenance["turns"]))
    assert [p["endpoint_tag"] for p in provenance["providers"]] == used
    declared = {"alpha/int4": ("Alpha", "int4"), "beta/int4": ("Beta", "int4")}
    for turn in provenance["turns"]:
        assert (turn["provider"], turn["declared_quantization"]) == declared[turn["endpoint_tag"]]
        assert turn["verdict"] == "equivalent" and turn["verification_run_id"] == provenance["verification_run_id"]
        assert set(turn) >= {"generation_id", "finish_reason", "prompt_tokens", "completion_tokens", "cost_usd", "verdict_run_id"}
    assert set(provenance) >= {"providers", "verification_run_id", "model", "sampling", "usage", "attempts", "started_at",
                               "finished_at", "params_sha256", "quanthunt_version"}  # fmt: skip
    assert len(provenance["turns"]) == 2
    assert sum(r["provenance"]["usage"]["cost_usd"] for r in records) == pytest.approx(settled)
    report = bed.detail()
    assert report["records_done"] == 40 and report["records_failed"] == 0

    requests_before = bed.sandbox_stats()["requests"]
    again = bed.generate()
    assert again.returncode == 0, again.stderr
    assert bed.sandbox_stats()["requests"] == requests_before  # nothing finished is requested (or paid for) again
    assert_consistent(bed, expected=40)


def test_a_provider_verified_different_after_it_served_has_its_records_made_again(generation_bed: Bed) -> None:
    """Issue 26: with beta's verdict changed to different after generation, validate named
    its records and failed, and generate said "0 new". Now generate sets them aside (kept)
    and makes them again from alpha, keeping the turns alpha had served; validate passes
    and no exported turn is beta's."""
    bed = generation_bed(records=24)
    assert bed.generate().returncode == 0
    first = {r["id"]: r for r in bed.records()}
    betas = {i for i, r in first.items() if any(t["endpoint_tag"] == "beta/int4" for t in r["provenance"]["turns"])}
    assert betas, "beta served nothing: the test proves nothing"
    path = bed.project.root / "reports/verify/verdicts.json"
    verdicts = json.loads(path.read_text())
    for p in verdicts["providers"]:
        if p["tag"] == "beta/int4":
            p.update(verdict="different", eligible=False, reason="re-verified: NVFP4")
    path.write_text(json.dumps(verdicts))
    charged = bed.charged_usd()

    again = bed.generate()
    assert again.returncode == 0, again.stderr
    assert (
        f"refill: {len(betas)} record{'s' if len(betas) > 1 else ''} (beta/int4 ×{len(betas)}) made again"
        in again.stdout + again.stderr
    )
    records = assert_consistent(bed, expected=24)
    assert not {t["endpoint_tag"] for r in records for t in r["provenance"]["turns"]} - {"alpha/int4"}
    for record in records:
        if record["id"] in betas:  # alpha's turns before beta's first are kept, not bought again
            old = first[record["id"]]["provenance"]["turns"]
            kept = next(i for i, t in enumerate(old) if t["endpoint_tag"] == "beta/int4")
            assert [t["generation_id"] for t in record["provenance"]["turns"][:kept]] == [t["generation_id"] for t in old[:kept]]
            assert record["provenance"]["usage"]["cost_usd"] > sum(t["cost_usd"] for t in record["provenance"]["turns"]) + 1e-12
        else:
            assert record == first[record["id"]]
    assert bed.charged_usd() > charged
    aside = sorted((bed.project.root / "state/generating/replaced").glob("tiny-*.jsonl"))
    assert [json.loads(line)["id"] for line in aside[0].read_text().splitlines()] == sorted(betas, key=list(first).index)

    checked = bed.project.run("validate", "tiny", "--params", "params.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    card = json.loads((bed.project.root / "data/final/tiny.card.json").read_text())
    assert card["replaced"]["records"] == len(betas) and card["replaced"]["by_provider"] == {"beta/int4": len(betas)}
    final = [json.loads(line) for line in (bed.project.root / "data/final/tiny.jsonl").read_text().splitlines()]
    assert len(final) == 24 and all(t["endpoint_tag"] == "alpha/int4" for r in final for t in r["provenance"]["turns"])

    assert "refill" not in (third := bed.generate()).stdout + third.stderr  # nothing left to make again


def test_faults_are_retried_and_reconciled(generation_bed: Bed) -> None:
    faults = {"rate_limit": 0.08, "server_error": 0.05, "bad_gateway": 0.05, "unavailable": 0.05, "timeout": 0.03,
              "connection_reset": 0.05, "malformed_json": 0.05, "truncated_body": 0.03, "finish_error": 0.05}  # fmt: skip
    bed = generation_bed(faults=faults, records=40, params={"generate.retry.max_attempts": 12})
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    assert_consistent(bed, expected=40)
    report = bed.detail()
    assert {"http_429", "http_500", "malformed", "finish_error"} <= set(report["errors"])
    settled, unknown = bed.ledger_spend()
    assert round(settled + unknown, 10) >= round(bed.charged_usd(), 10) >= round(settled, 10)


def test_possibly_billed_spend_shows_wherever_spend_does(generation_bed: Bed) -> None:
    """Timed-out requests whose charge /generation cannot confirm yet (its records lag an
    hour here) stay possibly billed: the final line, the metrics, the MLflow run, the card
    and the report show them beside the settled spend, equal to the ledger's (they said
    "$0.0045 spent" with $0.0565 possibly billed beside it)."""
    bed = generation_bed(
        faults={"timeout": 0.3, "timeout_s": 10},
        records=12,
        # short replies, so a held one outlasts its read timeout soon (every one is then cut at 48 tokens: let validate pass it)
        params={"generate.retry.max_attempts": 10, "generate.sampling.max_tokens": 48, "validate.max_truncated_share": 1.0},
        roster_extra={"generation_lookup_delay_s": 3600},
    )
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    settled, unknown = bed.ledger_spend()
    assert unknown > 0 and settled - 1e-9 <= bed.charged_usd() <= settled + unknown + 1e-9
    assert f"+ ${unknown:.4f} possibly billed this run" in done.stderr, done.stderr
    metrics = json.loads((bed.project.root / "reports/generate/tiny.json").read_text())
    assert metrics["possibly_billed_usd_run"] == pytest.approx(unknown)
    (run,) = [r for r in bed.project.mlflow().search_runs(["0", "1"]) if r.data.tags.get("dataset") == "tiny"]
    assert float(run.data.tags["possibly_billed_usd"]) == pytest.approx(unknown, abs=1e-6)

    checked = bed.project.run("validate", "tiny", "--params", "params.yaml")
    assert checked.returncode == 0, checked.stderr
    card = json.loads((bed.project.root / "data/final/tiny.card.json").read_text())
    assert card["spend"]["possibly_billed_usd"] == pytest.approx(unknown)
    assert card["spend"]["settled_usd"] == pytest.approx(settled) and card["spend"]["possibly_billed_attempts"] > 0
    assert bed.project.run("report", "--params", "params.yaml").returncode == 0
    page = (bed.project.root / "reports/index.html").read_text()
    assert f"(and ${unknown:.4f} possibly billed)" in page


def test_an_endpoint_that_queues_gets_fewer_requests_in_flight_and_few_are_bought_twice(generation_bed: Bed) -> None:
    """Two endpoints serving 2 requests at a time, 0.3 s each, with 32 workers: requests
    queued behind the first few waited past their timeout, were possibly billed and were
    bought again, over and over (measured before: 2,080 timeouts, 104 of 120 records failed
    after 20 attempts). Each endpoint's in-flight limit now halves on a timeout, as verify's
    does, so the queue drains (measured: 85 timeouts, 5 cuts each, every record done)."""
    slow = {"latency_ms": 300, "max_concurrent": 2}
    bed = generation_bed(
        records=120,
        roster_extra={"providers": [provider("alpha", **slow), provider("beta", **slow)]},
        params={"generate.concurrency": 32, "generate.request_timeout_s": 0.5, "generate.sampling.max_tokens": 8,
                "generate.retry.max_attempts": 20, "validate.max_truncated_share": 1.0},
    )  # fmt: skip
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    assert_consistent(bed, expected=120)
    detail = bed.detail()
    timeouts = detail["errors"].get("timeout", 0)
    assert timeouts > 0, "nothing timed out: the test no longer tests a queueing endpoint"
    assert detail["limit_cuts"], "a timeout cut no endpoint's limit"
    assert timeouts <= 300, timeouts  # well under the 2,080 a fixed 32 in flight paid for


def test_out_of_credit_exits_75_and_resumes_after_top_up(generation_bed: Bed) -> None:
    bed = generation_bed(records=60, credits=0.004)
    first = bed.generate()
    assert first.returncode == 75, first.stderr
    message = first.stderr.strip().splitlines()[-1]
    assert "openrouter_credits" in message and "top up the key" in message and "records of tiny are done" in message
    partial = assert_consistent(bed)
    assert 0 < len(partial) < 60
    bed.add_credit(10)
    second = bed.generate()
    assert second.returncode == 0, second.stderr
    assert_consistent(bed, expected=60)
    settled, unknown = bed.ledger_spend()
    assert round(settled, 10) == round(bed.charged_usd(), 10) and unknown == 0


def test_the_runs_own_cap_is_never_exceeded(generation_bed: Bed) -> None:
    bed = generation_bed(records=60, params={"generate.max_usd_per_run": 0.003, "generate.sampling.max_tokens": 48})
    done = bed.generate()
    assert done.returncode == 75, done.stderr
    assert "spending cap" in done.stderr
    settled, unknown = bed.ledger_spend()
    assert settled + unknown <= 0.003 + 1e-12
    assert 0 < len(assert_consistent(bed)) < 60


def test_in_flight_reservations_wait_and_finish(generation_bed: Bed) -> None:
    # max_tokens 256 but the sandbox answers 64 tokens: each of the 40 requests in flight
    # reserves ~$0.001 while costing ~$0.00016. $0.02 of credit cannot cover the reservations
    # at once (the gateway answers 402 in-flight) but pays for all ~50 requests.
    bed = generation_bed(records=40, credits=0.02, latency_ms=200, params={"generate.sampling.max_tokens": 256})
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    report = bed.detail()
    assert report["errors"].get("openrouter_in_flight_budget", 0) > 0
    assert_consistent(bed, expected=40)


def test_bad_inputs(generation_bed: Bed) -> None:
    bed = generation_bed(records=5)
    prompts = bed.project.root / "data/prompts/tiny.jsonl"
    good = prompts.read_text()
    prompts.write_text(good + '{"id": "broken", "messages": [\n')
    done = bed.generate()
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"error: {prompts}:6: not valid JSON")
    assert not bed.output.exists() or bed.records() == []

    first_id = json.loads(good.splitlines()[0])["id"]
    prompts.write_text(good + json.dumps({"id": first_id, "messages": [{"role": "user", "content": "again"}]}) + "\n")
    done = bed.generate()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last == f"error: {prompts}:6: duplicate id '{first_id}' (first on line 1)", done.stderr
    assert bed.sandbox_stats()["requests"] == 0  # the whole file is checked before the first request

    prompts.write_text("\n")
    done = bed.generate()
    assert done.returncode == 2 and "has no prompt records" in done.stderr

    prompts.write_text(good + json.dumps({"id": "huge", "messages": [{"role": "user", "content": "word " * 20000}]}) + "\n")
    done = bed.generate()
    assert done.returncode == 0, done.stderr
    report = bed.detail()
    assert report["records_skipped"] == 1 and report["skipped_reasons"] == {"prompt over the context length": 1}
    assert "huge" not in {r["id"] for r in bed.records()}

    (bed.project.root / "reports/verify/verdicts.json").unlink()
    done = bed.generate()
    assert done.returncode == 2 and "run the verify stage first" in done.stderr
