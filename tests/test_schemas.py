"""The pandera schemas of the artefacts that cross a stage boundary, checked on small
frames: each accepts a valid frame and refuses what it should (a quantization nobody
declares, a malformed sha256, a negative cost, a record served by an endpoint that was not
verified, ...), and ``failures`` reports every failure at once, grouped by column and check,
with the id of each failing record and at most ``first`` examples."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pandera.pandas as pa
import pytest

from quanthunt.schemas import failures as failures_of
from quanthunt.schemas import frame, generated_records, ledger_export, providers_table, verdicts_table
from quanthunt.spec import QUANTIZATIONS

HASH = "a" * 64
ELIGIBLE = [("alpha/int4", "Alpha"), ("beta/fp8", "Beta")]

PROVIDER: dict[str, Any] = {
    "provider": "Alpha", "tag": "alpha/int4", "declared_quantization": "int4", "prompt_usd_per_m": 0.5,
    "completion_usd_per_m": 2.0, "discount": 0.0, "context_length": 8192, "supports_logprobs": True,
    "decision": "candidate", "reason": "candidate",
}  # fmt: skip
"""A row of ``providers.csv``."""

VERDICT: dict[str, Any] = {
    "provider": "Alpha", "tag": "alpha/int4", "declared_quantization": "int4", "verdict": "equivalent", "mode": "logprob",
    "eligible": True, "completions": 36, "cost_usd": 0.01,
}  # fmt: skip
"""A provider's row of ``verdicts.json``."""

LEDGER: dict[str, Any] = {"record_id": "r1", "cost_usd": 0.002, "line_sha256": "0123456789abcdef" * 4}
"""A record as the ledger settled it."""

RECORD: dict[str, Any] = {
    "id": "r1", "roles_ok": True, "empty_assistant": False, "endpoints": [("alpha/int4", "Alpha")], "verdict": "equivalent",
    "cost_usd": 0.002, "prompt_tokens": 12, "completion_tokens": 16, "max_turn_completion_tokens": 16,
    "finish_reason": "stop", "params_sha256": HASH,
}  # fmt: skip
"""A generated record, flattened as the validator flattens it."""

RECORDS = generated_records(max_tokens=16, eligible=ELIGIBLE, params_sha256=HASH)


def table(schema: pa.DataFrameSchema, base: dict[str, Any], *changes: dict[str, Any]) -> pd.DataFrame:
    """A frame of ``base`` changed by each of ``changes`` (one row each; none: ``base`` alone)."""
    return frame([{**base, **change} for change in changes or ({},)], list(base))


def checks(found: list[Any]) -> list[tuple[str, str]]:
    """(column, check name without its arguments) of each failure."""
    return [(f.column, f.check.split("(")[0]) for f in found]


@pytest.mark.parametrize(
    ("schema", "base", "rows"),
    [
        (providers_table, PROVIDER, [{}, {"provider": "Beta", "tag": "beta/fp8", "declared_quantization": "fp8",
                                          "decision": "excluded", "reason": "excluded: declared fp8"}]),
        (verdicts_table, VERDICT, [{}, {"tag": "beta/fp8", "verdict": "different", "eligible": False, "mode": "sample"}]),
        (ledger_export, LEDGER, [{}, {"record_id": "r2", "line_sha256": None}]),  # r2: settled, its line not written yet
        (RECORDS, RECORD, [{}, {"id": "r2", "endpoints": [("alpha/int4", "Alpha"), ("beta/fp8", "Beta")],
                                "finish_reason": "length"}]),
    ],
    ids=["providers_table", "verdicts_table", "ledger_export", "generated_records"],
)  # fmt: skip
def test_a_valid_frame_has_no_failures(schema: pa.DataFrameSchema, base: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    assert failures_of(schema, table(schema, base, *rows)) == []


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"declared_quantization": "int5"}, ("declared_quantization", "isin")),
        ({"declared_quantization": "INT4"}, ("declared_quantization", "isin")),
        ({"provider": ""}, ("provider", "str_length")),
        ({"prompt_usd_per_m": -0.01}, ("prompt_usd_per_m", "greater_than_or_equal_to")),
        ({"completion_usd_per_m": -2.0}, ("completion_usd_per_m", "greater_than_or_equal_to")),
        ({"discount": 1.5}, ("discount", "in_range")),
        ({"context_length": 0}, ("context_length", "greater_than")),
        ({"decision": "maybe"}, ("decision", "isin")),
        ({"decision": "excluded", "reason": "excluded"}, ("reason", "str_matches")),  # an exclusion says why
        ({"reason": "candidate\n"}, ("reason", "str_matches")),
    ],
)
def test_the_providers_table_refuses(change: dict[str, Any], failed: tuple[str, str]) -> None:
    assert checks(failures_of(providers_table, table(providers_table, PROVIDER, change))) == [failed]


