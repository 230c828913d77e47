"""Prompt datasets: JSON Lines or Parquet files of conversations, read into one normalised form.

Each record is one conversation, in either of two forms (in JSON Lines, one object per line):

- ShareGPT: ``{"id": "a1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}``;
  ``items`` may stand for ``conversations``; speakers human/user, gpt/chatgpt/bing/bard/model/assistant and system.
- OpenAI: ``{"id": "a1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}``;
  roles system, developer (read as system), user and assistant; ``content`` is a string or a list of text parts
  (``{"type": "text", "text": ...}``, joined with newlines as vLLM does).

``messages`` is always OpenAI form and ``items`` always ShareGPT form. ``conversations`` is read as ShareGPT when its
first entry has ``from`` and as OpenAI when it has ``role`` (both or neither is an error); every entry must then use
that form. A record has exactly one of the three keys; other keys (and other Parquet columns) are ignored, and a key or
field whose value is null counts as absent.

Every record normalises to a :class:`PromptRecord` of :class:`Turn` (roles ``system``, ``user``, ``assistant``; the
text unchanged). A conversation needs a user turn; after any system turns it starts with a user turn; every assistant
turn answers at least one user turn since the previous assistant turn; a user turn is not empty. The id is the
record's ``id`` (a non-empty string, or an integer written in decimal), unique in the file; without one it is
:func:`content_id` of the conversation, so the same conversation gets the same id on every run and machine.

Bad input raises :class:`~quanthunt.errors.ConfigError` with one line that starts with the file and names the line
(``prompts.jsonl:7: ...``) or the Parquet row (``prompts.parquet: row 7: ...``, counted from 1).

Usage::

    records = load_prompts(Path("data/prompts/chat.jsonl"))  # .jsonl, .json (JSON Lines too) or .parquet
    total = count_prompts(Path("big.parquet"))  # checks the whole file in 8 bytes a record...
    for record in iter_prompts(Path("big.parquet"), unique_ids=False): ...  # ...then streams it in flat memory
    # regenerate the assistant turns (see skeleton()):
    replies: list[str] = []
    for _segment in skeleton(record):
        replies.append(generate(next_request(record, replies)))
    regenerated = with_replies(record, replies)
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from quanthunt.errors import ConfigError

MAX_LINE_BYTES = 4 * 1024 * 1024
"""A JSON Lines line longer than this (newline excluded) is refused unparsed, so a broken file cannot exhaust memory."""

ROLES = ("system", "user", "assistant")
"""The normalised roles."""

SHAREGPT_SPEAKERS: Mapping[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
}
"""ShareGPT ``from`` values and the role each is read as."""

OPENAI_ROLES: Mapping[str, str] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI ``role`` values and the role each is read as."""

CONVERSATION_KEYS = ("conversations", "messages", "items")
"""The keys (or Parquet columns) a record's conversation may be under; a record has exactly one."""

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)

