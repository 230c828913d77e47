"""Bad params hunted with hypothesis: mutated ``params.yaml`` documents, files of random
bytes, and specific bad values; each parses into params the stages can use or ends as one
``ConfigError`` line naming the file and the field."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fixtures.bad_inputs import (
    FAST,
    PARAMS,
    PARAMS_TEXT,
    PLAIN_KEYS,
    THOROUGH,
    Path_,
    assert_config_error,
    assert_names_a_field,
    every_path,
    floats_in,
    ints_in,
    json_values,
    lookup,
    mutations,
    scratch_file,
)
from hypothesis import given
from hypothesis import strategies as st

from quanthunt.errors import ConfigError
from quanthunt.params import Params, load_params, parse_params
from quanthunt.spec import QUANTIZATIONS
from quanthunt.survey import ProviderRow, plan_budget
from quanthunt.urls import check_base_url, is_loopback

# -- 1. params.yaml mutations ------------------------------------------------------------------------------------------

CHEAP = ProviderRow(
    "Cheap", "cheap/int4", "int4", 0.000001, 0.000001, 0.0, "", 0, 99.0, 8192, None, True, "candidate", "candidate"
)
DEAR = ProviderRow("Dear", "dear/int4", "int4", 1e6, 1e6, 0.0, "", 0, 99.0, 8192, None, True, "candidate", "candidate")


def assert_usable_params(params: Params) -> None:
    """What the stages rely on in accepted params: finite numbers, paths and URLs they can open, plannable budgets."""
    dumped = params.model_dump(by_alias=True)
    assert all(math.isfinite(x) for x in floats_in(dumped)), dumped
    assert all(abs(n) < 2**63 for n in ints_in(dumped)), "an integer does not fit in 64 bits"
    for name, path in params.paths.model_dump().items():
        assert path and "\x00" not in path, f"paths.{name} = {path!r}"
    assert params.sandbox.roster is None or (params.sandbox.roster and "\x00" not in params.sandbox.roster)
    for url in (params.api.base_url, params.reference.base_url):
        if url != "sandbox":
            parts = urlsplit(check_base_url(url))
            assert parts.scheme == "https" or is_loopback(parts.hostname or ""), url
            assert parts.username is None and parts.password is None, url
            _ = parts.port
            httpx.URL(url)
    names = params.datasets
    assert len(set(names)) == len(names) and all(n and "/" not in n and "\x00" not in n and n[0] != "." for n in names)
    assert set(params.survey.policy.allowed_quantizations) <= set(QUANTIZATIONS)
    assert set(params.generate.quantizations or ()) <= set(QUANTIZATIONS)
    assert params.verify.decision.correction in ("holm", "bh")
    plan = plan_budget([CHEAP, DEAR], params.survey.budget, params.verify)
    json.dumps(plan, allow_nan=False)


def check_params(data: Any, source: str = "params.yaml") -> Params | None:
    try:
        params = parse_params(data, source=source)
    except ConfigError as exc:
        assert_names_a_field(assert_config_error(exc, source), source, data)
        return None
    assert isinstance(params, Params)
    assert_usable_params(params)
    return params


def test_the_shipped_params_pass_the_checks() -> None:
    assert check_params(copy.deepcopy(PARAMS)) is not None


@THOROUGH
@given(mutations(PARAMS, json_values(), PLAIN_KEYS))
def test_mutated_params_parse_or_name_the_field(data: Any) -> None:
    check_params(data)


FREE_FORM: set[Path_] = {("reasoning", "template_kwargs")}
"""Maps whose keys are the user's (a chat template's arguments), not the schema's."""
SECTIONS = [(), *(p for p in every_path(PARAMS) if isinstance(lookup(PARAMS, p), dict) and p not in FREE_FORM)]


@FAST
@given(st.sampled_from(SECTIONS), st.text(max_size=30))
def test_keys_of_any_text_are_named_on_one_line(where: Path_, key: str) -> None:
    data = copy.deepcopy(PARAMS)
    section = lookup(data, where)
    known = key in section
    section[key] = 1
    try:
        params = parse_params(data, source="p.yaml")
    except ConfigError as exc:
        message = assert_config_error(exc, "p.yaml")
        # an unknown key is named as it is, or quoted when empty, padded, dotted or unprintable
        assert known or f".{key}: " in message or f" {key}: " in message or repr(key)[:40] in message, message
    else:
        assert known, f"unknown key {key!r} accepted"
        assert_usable_params(params)