def test_every_quantization_a_provider_may_declare_is_accepted() -> None:
    rows = [{"tag": f"p/{q}", "declared_quantization": q} for q in QUANTIZATIONS]
    assert "unknown" in QUANTIZATIONS and failures_of(providers_table, table(providers_table, PROVIDER, *rows)) == []


def test_the_providers_table_refuses_an_endpoint_tag_twice() -> None:
    found = failures_of(providers_table, table(providers_table, PROVIDER, {}, {"provider": "Alpha2"}), id_column="provider")
    assert checks(found) == [("tag", "field_uniqueness")] and found[0].examples == ["Alpha: 'alpha/int4'", "Alpha2: 'alpha/int4'"]


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"verdict": "maybe", "eligible": False}, ("verdict", "isin")),
        ({"mode": "chat"}, ("mode", "isin")),
        ({"declared_quantization": "fp5"}, ("declared_quantization", "isin")),
        ({"completions": -1}, ("completions", "greater_than_or_equal_to")),
        ({"cost_usd": -0.5}, ("cost_usd", "greater_than_or_equal_to")),
    ],
)
def test_the_verdicts_table_refuses(change: dict[str, Any], failed: tuple[str, str]) -> None:
    assert checks(failures_of(verdicts_table, table(verdicts_table, VERDICT, change))) == [failed]


@pytest.mark.parametrize("verdict", ["different", "inconclusive"])
def test_only_an_equivalent_provider_may_be_eligible(verdict: str) -> None:
    rows = table(verdicts_table, VERDICT, {}, {"provider": "Beta", "tag": "beta/fp8", "verdict": verdict})
    found = failures_of(verdicts_table, rows, id_column="provider")
    assert {f.check for f in found} == {"eligible_only_if_equivalent"}
    (on_verdict,) = (f for f in found if f.column == "verdict")
    assert on_verdict.examples == [f"Beta: {verdict!r}"]  # the eligible equivalent Alpha is not named


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"line_sha256": "0123456789ABCDEF" * 4}, ("line_sha256", "str_matches")),  # hashlib's hexdigest is lower case
        ({"line_sha256": "0" * 63}, ("line_sha256", "str_matches")),
        ({"line_sha256": "0" * 64 + "\n"}, ("line_sha256", "str_matches")),
        ({"line_sha256": "g" * 64}, ("line_sha256", "str_matches")),
        ({"cost_usd": -0.001}, ("cost_usd", "greater_than_or_equal_to")),
    ],
)
def test_the_ledger_export_refuses(change: dict[str, Any], failed: tuple[str, str]) -> None:
    assert checks(failures_of(ledger_export, table(ledger_export, LEDGER, change))) == [failed]


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"id": ""}, ("id", "str_length")),
        ({"roles_ok": False}, ("roles_ok", "roles_alternate_and_end_with_assistant")),
        ({"empty_assistant": True}, ("empty_assistant", "no_empty_assistant_content")),
        ({"endpoints": [("gamma/nvfp4", "Gamma")]}, ("endpoints", "served_by_verified_equivalent_provider")),
        ({"endpoints": [("alpha/int4", "Beta")]}, ("endpoints", "served_by_verified_equivalent_provider")),  # renamed
        ({"endpoints": [("alpha/int4", "Alpha"), ("gamma/nvfp4", "Gamma")]},  # one turn of two from elsewhere
         ("endpoints", "served_by_verified_equivalent_provider")),
        ({"endpoints": []}, ("endpoints", "served_by_verified_equivalent_provider")),  # served by nobody named
        ({"verdict": "inconclusive"}, ("verdict", "verdict_equivalent")),
        ({"cost_usd": -0.01}, ("cost_usd", "cost_not_negative")),
        ({"prompt_tokens": -1}, ("prompt_tokens", "prompt_tokens_not_negative")),
        ({"completion_tokens": 0}, ("completion_tokens", "has_output_tokens")),
        ({"max_turn_completion_tokens": 17}, ("max_turn_completion_tokens", "within_max_tokens_16")),
        ({"finish_reason": "cancelled"}, ("finish_reason", "isin")),
        ({"params_sha256": "b" * 64}, ("params_sha256", "same_sampling_params")),
    ],
)  # fmt: skip
def test_a_generated_record_is_refused_by_the_check_named_for_its_fault(change: dict[str, Any], failed: tuple[str, str]) -> None:
    assert checks(failures_of(RECORDS, table(RECORDS, RECORD, change))) == [failed]


