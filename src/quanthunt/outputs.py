"""Stage outputs written all-or-nothing.

Each file is staged next to its target (same directory, so the rename is atomic) and
moved into place only when the whole stage succeeded; on failure the staged files are
removed and whatever was there before is untouched. No partial file ever looks complete.

A directory can be an output too (``write_dir``): it is staged whole beside its target and
swapped in at commit, so files of an earlier run that this one did not write go with it.

Usage::

    with Outputs() as out:
        out.write_text(Path("reports/survey/providers.csv"), csv_text)
        out.write_json(Path("reports/survey/budget_plan.json"), plan)
        out.write_dir(Path("reports/verify/plots"), {"alpha.png": png})
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any


def _stage(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with staged.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return staged


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    with Outputs() as out:
        out.write_bytes(path, data)


class Outputs:
    """A set of files that appear together or not at all."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []
        self._staged_dirs: list[tuple[Path, Path]] = []

    def write_bytes(self, path: Path, data: bytes) -> None:
        staged = _stage(path, data)
        # A second write to the same path overwrote its staged file: stage it once, last write wins.
        self._staged = [(s, p) for s, p in self._staged if s != staged]
        self._staged.append((staged, path))

    def write_text(self, path: Path, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))

    def write_json(self, path: Path, data: Any) -> None:
        self.write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")

    def write_dir(self, path: Path, files: dict[str, bytes]) -> None:
        """The directory ``path`` holding exactly ``files`` (by name) once committed."""
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        self._staged_dirs.append((staged, path))
        for name, data in files.items():
            (staged / name).write_bytes(data)

    def commit(self) -> None:
        try:
            for staged, path in self._staged_dirs:
                # Two renames: a crash between them leaves the earlier directory under its
                # .old name, never a mix of two runs' files.
                old = path.with_name(f".{path.name}.{os.getpid()}.old")
                if path.exists():
                    os.replace(path, old)
                os.replace(staged, path)
                shutil.rmtree(old, ignore_errors=True)
            for staged, path in self._staged:
                os.replace(staged, path)
        finally:
            self.discard()  # what could not be moved in (nothing, when every rename succeeded)

    def discard(self) -> None:
        for staged, _ in self._staged:
            staged.unlink(missing_ok=True)
        for staged, _ in self._staged_dirs:
            shutil.rmtree(staged, ignore_errors=True)
        self._staged.clear()
        self._staged_dirs.clear()

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