def check_load_params(path: Path) -> Params | None:
    try:
        params = load_params(path)
    except ConfigError as exc:
        assert_config_error(exc, str(path))
        return None
    assert_usable_params(params)
    return params


@FAST
@given(content=st.binary(max_size=400))
def test_params_files_of_random_bytes(scratch: Path, content: bytes) -> None:
    check_load_params(scratch_file(scratch, ".yaml", content))


@FAST
@given(cut=st.integers(0, len(PARAMS_TEXT.encode())), junk=st.sampled_from([b"", b"\n", b"[", b"{", b":", b"- ", b"\t", b"'"]))
def test_truncated_params_files(scratch: Path, cut: int, junk: bytes) -> None:
    params = check_load_params(scratch_file(scratch, ".yaml", PARAMS_TEXT.encode()[:cut] + junk))
    if cut == len(PARAMS_TEXT.encode()) and junk in (b"", b"\n"):
        assert params is not None


@FAST
@given(at=st.integers(0, len(PARAMS_TEXT.encode())), char=st.characters(min_codepoint=0x80, max_codepoint=0xFF))
def test_latin1_bytes_in_params_are_refused(scratch: Path, at: int, char: str) -> None:
    raw = PARAMS_TEXT.encode()
    path = scratch_file(scratch, ".yaml", raw[:at] + char.encode("latin-1") + raw[at:])
    with pytest.raises(ConfigError) as info:
        load_params(path)
    assert "cannot read params" in assert_config_error(info.value, str(path))


@pytest.mark.parametrize("text", ["a: " + "[" * 1_000, "a: " + "{a: " * 5_000, "- " * 5_000 + "x"])
def test_deeply_nested_params_yaml(tmp_path: Path, text: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_params(path)
    assert_config_error(info.value, str(path))


# -- 2. specific params values -----------------------------------------------------------------------------------------


def with_value(dotted: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(PARAMS)
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return data


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("survey.budget.usd", math.nan),
        ("survey.budget.usd", math.inf),
        ("survey.budget.usd", -math.inf),
        ("survey.budget.usd", -1),
        ("survey.budget.usd", 0),
        ("survey.budget.usd", 1e308),  # finite, but the survey's plan overflowed on it
        ("survey.budget.output_tokens_per_dataset", 10**400),  # OverflowError in the survey's plan before the fix
        ("survey.budget.datasets", 2**64),
        ("verify.probes.mean_prompt_tokens", 10**400),
        ("survey.budget.input_tokens_per_output_token", -0.5),
        ("survey.policy.max_prompt_usd_per_m", -0.01),
        ("survey.policy.max_completion_usd_per_m", -1),
        ("survey.policy.max_completion_usd_per_m", math.nan),
        ("verify.max_cost_usd", -1.0),
        ("generate.max_usd_per_run", 0),
        ("generate.max_usd_per_run", math.inf),
        ("survey.policy.allowed_quantizations", ["int4", "int3"]),
        ("survey.policy.allowed_quantizations", ["INT4"]),
        ("survey.policy.allowed_quantizations", [""]),
        ("survey.policy.allowed_quantizations", "int4"),
        ("generate.quantizations", ["fp5"]),
        ("generate.quantizations", ["bf16", None]),
        ("api.base_url", "http://example.com/api/v1"),
        ("api.base_url", "http://openrouter.ai/api/v1"),
        ("api.base_url", "http://10.0.0.1:8000/v1"),
        ("api.base_url", "http://0.0.0.0:8765/api/v1"),
        ("api.base_url", "http://localhost.example.com/v1"),
        ("api.base_url", "http://127.0.0.1@example.com/v1"),
        ("reference.base_url", "http://192.168.1.5:8000/v1"),
        ("api.base_url", "https://user:secret@openrouter.ai/api/v1"),
        ("api.base_url", "https://sk-or-v1-abc@openrouter.ai/api/v1"),
        ("reference.base_url", "http://user:pw@127.0.0.1:8000/v1"),
        ("api.base_url", "ftp://openrouter.ai"),
        ("api.base_url", "openrouter.ai/api/v1"),
        ("api.base_url", ""),
        ("api.base_url", "http://127.0.0.1:abc/v1"),  # httpx.InvalidURL at the first request before the fix
        ("api.base_url", "http://127.0.0.1:99999/v1"),
        ("reference.base_url", "https://example.com/\x00"),
        ("datasets", ["chat", "a/b"]),
        ("datasets", ["chat", "chat"]),
        ("datasets", [""]),
        ("datasets", [".hidden"]),
        ("datasets", ["a\x00b"]),
        ("datasets", []),
        ("datasets", "chat"),
        ("verify.decision.correction", "bonferroni"),
        ("verify.decision.correction", "HOLM"),
        ("verify.decision.correction", None),
        ("paths.locks", ""),
        ("paths.locks", "state/\x00locks"),
        ("ledger.url", ""),
        ("ledger.url", "state/ledger.sqlite"),
        ("ledger.url", "sqlite://"),
        ("ledger.url", "sqlite:///"),
        ("ledger.url", "sqlite:///state/\x00ledger.sqlite"),
        ("ledger.url", "mysql://db/ledger"),
        ("ledger.url", "postgresql://quanthunt:hunter2@db/ledger"),
        ("sandbox.roster", "roster\x00.yaml"),
        ("calibrate.controls", {"Box": "reference"}),
        ("calibrate.controls", {"box": "http://10.0.0.7:8000/v1"}),
        ("calibrate.controls", {"box": "sandbox:FP8"}),
        ("calibrate.controls", {"box": "https://user:pw@box.example/v1"}),
        ("calibrate.controls", ["reference"]),
        ("calibrate.coarse", "sandbox:"),
        ("calibrate.coarse", "ftp://box.example/v1"),
        ("calibrate.confidence", 0.5),
        ("calibrate.completions_per_prompt", 0),
    ],
)
def test_specific_bad_params_are_refused(field: str, value: Any) -> None:
    data = with_value(field, value)
    with pytest.raises(ConfigError) as info:
        parse_params(data, source="params.yaml")
    message = assert_config_error(info.value, "params.yaml")
    assert message.startswith(f"params.yaml: {field}"), message
    assert_names_a_field(message, "params.yaml", data)


