"""Write ``tests/durations.json`` (the order ``tests/conftest.py`` starts the tests in) from
a full run's ``--durations=0`` report.

Usage::

    .venv/bin/pytest -n 2 --dist worksteal -m "not engines" --durations=0 -q | tee run.txt
    .venv/bin/python tools/slowest_tests.py run.txt tests/durations.json

Each test's setup, call and teardown seconds are summed; tests under 2 s are left out (they
keep their collected order), and the seconds are rounded to whole ones, so that the file
changes only when a test's length does.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)$")
KEPT_FROM_S = 2.0


def durations(report: str) -> dict[str, int]:
    """Seconds per test id, slowest first, from a pytest ``--durations`` report."""
    seconds: dict[str, float] = {}
    for line in report.splitlines():
        if match := LINE.match(line.strip()):
            seconds[match.group(2)] = seconds.get(match.group(2), 0.0) + float(match.group(1))
    ranked = sorted(seconds.items(), key=lambda item: -item[1])
    return {test: round(spent) for test, spent in ranked if spent >= KEPT_FROM_S}


def main(report: Path, target: Path) -> None:
    found = durations(report.read_text(encoding="utf-8"))
    if not found:
        sys.exit(f"error: {report}: no --durations lines of 2 s or more (run pytest with --durations=0)")
    target.write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
    print(f"{target}: {len(found)} tests, {sum(found.values()):,} s")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/slowest_tests.py REPORT.txt tests/durations.json")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
