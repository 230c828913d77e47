"""Prompt datasets: the shipped samples, both input forms, stable ids, every bad-input error, Parquet, regeneration."""

from __future__ import annotations

import hashlib
import json
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quanthunt.errors import ConfigError, QuanthuntError
from quanthunt.prompts import (
    MAX_LINE_BYTES,
    PromptRecord,
    RecordError,
    Turn,
    content_id,
    count_prompts,
    iter_jsonl,
    iter_prompts,
    load_prompts,
    next_request,
    parse_record,
    skeleton,
    with_replies,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "prompts"
SHIPPED = ["chat.jsonl", "multiturn.jsonl", "code.jsonl", "math.jsonl", "reasoning.jsonl", "multilingual.jsonl"]

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "What is 2 + 2?"},
    ]
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
}
TURNS = (Turn("system", "Be brief."), Turn("user", "Hi there"), Turn("assistant", "Hello!"), Turn("user", "What is 2 + 2?"))


def write_jsonl(path: Path, *records: Any) -> Path:
    """Write records (dicts become JSON, strings are written as the line itself) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def user(text: str = "hello") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_prompts(path)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(str(path)), message
    assert caught.value.exit_code == 2
    return message


# -- shipped datasets ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_dataset_loads(name: str) -> None:
    records = load_prompts(DATA / name)
    assert len(records) == 50
    assert len({r.id for r in records}) == 50
    for record in records:
        assert any(t.role == "user" and t.content.strip() for t in record.conversations), record.id
        assert skeleton(record), record.id


def test_shipped_datasets_exercise_both_forms_and_hash_ids() -> None:
    forms: set[str] = set()
    without_id = with_system = 0
    for name in SHIPPED:
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            key = "messages" if "messages" in obj else "conversations"
            forms.add("sharegpt" if "from" in obj[key][0] else "openai")
            without_id += "id" not in obj
            with_system += any(e.get("from", e.get("role")) == "system" for e in obj[key])
    assert forms == {"sharegpt", "openai"}
    assert without_id >= 1
    assert with_system >= 3
    multiturn = load_prompts(DATA / "multiturn.jsonl")
    assert {len(skeleton(r)) for r in multiturn} == {2, 3}
    assert all(any(t.role == "assistant" for t in r.conversations) for r in multiturn)


def test_ids_are_stable_across_loads() -> None:
    first = load_prompts(DATA / "math.jsonl")
    second = load_prompts(DATA / "math.jsonl")
    assert first == second
    hashed = [r.id for r in first if r.id.startswith("h-")]
    assert len(hashed) >= 1
    assert [r.id for r in first] == [r.id for r in second]


def test_content_id_is_pinned() -> None:
    """The hash is of the canonical JSON; pinning it catches any change that would re-id existing datasets."""
    canonical = json.dumps([t.to_json() for t in TURNS], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = "h-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert content_id(TURNS) == expected == "h-74ffec0bd0b98b5a"


# -- forms -----------------------------------------------------------------------------------------------------------


def test_sharegpt_and_openai_forms_normalise_to_the_same_record(tmp_path: Path) -> None:
    role_content_under_conversations = {"conversations": OPENAI["messages"]}
    parts = {"messages": [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in OPENAI["messages"]]}
    items = {"items": SHAREGPT["conversations"]}
    developer = {"messages": [dict(OPENAI["messages"][0], role="developer"), *OPENAI["messages"][1:]]}
    path = tmp_path / "forms.jsonl"
    variants = [SHAREGPT, OPENAI, role_content_under_conversations, parts, items, developer]
    records = []
    for variant in variants:
        write_jsonl(path, variant)
        records.append(load_prompts(path)[0])
    assert records[0].conversations == TURNS
    assert records[0].id == content_id(TURNS)
    assert all(record == records[0] for record in records)


def test_speaker_aliases_and_content_parts() -> None:
    conv = [
        {"from": speaker, "value": "x"} for speaker in ("user", "chatgpt", "human", "bing", "human", "bard", "human", "model")
    ]
    record = parse_record({"conversations": conv})
    assert [t.role for t in record.conversations] == ["user", "assistant"] * 4
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert parse_record({"messages": [{"role": "user", "content": parts}]}).conversations == (Turn("user", "one\ntwo"),)


def test_given_ids_int_and_string(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "ids.jsonl", {"id": 7, **user("a")}, {"id": "seven", **user("b")}, {"id": None, **user("c")})
    assert [r.id for r in load_prompts(path)] == ["7", "seven", content_id([Turn("user", "c")])]


def test_to_json_loads_back_to_the_same_record(tmp_path: Path) -> None:
    record = PromptRecord.of(TURNS, "r1")
    assert record.to_json() == {"id": "r1", "conversations": [t.to_json() for t in TURNS]}
    assert load_prompts(write_jsonl(tmp_path / "back.jsonl", record.to_json())) == [record]


def test_blank_lines_and_bom_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(user("a")).encode() + b"\n\n   \r\n" + json.dumps(user("b")).encode())
    assert [r.conversations[0].content for r in load_prompts(path)] == ["a", "b"]


# -- errors ----------------------------------------------------------------------------------------------------------

OK = json.dumps({"id": "ok", **user()})

BAD_LINES: list[tuple[str, str, str]] = [
    ("not-json", '{"id": "x", "messages": [}', "not valid JSON"),
    ("truncated", '{"id": "x"', "not valid JSON (Expecting ',' delimiter at column 11)"),
    ("a list", "[1, 2]", "expected a JSON object"),
    ("a number", "42", "expected a JSON object"),
    ("no conversation", '{"id": "x", "prompt": "hi"}', "no conversation"),
    ("two conversations", json.dumps({**SHAREGPT, **OPENAI}), "both 'conversations' and 'messages'"),
    ("not a list", '{"messages": "hi"}', "messages: expected a list"),
    ("empty list", '{"messages": []}', "messages: empty"),
    ("entry not object", '{"messages": ["hi"]}', "messages[0]: expected an object"),
    ("unknown from", '{"conversations": [{"from": "wizard", "value": "hi"}]}', "conversations[0].from: unknown speaker 'wizard'"),
    ("unknown role", '{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role: unknown role 'wizard'"),
    ("role in items", '{"items": [{"role": "user", "content": "hi"}]}', "items[0]: uses 'role'"),
    ("tool role", json.dumps({"messages": [*user()["messages"], {"role": "tool", "content": "42"}]}), "messages[1].role: 'tool'"),
    ("from and role", '{"conversations": [{"from": "human", "role": "user", "value": "hi"}]}', "has both 'from' and 'role'"),
    ("neither form", '{"conversations": [{"speaker": "human", "text": "hi"}]}', "conversations[0]: expected 'from'"),
    (
        "mixed forms",
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "conversations[1]: uses 'role'",
    ),
    ("missing from", '{"conversations": [{"value": "hi"}, {"from": "human", "value": "hi"}]}', "conversations[0]: expected"),
    ("missing value", '{"conversations": [{"from": "human"}]}', "conversations[0].value: missing"),
    ("content number", '{"messages": [{"role": "user", "content": 5}]}', "messages[0].content: expected a string, got a number"),
    ("image part", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content[0]: only text"),
    ("no user turn", '{"messages": [{"role": "system", "content": "be nice"}]}', "no user turn"),
    ("starts with assistant", '{"messages": [{"role": "assistant", "content": "hi"}]}', "messages[0]: starts with an assistant"),
    (
        "assistant after system",
        json.dumps(
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}, *user()["messages"]]}
        ),
        "messages[1]: starts with an assistant",
    ),
    (
        "two replies",
        json.dumps(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "b"}]}
        ),
        "conversations[2]: assistant turn with no user turn since",
    ),
    (
        "trailing system",
        json.dumps(
            {"messages": [*user()["messages"], {"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}]}
        ),
        "messages[2]: system turn after the last assistant turn",
    ),
    ("empty user", '{"messages": [{"role": "user", "content": "  "}]}', "messages[0]: empty user message"),
    ("empty id", json.dumps({"id": "", **user()}), "id: empty"),
    ("float id", json.dumps({"id": 1.5, **user()}), "id: expected a string or an integer, got a number"),
    ("bool id", json.dumps({"id": True, **user()}), "id: expected a string or an integer, got a boolean"),
    ("control id", json.dumps({"id": "a\tb", **user()}), "has control or separator characters"),
    ("duplicate id", json.dumps({"id": "ok", **user("other")}), "duplicate id 'ok' (first on line 1)"),
    ("duplicate content", json.dumps(user()), "duplicate conversation (same as line 2"),
]


@pytest.mark.parametrize(("line", "expected"), [pytest.param(line, exp, id=name) for name, line, exp in BAD_LINES])
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", OK, json.dumps(user()), "", line, OK.replace("ok", "after"))
    message = load_error(path)
    assert message.startswith(f"{path}:4: "), message
    assert expected in message, message


@pytest.mark.parametrize(("line", "expected"), [pytest.param(line, exp, id=name) for name, line, exp in BAD_LINES])
def test_count_prompts_refuses_what_load_prompts_refuses(tmp_path: Path, line: str, expected: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", OK, json.dumps(user()), "", line, OK.replace("ok", "after"))
    with pytest.raises(ConfigError) as caught:
        count_prompts(path)
    assert str(caught.value) == load_error(path)  # the same message, duplicates named with both lines


def test_count_prompts_checks_and_counts_only_up_to_the_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", OK, json.dumps(user("b")), json.dumps({"id": "ok", **user("c")}))
    assert count_prompts(path, limit=2) == 2  # the duplicate comes after the records used
    with pytest.raises(ConfigError, match=r"p.jsonl:3: duplicate id 'ok' \(first on line 1\)"):
        count_prompts(path)


def test_streaming_without_the_id_check_yields_duplicates(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", OK, json.dumps({"id": "ok", **user("again")}))
    assert [r.id for r in iter_prompts(path, unique_ids=False)] == ["ok", "ok"]
    with pytest.raises(ConfigError, match="duplicate id"):
        list(iter_prompts(path))


def test_count_prompts_does_not_hold_the_ids(tmp_path: Path) -> None:
    # 30,000 ids held in a dict (as the streaming check does) take ~4.5 MB; their hashes 0.24 MB.
    path = tmp_path / "big.jsonl"
    path.write_text("".join(f'{{"id": "record-{i:08d}", "messages": [{{"role": "user", "content": "q"}}]}}\n'
                            for i in range(30_000)))  # fmt: skip
    tracemalloc.start()
    try:
        assert count_prompts(path) == 30_000
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert sum(1 for _ in iter_prompts(path)) == 30_000
        _, peak_checking_while_streaming = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5e6, peak
    assert peak_checking_while_streaming > 2.5e6  # the comparison would show nothing if this held no ids either


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.jsonl", None, "no such file"),
        ("empty.jsonl", "", "has no prompt records"),
        ("blank.jsonl", "\n  \n\n", "has no prompt records"),
        ("prompts.csv", "id,prompt\n", "unsupported prompt file type '.csv'"),
        ("prompts", "x", "unsupported prompt file type (no suffix)"),
        ("array.json", '[{"messages": [{"role": "user", "content": "hi"}]}]', "looks like a JSON array"),
        ("multiline-array.json", '[\n  {"messages": []}\n]', "looks like a JSON array"),
    ],
)
def test_bad_file(tmp_path: Path, name: str, content: str | None, expected: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert expected in load_error(path)


def test_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dir.jsonl"
    path.mkdir()
    assert "is a directory" in load_error(path)


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(OK.encode() + b"\n" + '{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    message = load_error(path)
    assert message.startswith(f"{path}:2: not UTF-8 text"), message
    assert "0xe9" in message


def test_line_at_the_limit_loads_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    def line_of(size: int) -> bytes:
        head, tail = b'{"messages": [{"role": "user", "content": "', b'"}]}'
        return head + b"a" * (size - len(head) - len(tail)) + tail

    fits = tmp_path / "fits.jsonl"
    fits.write_bytes(OK.encode() + b"\n" + line_of(MAX_LINE_BYTES) + b"\n")
    assert len(load_prompts(fits)[1].conversations[0].content) > MAX_LINE_BYTES - 100

    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(OK.encode() + b"\n" + line_of(MAX_LINE_BYTES + 1) + b"\n" + OK.encode() + b"\n")
    message = load_error(huge)
    assert message.startswith(f"{huge}:2: line too long"), message
    assert len(message) < 200


def test_iter_jsonl_streams(tmp_path: Path) -> None:
    """Records come one by one: the first is yielded before the bad second line is read."""
    path = write_jsonl(tmp_path / "stream.jsonl", OK, "{oops")
    records = iter_jsonl(path)
    assert next(records).id == "ok"
    with pytest.raises(ConfigError, match=r":2: not valid JSON"):
        next(records)


def test_config_error_is_a_quanthunt_error(tmp_path: Path) -> None:
    with pytest.raises(QuanthuntError):
        load_prompts(tmp_path / "nope.jsonl")


# -- Parquet ---------------------------------------------------------------------------------------------------------


def test_parquet_round_trip(tmp_path: Path) -> None:
    for name in ("multiturn.jsonl", "math.jsonl"):
        raw = [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]
        table = pa.Table.from_pylist(raw)
        path = tmp_path / name.replace(".jsonl", ".parquet")
        pq.write_table(table, path, row_group_size=7)
        assert load_prompts(path) == load_prompts(DATA / name)


def test_parquet_of_normalised_records_and_extra_columns(tmp_path: Path) -> None:
    records = [PromptRecord.of(TURNS, "a"), PromptRecord.of((Turn("user", "solo"),))]
    rows = [{**r.to_json(), "source": "test"} for r in records]
    rows[1]["id"] = None
    path = tmp_path / "normalised.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert list(iter_prompts(path)) == records


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([user(), {"messages": [{"role": "wizard", "content": "x"}]}], "row 2: messages[0].role: unknown role 'wizard'"),
        ([{"id": "x", **user("a")}, {"id": "x", **user("b")}], "row 2: duplicate id 'x' (first on row 1)"),
        ([{"id": "x", "prompt": "hi"}], "no 'conversations', 'messages', 'items' column"),
    ],
)
def test_parquet_errors_name_the_row(tmp_path: Path, rows: list[dict[str, Any]], expected: str) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    message = load_error(path)
    assert expected in message
    with pytest.raises(ConfigError) as caught:
        count_prompts(path)
    assert str(caught.value) == message


def test_parquet_empty_and_not_parquet(tmp_path: Path) -> None:
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(user()["messages"][:0], schema=pa.schema([("messages", pa.string())])), empty)
    assert "has no prompt records" in load_error(empty)
    fake = tmp_path / "fake.parquet"
    fake.write_text(OK, encoding="utf-8")
    assert "not a readable Parquet file" in load_error(fake)


# -- regeneration ----------------------------------------------------------------------------------------------------

THREE_TURNS = PromptRecord.of(
    (
        Turn("system", "You are terse."),
        Turn("user", "u1"),
        Turn("assistant", "a1"),
        Turn("user", "u2"),
        Turn("assistant", "a2"),
        Turn("user", "u3"),
        Turn("assistant", "a3"),
    ),
    "three",
)


def test_skeleton_of_three_turns_with_system() -> None:
    system, u1, _, u2, _, u3, _ = THREE_TURNS.conversations
    assert skeleton(THREE_TURNS) == ((system, u1), (u2,), (u3,))
    assert all(t.role != "assistant" for segment in skeleton(THREE_TURNS) for t in segment)


def test_regeneration_splices_new_replies() -> None:
    system, u1, _, u2, _, u3, _ = THREE_TURNS.conversations
    assert next_request(THREE_TURNS, []) == [system, u1]
    assert next_request(THREE_TURNS, ["r1"]) == [system, u1, Turn("assistant", "r1"), u2]
    assert next_request(THREE_TURNS, ["r1", "r2"]) == [system, u1, Turn("assistant", "r1"), u2, Turn("assistant", "r2"), u3]
    replies: list[str] = []
    for _ in skeleton(THREE_TURNS):
        replies.append(f"new reply to {next_request(THREE_TURNS, replies)[-1].content}")
    regenerated = with_replies(THREE_TURNS, replies)
    assert regenerated.id == THREE_TURNS.id
    assert [t.content for t in regenerated.conversations] == [
        "You are terse.", "u1", "new reply to u1", "u2", "new reply to u2", "u3", "new reply to u3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="all 3 are given"):
        next_request(THREE_TURNS, replies)
    with pytest.raises(ValueError, match="needs 3 replies, got 2"):
        with_replies(THREE_TURNS, replies[:2])
    with pytest.raises(TypeError):
        with_replies(THREE_TURNS, "abc")


def test_skeleton_of_conversation_ending_with_user_turns() -> None:
    record = PromptRecord.of((Turn("user", "a"), Turn("assistant", "b"), Turn("user", "c"), Turn("user", "d")))
    assert skeleton(record) == ((Turn("user", "a"),), (Turn("user", "c"), Turn("user", "d")))


def test_skeleton_refuses_a_hand_made_invalid_record() -> None:
    with pytest.raises(RecordError, match="starts with an assistant"):
        skeleton(PromptRecord("x", (Turn("assistant", "hi"), Turn("user", "q"))))


# -- property ----------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=200).filter(lambda s: s.strip() != ""))
def test_any_user_text_round_trips_with_a_stable_id(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        openai_path, sharegpt_path = Path(tmp) / "openai.jsonl", Path(tmp) / "sharegpt.jsonl"
        with openai_path.open("w", encoding="utf-8", newline="") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False) + "\n")
        with sharegpt_path.open("w", encoding="utf-8", newline="") as f:
            f.write(json.dumps({"conversations": [{"from": "human", "value": text}]}, ensure_ascii=True) + "\n")
        (first,) = load_prompts(openai_path)
        (again,) = load_prompts(openai_path)
        (other_form,) = load_prompts(sharegpt_path)
    assert first.conversations == (Turn("user", text),)
    assert first == again == other_form
    canonical = json.dumps([{"content": text, "role": "user"}], separators=(",", ":"), ensure_ascii=False)
    assert first.id == "h-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