def test_generated_records_refuse_an_id_twice() -> None:
    found = failures_of(RECORDS, table(RECORDS, RECORD, {}, {}), id_column="id")
    assert checks(found) == [("id", "field_uniqueness")] and found[0].count == 2


def test_failures_are_grouped_by_column_and_check_with_the_failing_records_ids() -> None:
    rows = table(
        providers_table,
        PROVIDER,
        {},
        {"provider": "Beta", "tag": "beta/x", "declared_quantization": "int5", "prompt_usd_per_m": -1.0},
        {"provider": "Gamma", "tag": "gamma/x", "declared_quantization": "fp7"},
    )
    found = failures_of(providers_table, rows, id_column="tag")
    assert [(f.column, f.count, f.examples) for f in found] == [
        ("declared_quantization", 2, ["beta/x: 'int5'", "gamma/x: 'fp7'"]),
        ("prompt_usd_per_m", 1, ["beta/x: -1.0"]),
    ]
    assert found[1].line() == "greater_than_or_equal_to(0) on prompt_usd_per_m: 1 failing (beta/x: -1.0)"


def test_failures_count_every_failing_value_but_show_only_the_first() -> None:
    rows = table(RECORDS, RECORD, *({"id": f"r{i}", "completion_tokens": 0} for i in range(7)))
    (found,) = failures_of(RECORDS, rows, id_column="id", first=3)
    assert found.count == 7 and found.examples == ["r0: 0", "r1: 0", "r2: 0"]


def test_without_an_id_column_the_failing_values_stand_alone() -> None:
    (found,) = failures_of(ledger_export, table(ledger_export, LEDGER, {"cost_usd": -0.5}))
    assert found.examples == ["-0.5"]


def test_a_missing_column_is_a_failure_not_an_exception() -> None:
    rows = frame([{"record_id": "r1", "line_sha256": None}], ["record_id", "line_sha256"])
    (found,) = failures_of(ledger_export, rows, id_column="record_id")
    assert (found.check, found.examples) == ("column_in_dataframe", ["'cost_usd'"])


def test_a_row_without_a_value_is_refused_where_the_value_is_required() -> None:
    rows = frame([LEDGER, {"record_id": "r2", "line_sha256": None}], ["record_id", "cost_usd", "line_sha256"])
    assert [(f.column, f.check, f.examples) for f in failures_of(ledger_export, rows, id_column="record_id")] == [
        ("cost_usd", "not_nullable", ["r2: nan"])
    ]