_PARQUET_BATCH_ROWS = 1024
_TOOL_ROLES = ("tool", "function", "ipython")


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: a role from :data:`ROLES` and its text."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"content must be a string, not {type(self.content).__name__}")

    def to_json(self) -> dict[str, str]:
        """``{"role", "content"}``: an OpenAI chat message."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class PromptRecord:
    """One conversation of a prompt dataset, normalised, with its stable id."""

    id: str
    conversations: tuple[Turn, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"id must be a non-empty string, not {self.id!r}")
        if not isinstance(self.conversations, tuple) or not all(isinstance(t, Turn) for t in self.conversations):
            raise TypeError("conversations must be a tuple of Turn")

    def to_json(self) -> dict[str, Any]:
        """``{"id", "conversations": [{"role", "content"}, ...]}``; loading it back gives an equal record."""
        return {"id": self.id, "conversations": [turn.to_json() for turn in self.conversations]}

    @classmethod
    def of(cls, turns: Iterable[Turn], record_id: str | None = None) -> PromptRecord:
        """A record of ``turns`` with ``record_id``, or the content id when it is None."""
        conversation = tuple(turns)
        return cls(content_id(conversation) if record_id is None else record_id, conversation)


class RecordError(ValueError):
    """A record (one parsed JSON object or Parquet row) is not a valid conversation; the message names the field."""


def content_id(turns: Iterable[Turn]) -> str:
    """``h-`` and the first 16 hex digits of the SHA-256 of the conversation's canonical JSON.

    The canonical JSON is the list of ``{"role", "content"}`` objects with sorted keys, no whitespace and non-ASCII
    characters written as themselves, encoded as UTF-8; it depends on nothing but the normalised turns.
    """
    canonical = json.dumps([turn.to_json() for turn in turns], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "h-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def parse_record(obj: object) -> PromptRecord:
    """Normalise one record (a JSON object or a Parquet row as a dict); :class:`RecordError` names the bad field."""
    if not isinstance(obj, dict):
        raise RecordError(f"expected a JSON object (one record per line), got {_kind(obj)}")
    record_id = _parse_id(obj.get("id"))
    key, turns = _parse_conversation(obj)
    check_conversation(turns, key)
    return PromptRecord.of(turns, record_id)


def check_conversation(turns: Sequence[Turn], key: str = "conversations") -> None:
    """Raise :class:`RecordError` unless ``turns`` is a conversation whose assistant turns can be regenerated.

    ``key`` names the list in messages (``conversations[3]: ...``).
    """
    if not turns:
        raise RecordError(f"{key}: empty list, no turns")
    user_since_reply = False  # a user turn since the last assistant turn (or the start)
    last_reply: int | None = None
    for i, turn in enumerate(turns):
        if turn.role == "user":
            if not turn.content.strip():
                raise RecordError(f"{key}[{i}]: empty user message")
            user_since_reply = True
        elif turn.role == "assistant":
            if last_reply is None and not user_since_reply:
                raise RecordError(
                    f"{key}[{i}]: starts with an assistant turn; the first turn after any system turns must be a user turn"
                )
            if not user_since_reply:
                raise RecordError(f"{key}[{i}]: assistant turn with no user turn since the assistant turn {key}[{last_reply}]")
            user_since_reply = False
            last_reply = i
    if last_reply is None and not user_since_reply:
        raise RecordError(f"{key}: no user turn")
    if last_reply is not None and not user_since_reply and last_reply != len(turns) - 1:
        raise RecordError(f"{key}[{last_reply + 1}]: system turn after the last assistant turn, with no user turn to answer")


# -- regeneration ---------------------------------------------------------------------------------------------------


def skeleton(record: PromptRecord) -> tuple[tuple[Turn, ...], ...]:
    """The conversation without its assistant turns, cut where each assistant reply is to be generated.

    Segment ``k`` holds the system and user turns that come before assistant reply ``k`` and after reply ``k - 1``;
    ``len(skeleton(record))`` is the number of replies to generate. Every segment has a user turn. A conversation that
    ends with user turns (no original reply) gets a reply for them too. To regenerate, send the history, starting
    empty, extended by each segment in turn, and append each generated reply before the next segment::

        history: list[Turn] = []
        for segment in skeleton(record):
            history += segment
            history.append(Turn("assistant", generate(history)))

    :func:`next_request` and :func:`with_replies` do that bookkeeping. ``ValueError`` (:class:`RecordError`) if the
    record breaks the rules of :func:`check_conversation` (only possible for a record not made by this module's loaders).
    """
    check_conversation(record.conversations)
    segments: list[tuple[Turn, ...]] = []
    current: list[Turn] = []
    for turn in record.conversations:
        if turn.role == "assistant":
            segments.append(tuple(current))
            current = []
        else:
            current.append(turn)
    if current:
        segments.append(tuple(current))
    return tuple(segments)


def next_request(record: PromptRecord, replies: Sequence[str]) -> list[Turn]:
    """The messages to send to generate reply ``len(replies)``, given the replies generated so far.

    That is every segment of :func:`skeleton` up to and including segment ``len(replies)``, each earlier segment
    followed by its generated reply. ``ValueError`` if all replies are already generated.
    """
    segments = _segments_for(record, replies)
    if len(replies) >= len(segments):
        raise ValueError(f"record {record.id} has {len(segments)} replies to generate and all {len(replies)} are given")
    history = _splice(segments, replies)
    history.extend(segments[len(replies)])
    return history


def with_replies(record: PromptRecord, replies: Sequence[str]) -> PromptRecord:
    """The regenerated record: same id, the skeleton's system and user turns with ``replies`` as the assistant turns.

    ``ValueError`` unless there is exactly one reply per segment of :func:`skeleton`.
    """
    segments = _segments_for(record, replies)
    if len(replies) != len(segments):
        raise ValueError(f"record {record.id} needs {len(segments)} replies, got {len(replies)}")
    return PromptRecord(record.id, tuple(_splice(segments, replies)))


def _segments_for(record: PromptRecord, replies: Sequence[str]) -> tuple[tuple[Turn, ...], ...]:
    if isinstance(replies, str) or not all(isinstance(reply, str) for reply in replies):
        raise TypeError("replies must be a sequence of strings, one per generated assistant turn")
    return skeleton(record)


def _splice(segments: Sequence[tuple[Turn, ...]], replies: Sequence[str]) -> list[Turn]:
    history: list[Turn] = []
    for segment, reply in zip(segments, replies, strict=False):
        history.extend(segment)
        history.append(Turn("assistant", reply))
    return history


# -- files ----------------------------------------------------------------------------------------------------------


def load_prompts(path: Path) -> list[PromptRecord]:
    """All records of a prompt file, by suffix: ``.jsonl``/``.json`` (JSON Lines) or ``.parquet``."""
    return list(iter_prompts(path))


def iter_prompts(path: Path, *, unique_ids: bool = True) -> Iterator[PromptRecord]:
    """Stream the records of a prompt file, by suffix (see :func:`load_prompts`); errors come while iterating.

    ``unique_ids=False`` skips the duplicate-id check, which holds every id seen: for a
    file :func:`count_prompts` has already checked, so memory stays flat as it streams.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return iter_jsonl(path, unique_ids=unique_ids)
    if suffix in PARQUET_SUFFIXES:
        return iter_parquet(path, unique_ids=unique_ids)
    shown = repr(suffix) if suffix else "(no suffix)"
    raise ConfigError(f"{path}: unsupported prompt file type {shown}; use .jsonl, .json (JSON Lines) or .parquet")


def count_prompts(path: Path, *, limit: int | None = None) -> int:
    """Check the first ``limit`` records (all when None) as :func:`iter_prompts` does, ids
    unique included, and count them; holds 8 bytes a record (a hash of each id), not the
    ids. A duplicate is named with both its lines (or rows) by a second, exact pass."""
    hashes = array("Q")
    for record in itertools.islice(iter_prompts(path, unique_ids=False), limit):
        hashes.append(int.from_bytes(hashlib.blake2b(record.id.encode(), digest_size=8).digest(), "little"))
    ordered = np.sort(np.frombuffer(hashes, dtype=np.uint64))
    if len(ordered) > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        for _ in itertools.islice(iter_prompts(path), limit):  # raises on the duplicate, naming both places
            pass
    return len(hashes)  # (ids whose hashes merely collide, 1 in 2**64 a pair, pass)


def iter_jsonl(path: Path, *, unique_ids: bool = True) -> Iterator[PromptRecord]:
    """Stream the records of a JSON Lines file, one line at a time (a line is read only up to its size limit).

    Blank lines are skipped; a UTF-8 byte order mark at the start is allowed. Ids must be unique in the file
    (unless ``unique_ids`` is False).
    """
    path = Path(path)
    seen: dict[str, int] = {}
    count = 0
    with _open(path) as stream:
        lineno = 0
        while raw := stream.readline(MAX_LINE_BYTES + 2):  # room for the line and its "\r\n"
            lineno += 1
            where = f"{path}:{lineno}"
            newline = 2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0
            if len(raw) - newline > MAX_LINE_BYTES:
                raise ConfigError(f"{where}: line too long (over {MAX_LINE_BYTES} bytes); not parsed")
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line)"
                ) from None
            if not text.strip():
                continue
            text = text.rstrip("\r\n")  # so JSON error columns count within the line
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno}){_array_hint(lineno, text)}"
                ) from None
            except RecursionError:
                raise ConfigError(f"{where}: not valid JSON (nested too deeply)") from None
            except ValueError:  # Python refuses integers of more than sys.get_int_max_str_digits() digits
                raise ConfigError(f"{where}: not valid JSON (an integer with too many digits)") from None
            count += 1
            yield _record_at(obj, where, ("line", lineno), seen if unique_ids else None, hint=_array_hint(lineno, text))
    if not count:
        raise ConfigError(f"{path}: has no prompt records")


