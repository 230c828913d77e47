"""The order the suite starts its tests in (``tests/conftest.py``): the durations file that
ranks them, and ``tools/slowest_tests.py`` that writes it from a ``--durations=0`` report."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).parent
REPO = TESTS.parent


def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slowest_tests", REPO / "tools" / "slowest_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tests_phases_are_summed_and_short_tests_left_out() -> None:
    report = """
============================= slowest durations ==============================
130.40s call     tests/stages/test_a.py::test_long
5.60s setup    tests/stages/test_a.py::test_long
3.10s call     tests/test_b.py::test_param[x-1]
0.40s teardown tests/test_b.py::test_param[x-1]
1.90s call     tests/test_b.py::test_short
================= 3 passed in 140.00s =================
"""
    assert tool().durations(report) == {"tests/stages/test_a.py::test_long": 136, "tests/test_b.py::test_param[x-1]": 4}


def test_every_ranked_test_still_exists() -> None:
    """A renamed or removed test left in the file is ranked for nothing: drop its line, or
    write the file again (``tools/slowest_tests.py``)."""
    ranked = json.loads((TESTS / "durations.json").read_text(encoding="utf-8"))
    assert ranked and list(ranked.values()) == sorted(ranked.values(), reverse=True)
    for nodeid in ranked:
        path, name = nodeid.split("::")
        source = REPO / path
        assert source.is_file(), nodeid
        function = re.sub(r"\[.*\]$", "", name)
        assert re.search(rf"^def {re.escape(function)}\(", source.read_text(encoding="utf-8"), re.MULTILINE), nodeid
