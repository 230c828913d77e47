"""Corrupted ``verdicts.json`` files load as valid verdicts or end as one ``ConfigError``
line naming the file."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.bad_inputs import MEDIUM, PLAIN_KEYS, assert_config_error, floats_in, json_values, mutations, scratch_file
from hypothesis import given
from hypothesis import strategies as st

from quanthunt.errors import ConfigError
from quanthunt.verdicts import Verdicts, load_verdicts

# -- 6. verdicts.json and providers.csv --------------------------------------------------------------------------------

VERDICTS: dict[str, Any] = {
    "model": "a/b", "reference_model": "a/b", "created_at": "2025-01-01T00:00:00Z", "params_sha256": "0" * 64,
    "alpha": 0.05, "correction": "holm", "probe_ids": ["p1", "p2"], "verification_run_id": None, "cost_usd": 0.25,
    "providers": [{
        "provider": "P", "tag": "p/int4", "declared_quantization": "int4", "survey_decision": "candidate", "eligible": True,
        "mode": "logprob", "verdict": "equivalent", "reason": "within margins",
        "tests": [{"name": "mean", "kind": "equivalence", "statistic": 1.5, "p_value": 0.01, "p_adjusted": 0.02, "null": "h0"}],
        "effects": {"mean_abs_dlogprob": {"value": 0.01, "ci_low": 0.0, "ci_high": 0.02}},
        "power": {"mean": 0.9}, "probes_needed": None, "probes": 10, "completions": 10, "failed_requests": 0,
        "errors": {"http_429": 1}, "tokens": 240, "served_by": {"P": 10}, "cost_usd": 0.25,
    }],
}  # fmt: skip


def check_verdicts(path: Path) -> Verdicts | None:
    try:
        verdicts = load_verdicts(path)
    except ConfigError as exc:
        assert_config_error(exc, str(path))
        return None
    assert all(math.isfinite(x) for x in floats_in(verdicts.model_dump()))
    return verdicts


def test_the_verdicts_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.json"
    path.write_text(json.dumps(VERDICTS))
    assert check_verdicts(path) is not None


@MEDIUM
@given(data=mutations(VERDICTS, json_values(), PLAIN_KEYS) | json_values(keys=PLAIN_KEYS), cut=st.none() | st.integers(0, 2000))
def test_corrupted_verdicts(scratch: Path, data: Any, cut: int | None) -> None:
    text = json.dumps(data)  # NaN and Infinity included: Python's json reads them back
    check_verdicts(scratch_file(scratch, ".json", text.encode()[:cut]))


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 100_000, None])
def test_bug_unreadable_verdicts(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "verdicts.json"
    path.mkdir() if content is None else path.write_bytes(content)
    check_verdicts(path)


def test_bug_verdicts_key_with_a_line_break(tmp_path: Path) -> None:
    data = copy.deepcopy(VERDICTS)
    data["providers"][0]["effects"]["bad\nkey"] = {"value": "not a number", "ci_low": 0, "ci_high": 1}
    path = tmp_path / "verdicts.json"
    path.write_text(json.dumps(data))
    check_verdicts(path)