def iter_parquet(path: Path, *, unique_ids: bool = True) -> Iterator[PromptRecord]:
    """Stream the records of a Parquet file (columns ``id`` and one of :data:`CONVERSATION_KEYS`, nested lists).

    Rows are read in batches of a thousand; errors name the row, counted from 1. Needs pyarrow.
    """
    path = Path(path)
    with _open(path):  # the same missing / unreadable file errors as JSON Lines
        pass
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
        names: list[str] = list(parquet.schema_arrow.names)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None
    if not any(key in names for key in CONVERSATION_KEYS):
        raise ConfigError(
            f"{path}: no {', '.join(repr(k) for k in CONVERSATION_KEYS)} column (columns: {_keys(dict.fromkeys(names))})"
        )
    columns = [name for name in ("id", *CONVERSATION_KEYS) if name in names]
    seen: dict[str, int] = {}
    row = 0
    batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns)
    while True:
        try:
            batch = next(batches, None)
            rows: list[dict[str, Any]] = [] if batch is None else batch.to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"{path}: row {row + 1}: cannot read Parquet data ({_first_line(exc)})") from None
        if batch is None:
            break
        for obj in rows:
            row += 1
            yield _record_at(obj, f"{path}: row {row}", ("row", row), seen if unique_ids else None)
    if not row:
        raise ConfigError(f"{path}: has no prompt records")


