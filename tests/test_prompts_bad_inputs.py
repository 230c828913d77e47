"""Bad prompt files hunted with hypothesis: random bytes and random JSON lines load as usable
records or end as one ``ConfigError`` line naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.bad_inputs import FAST, MEDIUM, assert_config_error, json_values, scratch_file
from hypothesis import given
from hypothesis import strategies as st

from quanthunt.errors import ConfigError
from quanthunt.prompts import MAX_LINE_BYTES, PromptRecord, load_prompts, skeleton

# -- 5. prompt files ---------------------------------------------------------------------------------------------------

PROMPT_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "hi", "\ud800", "a\udfff", "\x00", "\u2028", "\ufeff"]))
ROLES = ["system", "developer", "user", "assistant", "human", "gpt", "tool", "wizard", "USER", None]
turns = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(ROLES) | json_values(),
        "from": st.sampled_from(ROLES) | json_values(),
        "content": PROMPT_TEXT
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": PROMPT_TEXT})),
        "value": PROMPT_TEXT | json_values(),
    },
)
records = st.fixed_dictionaries(
    {},
    optional={
        "id": st.none() | st.integers() | PROMPT_TEXT | st.sampled_from([True, 1.5, 10**5000, "a\tb"]),
        "messages": st.lists(turns, max_size=4) | json_values(),
        "conversations": st.lists(turns, max_size=4),
        "items": st.lists(turns, max_size=3),
        "extra": json_values(),
    },
)


@st.composite
def jsonl_files(draw: st.DrawFn) -> bytes:
    """JSON Lines of records and random JSON values, with BOMs, blank lines, CRLF, latin-1 and raw surrogates mixed in."""
    lines = []
    for value in draw(st.lists(records | json_values(keys=st.text(max_size=8), text=PROMPT_TEXT), min_size=1, max_size=5)):
        if isinstance(value, dict) and value.get("id") == 10**5000:
            line = json.dumps({**value, "id": 0}).replace('"id": 0', '"id": ' + "9" * 5000)
        else:
            line = json.dumps(value, ensure_ascii=draw(st.booleans()))
        encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "latin-1", "surrogate"]))
        raw = line.encode("utf-8", "surrogatepass") if encoding == "surrogate" else line.encode(encoding, "replace")
        lines.append(draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf", b"  "])) + raw)
    return draw(st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\r"])).join(lines) + draw(st.sampled_from([b"", b"\n"]))


def assert_usable_records(loaded: list[PromptRecord]) -> None:
    assert loaded and len({r.id for r in loaded}) == len(loaded)
    for record in loaded:
        assert record.id and record.id.isprintable()
        json.dumps(record.to_json(), ensure_ascii=False).encode("utf-8")  # what the generate stage writes
        assert skeleton(record)


def check_prompts(path: Path) -> list[PromptRecord] | None:
    try:
        loaded = load_prompts(path)
    except ConfigError as exc:
        assert_config_error(exc, str(path))
        return None
    assert_usable_records(loaded)
    return loaded


@FAST
@given(content=st.binary(max_size=400), suffix=st.sampled_from([".jsonl", ".json", ".parquet", ".txt", ""]))
def test_prompt_files_of_random_bytes(scratch: Path, content: bytes, suffix: str) -> None:
    check_prompts(scratch_file(scratch, suffix, content))


@MEDIUM
@given(content=jsonl_files())
def test_jsonl_of_random_values_loads_or_names_the_line(scratch: Path, content: bytes) -> None:
    check_prompts(scratch_file(scratch, ".jsonl", content))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"a\\nb": 1, "c\\u2028d": 2}', "keys: "),  # were joined raw: a two-line message
        ('{"id": ' + "9" * 5000 + ', "messages": [{"role": "user", "content": "hi"}]}', "too many digits"),  # was ValueError
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),  # was UnicodeEncodeError
        ('{"id": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "lone surrogate"),
        ("{" + ", ".join(f'"k{i}": {i}' for i in range(5000)) + "}", "(5000 keys)"),
    ],
)
def test_prompt_lines_fixed_here(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    message = assert_config_error(info.value, str(path))
    assert message.startswith(f"{path}:1: ") and expected in message, message


def test_crlf_line_at_the_limit_and_one_byte_over(tmp_path: Path) -> None:
    """The limit counts the line without its newline, "\\r\\n" as much as "\\n" (a CRLF line of exactly
    MAX_LINE_BYTES used to be refused)."""
    head, tail = b'{"messages": [{"role": "user", "content": "', b'"}]}'
    path = tmp_path / "long.jsonl"
    path.write_bytes(head + b"a" * (MAX_LINE_BYTES - len(head) - len(tail)) + tail + b"\r\n")
    assert len(load_prompts(path)[0].conversations[0].content) == MAX_LINE_BYTES - len(head) - len(tail)
    path.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\r\n' + head + b"a" * MAX_LINE_BYTES + tail + b"\r\n")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert assert_config_error(info.value, str(path)).startswith(f"{path}:2: line too long")
