"""params.yaml: the shipped file is valid; bad values are one line naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from quanthunt.errors import ConfigError
from quanthunt.params import load_params, parse_params

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_shipped_params_are_valid() -> None:
    params = load_params(ROOT / "params.yaml")
    assert params.api.base_url == "sandbox" and params.uses_sandbox
    assert params.survey.budget.usd == 100


def with_change(path: str, value: Any) -> dict[str, Any]:
    data = shipped()
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


def test_dvc_exp_run_set_changes_only_the_line_it_sets(tmp_path: Path) -> None:
    """``dvc exp run -S`` rewrites params.yaml with DVC's round-trip YAML writer; the
    shipped file is written in that writer's form (e.g. null as an empty value), so an
    experiment's diff is the one value it sets, comments and layout kept."""
    from dvc.utils.serialize import modify_yaml

    copy = tmp_path / "params.yaml"
    copy.write_text((ROOT / "params.yaml").read_text())
    with modify_yaml(copy) as data:
        data["generate"]["sampling"]["temperature"] = 0.8
    before, after = (ROOT / "params.yaml").read_text().splitlines(), copy.read_text().splitlines()
    assert [(a, b) for a, b in zip(before, after, strict=True) if a != b] == [("    temperature: 0.7", "    temperature: 0.8")]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("survey.budget.usd", -5, "survey.budget.usd: Input should be greater than 0 (got -5)"),
        ("survey.budget.usd", float("nan"), "survey.budget.usd: Input should be a finite number (got NaN)"),
        ("survey.budget.usd", "lots", "survey.budget.usd: Input should be a valid number"),
        ("survey.policy.allowed_quantizations", ["int4", "int3"], "unknown quantization 'int3'"),
        ("survey.policy.colour", "red", "survey.policy.colour: unknown key"),
        ("surveyy", {}, "surveyy: unknown key"),
        ("reasoning.mode", "maybe", "reasoning.mode: Input should be 'none', 'off' or 'on'"),
        ("reasoning.template_kwargs", {"enable thinking": False}, "reasoning.template_kwargs: Value error, chat template"),
        (
            "reasoning.template_kwargs",
            {"thinking": float("inf")},
            "reasoning.template_kwargs: Value error, thinking must be plain JSON",
        ),
        ("api.base_url", "http://openrouter.ai/api/v1", "plain http is only allowed to a loopback host"),
        ("api.base_url", "ftp://example.com", "must be an http(s) URL"),
        ("api.base_url", "https://user:pw@openrouter.ai/api/v1", "must not carry credentials"),
        ("survey.model", "no-slash", "survey.model: String should match pattern"),
        ("verify.probes.prompts", 1, "verify.probes.prompts: Input should be greater than or equal to 2"),
        ("verify.probes.temperature", 0.7, "verify.probes.temperature: Value error, must be 1.0: the sampler check"),
        ("verify.probes.max_tokens", 32, "probes.max_tokens 32 is shorter than the 64 tokens decision.mixture_detection_*"),
        ("verify.max_probes_per_provider", 4, "max_probes_per_provider must be at least probes.prompts (one round)"),
        ("verify.margin.sampler_equivalence", 0.01, "sampler_equivalence must be at least sampler_shift"),
    ],
)
def test_bad_params_name_the_field(path: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_params(with_change(path, value), source="params.yaml")
    text = str(info.value)
    assert text.startswith("params.yaml: ")
    assert message in text
    assert "\n" not in text


def test_loopback_http_and_https_are_accepted() -> None:
    assert parse_params(with_change("api.base_url", "http://127.0.0.1:8765/api/v1/"), source="p").api.base_url.endswith("/api/v1")
    assert parse_params(with_change("api.base_url", "https://openrouter.ai/api/v1"), source="p").api.base_url


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "missing.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("survey: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params.yaml: line \d+ is not valid YAML"):
        load_params(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_params(bad)