def _record_at(obj: object, where: str, place: tuple[str, int], seen: dict[str, int] | None, *, hint: str = "") -> PromptRecord:
    """The record in ``obj`` (at ``place``: ``("line", 3)`` or ``("row", 3)``), or a
    ``ConfigError`` naming ``where``; with ``seen`` (id -> line or row number) a repeated id
    is refused too, naming both places."""
    try:
        record = parse_record(obj)
    except RecordError as exc:
        raise ConfigError(f"{where}: {exc}{hint}") from None
    if seen is None:
        return record
    unit, number = place
    first = seen.get(record.id)
    if first is not None:
        if record.id.startswith("h-") and record.id == content_id(record.conversations):
            raise ConfigError(
                f"{where}: duplicate conversation (same as {unit} {first}, id {record.id}); drop it or give it an id"
            )
        raise ConfigError(f"{where}: duplicate id {_show(record.id)} (first on {unit} {first})")
    seen[record.id] = number
    return record


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a prompt file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or _first_line(exc)})") from None


def _array_hint(lineno: int, text: str) -> str:
    if lineno == 1 and text.lstrip().startswith("["):
        return "; this looks like a JSON array, not JSON Lines (convert it with: jq -c '.[]')"
    return ""


# -- records --------------------------------------------------------------------------------------------------------


def _parse_id(raw: object) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise RecordError(f"id: expected a string or an integer, got {_kind(raw)}")
    text = str(raw)
    if not text.strip():
        raise RecordError("id: empty")
    if not text.isprintable():
        raise RecordError(f"id: {_show(text)} has control or separator characters")
    return text


