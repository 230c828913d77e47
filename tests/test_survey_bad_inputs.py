"""Corrupted ``providers.csv`` files (the survey's output, read by later stages) load as
valid rows or end as one ``ConfigError`` line naming the file."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from fixtures.bad_inputs import MEDIUM, assert_config_error, scratch_file
from hypothesis import given
from hypothesis import strategies as st

from quanthunt.errors import ConfigError
from quanthunt.survey import PROVIDER_COLUMNS, ProviderRow, read_providers

ROW = {
    "provider": "P", "tag": "p/int4", "declared_quantization": "int4", "prompt_usd_per_m": "0.5", "completion_usd_per_m": "2.0",
    "discount": "0.0", "price_note": "", "status": "0", "uptime_last_30m": "99.5", "context_length": "8192",
    "max_completion_tokens": "", "supports_logprobs": "True", "decision": "candidate", "reason": "candidate",
}  # fmt: skip
CELLS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", "None", "1", "-1", "1.5", "1e400", "x"]
)


def providers_csv(columns: list[str], rows: list[dict[str, str]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode("utf-8")


def check_providers(path: Path) -> list[ProviderRow] | None:
    try:
        rows = read_providers(path)
    except ConfigError as exc:
        assert_config_error(exc, str(path))
        return None
    assert all(isinstance(row, ProviderRow) and isinstance(row.context_length, int) for row in rows)
    return rows


def test_the_providers_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "providers.csv"
    path.write_bytes(providers_csv(list(PROVIDER_COLUMNS), [ROW, ROW]))
    rows = check_providers(path)
    assert rows is not None and len(rows) == 2


@MEDIUM
@given(
    columns=st.permutations(list(PROVIDER_COLUMNS)).flatmap(
        lambda cols: st.lists(st.sampled_from(cols), min_size=10, unique=True)
    )
    | st.permutations([*PROVIDER_COLUMNS, "extra"]),
    changes=st.lists(st.dictionaries(st.sampled_from(PROVIDER_COLUMNS), CELLS, max_size=3), max_size=3),
)
def test_providers_csv_with_wrong_columns_and_cell_types(
    scratch: Path, columns: list[str], changes: list[dict[str, str]]
) -> None:
    check_providers(scratch_file(scratch, ".csv", providers_csv(columns, [{**ROW, **change} for change in changes])))


@pytest.mark.parametrize("damage", ["truncated", "short row", "latin-1", "huge field", "directory"])
def test_bug_unreadable_providers_csv(tmp_path: Path, damage: str) -> None:
    good = providers_csv(list(PROVIDER_COLUMNS), [ROW, ROW])
    path = tmp_path / "providers.csv"
    if damage == "directory":
        path.mkdir()
    elif damage == "truncated":  # the last row loses its last columns: DictReader fills them with None
        path.write_bytes(good[: len(good) - 40])
    elif damage == "short row":
        path.write_bytes(good + b"Q,q/int4,int4\r\n")
    elif damage == "latin-1":
        path.write_bytes(good.replace(b"P,p/int4", "Pé,p/int4".encode("latin-1")))
    else:  # over csv's field size limit (131072 characters)
        path.write_bytes(providers_csv(list(PROVIDER_COLUMNS), [{**ROW, "price_note": "x" * 200_000}]))
    check_providers(path)


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-Infinity"])
def test_bug_non_finite_prices_in_providers_csv(tmp_path: Path, value: str) -> None:
    path = tmp_path / "providers.csv"
    path.write_bytes(providers_csv(list(PROVIDER_COLUMNS), [{**ROW, "prompt_usd_per_m": value}]))
    assert check_providers(path) is None  # refused, naming the file and line
