"""Reading the user's YAML files: every problem one ``ConfigError`` line naming the file and
the field. The ``*_bad_inputs.py`` suites fuzz the same functions through ``params.yaml``
and the roster; here each rule on a small model of its own, with the exact message."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from quanthunt.config_files import field_path, hide_userinfo, one_line, parse_yaml, read_text, validated
from quanthunt.errors import EXIT_BAD_INPUT, ConfigError


class Server(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(pattern=r"^https://")
    weight: float = Field(ge=0)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    servers: list[Server]
    labels: dict[str, int] = {}


GOOD: dict[str, Any] = {"name": "a", "servers": [{"url": "https://x.example/v1", "weight": 1.0}]}


def refusal(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        validated(Settings, data, source="settings.yaml")
    assert info.value.exit_code == EXIT_BAD_INPUT
    return str(info.value)


# -- one_line and field_path -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("plain", 10, "plain"),
        ("exactly10!", 10, "exactly10!"),
        ("one more char", 12, "one more ..."),
        ("two\nlines\r", 40, "two\\nlines\\r"),
        ("tab\tnul\x00 sep\u2028", 40, "tab\\tnul\\x00 sep\\u2028"),
        ("日本語 ☃", 10, "日本語 ☃"),  # printable: kept as it is
    ],
)
def test_one_line_escapes_breaks_and_cuts_to_the_limit(text: str, limit: int, expected: str) -> None:
    assert one_line(text, limit) == expected
    assert len(one_line(text, limit)) <= limit


def test_one_line_cuts_after_escaping_so_the_limit_holds_for_what_is_shown() -> None:
    shown = one_line("\n" * 50, 20)
    assert shown == "\\n" * 8 + "\\" + "..." and len(shown) == 20  # a cut may split an escape; never a real break


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        ((), "(top level)"),
        (("survey", "budget", "usd"), "survey.budget.usd"),
        (("datasets", 0), "datasets.0"),
        (("labels", "a.b"), "labels.'a.b'"),
        (("labels", " padded "), "labels.' padded '"),
        (("labels", ""), "labels.''"),
        (("labels", "a\nb"), "labels.'a\\nb'"),
        (("labels", "k" * 100), "labels." + "k" * 57 + "..."),
    ],
)
def test_field_path_quotes_only_keys_a_dotted_path_would_misread(loc: tuple[int | str, ...], expected: str) -> None:
    assert field_path(loc) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://user:pw@host/v1", "https://***@host/v1"),
        ("https://user:p/w?x#y@host/v1", "https://***@host/v1"),
        ("got 'http://a@b' and 'https://c:d@e'", "got 'http://***@b' and 'https://***@e'"),
        ("https://host/v1", "https://host/v1"),
        ("mail me at a@b.example", "mail me at a@b.example"),
    ],
)
def test_hide_userinfo_replaces_user_and_password_only(text: str, expected: str) -> None:
    assert hide_userinfo(text) == expected


# -- read_text and parse_yaml ------------------------------------------------------------


def test_read_text_names_a_missing_file_and_what_it_is(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    with pytest.raises(ConfigError, match=rf"^{path}: roster file not found$"):
        read_text(path, what="roster")


@pytest.mark.parametrize(("make", "cause"), [("folder", "IsADirectoryError"), ("latin-1", "UnicodeDecodeError")])
def test_read_text_names_why_a_file_cannot_be_read(tmp_path: Path, make: str, cause: str) -> None:
    path = tmp_path / "params.yaml"
    path.mkdir() if make == "folder" else path.write_bytes("name: café\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        read_text(path, what="params")
    assert str(info.value) == f"{path}: cannot read params ({cause})"


def test_read_text_with_a_nul_in_the_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot read params \(ValueError\)$"):
        read_text(Path("params\x00.yaml"), what="params")


def test_parse_yaml_names_the_line_of_a_syntax_error_without_quoting_it() -> None:
    text = "name: ok\nservers:\n  - url: [unclosed sk-or-v1-secret\n"
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, source="params.yaml", what="params")
    message = str(info.value)
    assert message.startswith("params.yaml: line ") and message.endswith(" is not valid YAML"), message
    assert "secret" not in message


def test_parse_yaml_refuses_nesting_too_deep_to_read() -> None:
    with pytest.raises(ConfigError, match=r"^roster.yaml: is not a valid roster \(nested too deeply\)$"):
        parse_yaml("[" * 5000 + "]" * 5000, source="roster.yaml", what="roster")


def test_parse_yaml_reads_plain_yaml_and_no_python_objects() -> None:
    assert parse_yaml("a: [1, 2.5, null]\n", source="s", what="w") == {"a": [1, 2.5, None]}
    with pytest.raises(ConfigError, match="is not valid YAML"):
        parse_yaml("!!python/object/apply:os.system ['true']", source="s", what="w")


# -- validated ---------------------------------------------------------------------------


def test_a_valid_document_comes_back_typed() -> None:
    settings = validated(Settings, GOOD, source="settings.yaml")
    assert settings.servers[0].weight == 1.0 and settings.labels == {}


def test_an_unknown_key_is_named_with_its_path_and_value() -> None:
    message = refusal({**GOOD, "servers": [{**GOOD["servers"][0], "wieght": 2}]})
    assert message == "settings.yaml: servers.0.wieght: unknown key (got 2)"


def test_a_missing_field_is_named_without_a_value() -> None:
    assert refusal({"servers": []}) == "settings.yaml: name: Field required"


def test_a_bad_value_shows_the_value_it_got() -> None:
    message = refusal({**GOOD, "servers": [{"url": "https://x.example", "weight": -1}]})
    assert message == "settings.yaml: servers.0.weight: Input should be greater than or equal to 0 (got -1)"


def test_nan_is_shown_as_nan() -> None:
    message = refusal({**GOOD, "servers": [{"url": "https://x.example", "weight": math.nan}]})
    assert message.startswith("settings.yaml: servers.0.weight: ") and message.endswith(" (got NaN)"), message


def test_a_url_value_and_the_message_quoting_it_hide_the_user_and_password() -> None:
    message = refusal({**GOOD, "servers": [{"url": "http://admin:hunter2@x.example/v1", "weight": 1}]})
    assert "hunter2" not in message and "admin" not in message
    assert message.endswith("(got 'http://***@x.example/v1')"), message


def test_a_list_or_mapping_value_is_not_dumped_into_the_message() -> None:
    message = refusal({**GOOD, "name": {"nested": ["x" * 500]}})
    assert message == "settings.yaml: name: Input should be a valid string"


def test_a_long_or_multi_line_value_is_one_short_line() -> None:
    message = refusal({**GOOD, "labels": {"k": "line one\nline two " + "x" * 500}})
    assert message.splitlines() == [message] and len(message) < 200
    assert message.startswith("settings.yaml: labels.k: Input should be a valid integer"), message


def test_a_document_that_is_not_a_mapping_is_named_at_the_top_level() -> None:
    assert refusal(["a", "b"]).startswith("settings.yaml: (top level): Input should be a valid dictionary")