def _parse_conversation(obj: Mapping[str, Any]) -> tuple[str, list[Turn]]:
    present = [key for key in CONVERSATION_KEYS if obj.get(key) is not None]
    if not present:
        keys = ", ".join(repr(k) for k in CONVERSATION_KEYS)
        raise RecordError(f"no conversation: expected one of {keys} (keys: {_keys(obj)})")
    if len(present) > 1:
        raise RecordError(f"both {present[0]!r} and {present[1]!r}: give exactly one conversation per record")
    key = present[0]
    entries = obj[key]
    if not isinstance(entries, list):
        raise RecordError(f"{key}: expected a list of turns, got {_kind(entries)}")
    if not entries:
        raise RecordError(f"{key}: empty list, no turns")
    sharegpt = _is_sharegpt(key, entries[0])
    return key, [_parse_turn(entry, f"{key}[{i}]", sharegpt=sharegpt, key=key) for i, entry in enumerate(entries)]


def _is_sharegpt(key: str, first: object) -> bool:
    if not isinstance(first, dict):
        raise RecordError(f"{key}[0]: expected an object, got {_kind(first)}")
    if key == "messages":
        return False
    if key == "items":
        return True
    has_from, has_role = first.get("from") is not None, first.get("role") is not None
    if has_from and has_role:
        raise RecordError(f"{key}[0]: has both 'from' and 'role'; cannot tell ShareGPT form from OpenAI form")
    if not (has_from or has_role):
        raise RecordError(f"{key}[0]: expected 'from' and 'value' (ShareGPT) or 'role' and 'content' (OpenAI)")
    return has_from


def _parse_turn(entry: object, where: str, *, sharegpt: bool, key: str) -> Turn:
    if not isinstance(entry, dict):
        raise RecordError(f"{where}: expected an object, got {_kind(entry)}")
    role_field, content_field, names = ("from", "value", SHAREGPT_SPEAKERS) if sharegpt else ("role", "content", OPENAI_ROLES)
    raw = entry.get(role_field)
    if raw is None:
        other = "role" if sharegpt else "from"
        if entry.get(other) is not None:
            form = "'from'/'value' (ShareGPT)" if sharegpt else "'role'/'content' (OpenAI)"
            raise RecordError(f"{where}: uses {other!r}, but {key} is in {form} form; one form per conversation")
        raise RecordError(f"{where}.{role_field}: missing")
    if not sharegpt and raw in _TOOL_ROLES:
        raise RecordError(
            f"{where}.role: {raw!r} turns are not supported (regeneration drops the assistant turns that called the tools)"
        )
    role = names.get(raw) if isinstance(raw, str) else None
    if role is None:
        what = "speaker" if sharegpt else "role"
        raise RecordError(f"{where}.{role_field}: unknown {what} {_show(raw)} (expected one of {', '.join(names)})")
    return Turn(role, _parse_content(entry.get(content_field), f"{where}.{content_field}"))


def _parse_content(value: object, where: str) -> str:
    if isinstance(value, str):
        return _unicode(value, where)
    if value is None:
        raise RecordError(f"{where}: missing")
    if isinstance(value, list):
        texts: list[str] = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = _show(part.get("type")) if isinstance(part, dict) else _kind(part)
                raise RecordError(f"{where}[{j}]: only text parts are supported ({{'type': 'text', 'text': ...}}), got {kind}")
            texts.append(_unicode(part["text"], f"{where}[{j}].text"))
        return "\n".join(texts)
    raise RecordError(f"{where}: expected a string, got {_kind(value)}")


def _unicode(text: str, where: str) -> str:
    """``text``, unless it holds a lone surrogate (JSON's ``"\\ud800"``): such text cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = text[exc.start]
        raise RecordError(f"{where}: not valid Unicode (lone surrogate {surrogate!r} at character {exc.start + 1})") from None
    return text


def _keys(obj: Mapping[Any, Any], limit: int = 10) -> str:
    """A record's keys for a message: plain keys as they are, others as short reprs, at most ``limit``."""
    first = itertools.islice(obj, limit)
    shown = [str(k) if isinstance(k, str) and k.isprintable() and len(k) <= 40 else _show(k, 40) for k in first]
    more = f", ... ({len(obj)} keys)" if len(obj) > limit else ""
    return (", ".join(shown) + more) or "none"


def _kind(value: object) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _show(value: object, limit: int = 60) -> str:
    """A short one-line repr of a value from the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
