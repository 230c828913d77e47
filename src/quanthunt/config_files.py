"""Reading the user's YAML files (params, rosters) and turning every problem into one
``ConfigError`` line that names the file and the field."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from quanthunt.errors import ConfigError

M = TypeVar("M", bound=BaseModel)
_USERINFO = re.compile(r"//[^\s'\"@]*@")
"""A URL's ``//user:password@``: everything from ``//`` to the first ``@`` (a password may
hold ``/``, ``?`` or ``#`` unescaped), stopping at a space or a quote."""


def one_line(text: str, limit: int) -> str:
    """``text`` with line breaks and other unprintable characters escaped, cut to ``limit``
    characters: safe to put in a one-line message."""
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _part(part: int | str) -> str:
    """One step of a field path: a plain key as it is; an empty, padded, dotted or unprintable one quoted."""
    text = str(part)
    if isinstance(part, str) and (not text.isprintable() or "." in text or text != text.strip() or not text):
        text = repr(part)
    return one_line(text, 60)


def hide_userinfo(text: str) -> str:
    """``text`` with every URL's user and password (``//user:pw@``) replaced by ``//***@``."""
    return _USERINFO.sub("//***@", text)


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a dotted path (``survey.budget.usd``)."""
    return ".".join(_part(part) for part in loc) or "(top level)"


def read_text(path: Path, *, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} file not found") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the path
        raise ConfigError(f"{path}: cannot read {what} ({exc.__class__.__name__})") from None


def parse_yaml(text: str, *, source: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where} is not valid YAML") from None
    except RecursionError:
        raise ConfigError(f"{source}: is not a valid {what} (nested too deeply)") from None


def validated(model: type[M], data: Any, *, source: str) -> M:
    """``data`` as ``model``, or one ``ConfigError`` line naming the file, the first bad field
    and the value it got (a URL's user and password never shown)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = one_line(hide_userinfo(first["msg"]), 300)
        if first["type"] == "extra_forbidden":
            message = "unknown key"
        value = first.get("input")
        if isinstance(value, str):
            value = hide_userinfo(value)
        shown = "" if isinstance(value, dict | list) or first["type"] == "missing" else f" (got {one_line(repr(value), 80)})"
        if isinstance(value, float) and math.isnan(value):
            shown = " (got NaN)"
        raise ConfigError(f"{source}: {field_path(first['loc'])}: {message}{shown}") from None
