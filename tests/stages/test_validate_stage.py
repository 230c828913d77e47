"""The validate stage: a clean dataset becomes a SpecForge file and a provenance card;
planted bad records fail the stage by name and leave the previous final file alone."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pyarrow.json as pj
import pytest
from fixtures.generation import GenerationBed

Bed = Callable[..., GenerationBed]


@pytest.fixture
def validated(generation_bed: Bed) -> GenerationBed:
    bed = generation_bed(records=12)
    assert bed.generate().returncode == 0
    done = bed.project.run("validate", "tiny", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    return bed


def final_of(bed: GenerationBed) -> Any:
    return bed.project.root / "data/final/tiny.jsonl"


def test_final_file_and_card(validated: GenerationBed) -> None:
    root = validated.project.root
    lines = [json.loads(line) for line in final_of(validated).read_text().splitlines()]
    assert len(lines) == 12
    assert set(lines[0]) == {"id", "conversations", "status", "provenance"} and lines[0]["status"] == "success"
    assert all(set(t) <= {"role", "content", "reasoning_content"} for r in lines for t in r["conversations"])
    table = pj.read_json(final_of(validated))  # what HF datasets' JSON loader (SpecForge's input) does
    assert {"id", "conversations", "provenance"} <= set(table.column_names)
    card = json.loads((root / "data/final/tiny.card.json").read_text())
    assert card["records"] == 12 and card["cost_usd"] > 0
    assert {p["provider"] for p in card["providers"]} <= {"Alpha", "Beta"}
    assert card["digests"]["final_sha256"] == hashlib.sha256(final_of(validated).read_bytes()).hexdigest()
    assert card["mlflow"]["validate_run_id"] and card["git"]["commit"]
    # Every exported turn's prompt, rendered at the reference, has the token count the provider billed.
    turns = sum(t["role"] == "assistant" for r in lines for t in r["conversations"])
    assert card["prompts"]["match_share"] == 1.0 and card["prompts"]["turns"] == card["turns"] == turns > 12
    assert card["removed"]["turns"] == 0
    # Generated at the shipped temperature 0.7, audited at 1: the card says what that leaves unverified.
    assert card["calibration"]["measured_for_model"] is True
    verified = card["verified_sampling"]
    assert verified["generation"]["temperature"] == 0.7 and verified["differs"] == ["temperature"], verified
    assert verified["note"].startswith("the audit verified each provider at temperature 1, top-p 1")
    report = json.loads((root / "reports/validate/tiny.json").read_text())
    assert report["status"] == "passed" and report["failures"] == []


def rewrite(bed: GenerationBed, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    records = [json.loads(line) for line in bed.output.read_text().splitlines()]
    records = change(records)
    bed.output.write_text("".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records))


def test_planted_bad_records_fail_by_name(validated: GenerationBed) -> None:
    before = final_of(validated).read_bytes()
    ids: dict[str, str] = {}

    def plant(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        wrong_order, unverified, costly, empty = records[0], records[1], records[2], records[3]
        wrong_order["conversations"].reverse()
        unverified["provenance"]["turns"][0]["provider"] = "Gamma"
        costly["provenance"]["usage"]["cost_usd"] += 0.5
        empty["conversations"][-1]["content"] = "   "
        ids.update(order=wrong_order["id"], provider=unverified["id"], cost=costly["id"], empty=empty["id"])
        return records

    rewrite(validated, plant)
    done = validated.project.run("validate", "tiny", "--params", "params.yaml")
    assert done.returncode == 2
    assert "validation of tiny failed" in done.stderr.strip().splitlines()[-1]
    report = json.loads((validated.project.root / "reports/validate/tiny.json").read_text())
    assert report["status"] == "failed"
    by_check = {f["check"]: " ".join(f["examples"]) for f in report["failures"]}
    assert ids["order"] in by_check["roles_alternate_and_end_with_assistant"]
    assert ids["provider"] in by_check["served_by_verified_equivalent_provider"]
    assert ids["cost"] in by_check["equals_ledger_settled_spend"]
    assert ids["empty"] in by_check["no_empty_assistant_content"]
    assert set(by_check["edited_after_generation"].split()) >= {ids["order"], ids["provider"], ids["cost"], ids["empty"]}
    assert final_of(validated).read_bytes() == before


def test_tamper_evidence_names_removed_and_added_records(validated: GenerationBed) -> None:
    removed: list[str] = []

    def tamper(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        removed.append(records[0]["id"])
        extra = json.loads(json.dumps(records[1]))
        extra["id"] = "smuggled"
        return [*records[1:], extra]

    rewrite(validated, tamper)
    done = validated.project.run("validate", "tiny", "--params", "params.yaml")
    assert done.returncode == 2
    report = json.loads((validated.project.root / "reports/validate/tiny.json").read_text())
    by_check = {f["check"]: f["examples"] for f in report["failures"]}
    assert by_check["removed_after_generation"] == removed
    assert by_check["added_after_generation"] == ["smuggled"]


NARROW_COLUMNS = 120
"""``dvc metrics show FILE`` fits a terminal this wide."""


def test_survey_and_validate_metrics_stay_narrow(validated: GenerationBed) -> None:
    project = validated.project
    shown = project.dvc("metrics", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)[""]["data"]
    for path in ("reports/survey/metrics.json", "reports/validate/tiny.json"):
        metrics = data[path]["data"]
        assert not [k for k, v in metrics.items() if isinstance(v, dict)], f"{path}: per-provider detail in the metrics"
        assert len(metrics) <= 8, f"{path}: {sorted(metrics)}"
        table = project.dvc("metrics", "show", path)
        assert max(len(line) for line in table.stdout.splitlines()) <= NARROW_COLUMNS, table.stdout
    card = json.loads((project.root / "data/final/tiny.card.json").read_text())  # the detail moved here
    assert sum(card["checks"]["finish_reasons"].values()) == card["turns_generated"] and card["records_generated"] == 12
    assert sum(p["records_served"] for p in card["providers"]) >= 12


def test_the_reference_down_is_one_line_and_the_final_file_stays(validated: GenerationBed) -> None:
    before = final_of(validated).read_bytes()
    validated.project.set_param("reference.base_url", "http://127.0.0.1:9/v1")
    done = validated.project.run("validate", "tiny", "--params", "params.yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: cannot reach the reference deployment at 127.0.0.1:9"
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    assert final_of(validated).read_bytes() == before
