"""``dvc.yaml`` against the code: each stage depends on its shell and on every library
module it imports (directly or not), so a change to what computes its outputs re-runs it,
and on nothing of the sandbox, so editing the sandbox never re-runs a paid live stage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src"
PLUMBING = {
    "__init__", "__main__", "cli", "config_files", "connection", "defaults", "errors", "interrupts", "locking", "outputs",
    "params", "redaction", "spec", "stage", "terminal", "tracking", "urls",
}  # fmt: skip
"""Modules every stage shares to read its params, report errors, log and write atomically:
they shape how a stage runs, not what it computes, so they are not listed (a change to
them would re-run every stage, paid audits included)."""


def module_file(name: str) -> Path | None:
    path = PACKAGE.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported(path: Path) -> set[str]:
    """The ``quanthunt`` modules ``path`` imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("quanthunt")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quanthunt"):
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}")}
    return names


def runs(shell: Path) -> set[str]:
    """Every library module ``shell`` runs: its import closure, as paths from the repository root."""
    seen: set[str] = set()
    todo = list(imported(shell))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if (path := module_file(name)) is not None:
            todo.extend(imported(path))
    files = (module_file(name) for name in seen)
    return {str(f.relative_to(ROOT)) for f in files if f is not None}


STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_depends_on_the_library_modules_it_runs_and_nothing_of_the_sandbox(stage: str) -> None:
    definition = STAGES[stage].get("do", STAGES[stage])
    listed = {d for d in definition["deps"] if d.startswith(("src/", "stages/"))}
    assert f"stages/{stage}.py" in listed
    computing = {p for p in runs(ROOT / "stages" / f"{stage}.py") if "/sandbox/" not in p and Path(p).stem not in PLUMBING}
    assert not {p for p in listed if "/sandbox/" in p}, "the sandbox is no dependency of a stage"
    assert sorted(computing - listed) == [], "modules the stage runs but does not depend on"
    assert sorted(listed - computing - {f"stages/{stage}.py"}) == [], "dependencies the stage never runs"
