"""pandera schemas for every artefact that crosses a stage boundary, named after it.

Validation is lazy (every failure is collected) and failures are reported as
(column, check, failing values) rather than a stack trace: see ``failures``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pandera.pandas as pa

from quanthunt.spec import QUANTIZATIONS

SHA256 = r"^[0-9a-f]{64}\Z"  # \Z: ``$`` would also match before a trailing newline
VERDICTS = ("equivalent", "different", "inconclusive")
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "eos", "error")


@dataclass(frozen=True)
class Failure:
    """One failed check: where, which check, and the first failing values (with record ids)."""

    column: str
    check: str
    count: int
    examples: list[str]

    def line(self) -> str:
        return f"{self.check} on {self.column}: {self.count} failing ({'; '.join(self.examples)})"


def failures(schema: pa.DataFrameSchema, frame: pd.DataFrame, *, id_column: str | None = None, first: int = 5) -> list[Failure]:
    """Validate ``frame`` lazily; the failures, grouped by column and check."""
    try:
        schema.validate(frame, lazy=True)
    except pa.errors.SchemaErrors as exc:
        cases = exc.failure_cases
        found = []
        for (column, check), group in cases.groupby(["column", "check"], dropna=False, sort=False):
            examples = []
            for _, row in group.head(first).iterrows():
                index = row.get("index")
                who = f"{frame.loc[index, id_column]}: " if id_column and index is not None and index in frame.index else ""
                examples.append(f"{who}{row['failure_case']!r}")
            found.append(Failure(str(column), str(check), len(group), examples))
        return found
    return []


providers_table = pa.DataFrameSchema(
    {
        "provider": pa.Column(str, pa.Check.str_length(min_value=1)),
        "tag": pa.Column(str, pa.Check.str_length(min_value=1), unique=True),
        "declared_quantization": pa.Column(str, pa.Check.isin(QUANTIZATIONS)),
        "prompt_usd_per_m": pa.Column(float, pa.Check.ge(0)),
        "completion_usd_per_m": pa.Column(float, pa.Check.ge(0)),
        "discount": pa.Column(float, pa.Check.in_range(0, 1)),
        "context_length": pa.Column(int, pa.Check.gt(0)),
        "supports_logprobs": pa.Column(bool),
        "decision": pa.Column(str, pa.Check.isin(("candidate", "excluded"))),
        "reason": pa.Column(str, pa.Check.str_matches(r"^(candidate|excluded: .+)\Z")),
    },
    name="providers_table",
    strict=False,
)
"""``reports/survey/providers.csv``."""

verdicts_table = pa.DataFrameSchema(
    {
        "provider": pa.Column(str),
        "tag": pa.Column(str, unique=True),
        "declared_quantization": pa.Column(str, pa.Check.isin(QUANTIZATIONS)),
        "verdict": pa.Column(str, pa.Check.isin(VERDICTS)),
        "mode": pa.Column(str, pa.Check.isin(("logprob", "sample"))),
        "eligible": pa.Column(bool),
        "completions": pa.Column(int, pa.Check.ge(0)),
        "cost_usd": pa.Column(float, pa.Check.ge(0)),
    },
    checks=[pa.Check(lambda df: ~df["eligible"] | (df["verdict"] == "equivalent"), name="eligible_only_if_equivalent")],
    name="verdicts_table",
)
"""``reports/verify/verdicts.json``, one row per provider."""

ledger_export = pa.DataFrameSchema(
    {
        "record_id": pa.Column(str, unique=True),
        "cost_usd": pa.Column(float, pa.Check.ge(0)),
        "line_sha256": pa.Column(str, pa.Check.str_matches(SHA256), nullable=True),
    },
    name="ledger_export",
)
"""The ledger's view of a dataset: settled cost and recorded line hash per record."""


def named(test: Any, name: str) -> pa.Check:
    """A vectorised check whose failures are reported under ``name``."""
    return pa.Check(test, name=name, error=name)


def generated_records(*, max_tokens: int, eligible: Iterable[tuple[str, str]], params_sha256: str) -> pa.DataFrameSchema:
    """``data/generated/<dataset>.jsonl`` (one row per record, flattened by the validator);
    ``eligible``: (endpoint tag, provider name) pairs."""
    allowed = set(eligible)
    return pa.DataFrameSchema(
        {
            "id": pa.Column(str, pa.Check.str_length(min_value=1), unique=True),
            "roles_ok": pa.Column(bool, named(lambda s: s, "roles_alternate_and_end_with_assistant")),
            "empty_assistant": pa.Column(bool, named(lambda s: ~s, "no_empty_assistant_content")),
            "endpoints": pa.Column(
                object,
                pa.Check(
                    lambda s: s.map(lambda p: bool(p) and set(p) <= allowed),
                    element_wise=False,
                    name="served_by_verified_equivalent_provider",
                ),
            ),
            "verdict": pa.Column(str, named(lambda s: s == "equivalent", "verdict_equivalent")),
            "cost_usd": pa.Column(float, named(lambda s: s >= 0, "cost_not_negative")),
            "prompt_tokens": pa.Column(int, named(lambda s: s >= 0, "prompt_tokens_not_negative")),
            "completion_tokens": pa.Column(int, named(lambda s: s >= 1, "has_output_tokens")),
            "max_turn_completion_tokens": pa.Column(int, named(lambda s: s <= max_tokens, f"within_max_tokens_{max_tokens}")),
            "finish_reason": pa.Column(str, pa.Check.isin(FINISH_REASONS)),
            "params_sha256": pa.Column(str, named(lambda s: s == params_sha256, "same_sampling_params")),
        },
        name="generated_records",
        strict=False,
    )


def frame(rows: list[dict[str, Any]], columns: Iterable[str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(columns))