@pytest.mark.parametrize(
    "url",
    [
        "https://user:hunter2hunter2@openrouter.ai/api/v1",
        "https://sk-or-" + "v1-0123456789abcdef0123@openrouter.ai/api/v1",  # a fake key as user name
        "http://admin:hunter2hunter2@127.0.0.1:8000/v1",
        "ftp://user:hunter2hunter2@openrouter.ai/api/v1",
        "https://user:hunter2hunter2@[::1/v1",
    ],
)
def test_base_urls_with_credentials_are_refused_without_echoing_them(url: str) -> None:
    """Fixed here: the message quoted the whole URL, password included."""
    with pytest.raises(ConfigError) as info:
        parse_params(with_value("api.base_url", url), source="params.yaml")
    message = assert_config_error(info.value, "params.yaml")
    assert "hunter2" not in message and "sk-or-v1-0123" not in message, message


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8765/api/v1",
        "http://127.0.0.1/v1/",
        "http://127.0.0.2:9000/v1",
        "http://localhost:8000/v1",
        "http://LOCALHOST:8000/v1",
        "http://[::1]:8000/v1",
        "https://openrouter.ai/api/v1",
        "sandbox",
    ],
)
@pytest.mark.parametrize("field", ["api.base_url", "reference.base_url"])
def test_loopback_http_and_https_base_urls_are_accepted(field: str, url: str) -> None:
    params = check_params(with_value(field, url))
    assert params is not None
    section = params.api if field == "api.base_url" else params.reference
    assert section.base_url == (url if url == "sandbox" else url.rstrip("/"))


def test_a_ledger_password_in_params_is_refused_without_repeating_it() -> None:
    data = with_value("ledger.url", "postgresql://quanthunt:hunter2@db.internal:5432/ledger")
    with pytest.raises(ConfigError) as info:
        parse_params(data, source="params.yaml")
    message = assert_config_error(info.value, "params.yaml")
    assert "QUANTHUNT_LEDGER_URL" in message and "hunter2" not in message, message
