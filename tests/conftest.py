"""Shared fixtures live in ``tests/fixtures/``, one module per concern."""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "fixtures.contracts",
    "fixtures.sandbox",
    "fixtures.project",
    "fixtures.generation",
    "fixtures.bad_inputs",
    "fixtures.postgres",
    "fixtures.engines",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``make test``'s xdist workers (``--dist worksteal``) each worker starts with a
    contiguous share of the collection, in order, and an idle one steals from the end of
    another's queue. Collected in file order, every stage test (tests/stages: pipelines and
    their subprocesses, the longest tests, those on the real model longest of all) sat in
    one worker's share, the longest last: the other worker finished its unit tests, and the
    run ended on a long stage test or two running alone (2026-12-07: the last 5 % of tests
    took ~3 of pytest's 14 minutes). So the stage tests are dealt to the workers' shares in
    turn, the real model's first, each share starting with its own; the rest keep their order
    behind them. Any order is correct: the tests do not depend on each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    staged = [item for item in items if "/tests/stages/" in str(item.path)]
    staged.sort(key=lambda item: item.get_closest_marker("model") is None)  # stable: file order within each kind
    rest = [item for item in items if "/tests/stages/" not in str(item.path)]
    shares: list[list[pytest.Item]] = [staged[k::workers] for k in range(workers)]
    left = len(items)
    for k, share in enumerate(shares):  # as xdist sizes them: floor(left / workers left), the first share first
        size = left // (workers - k)
        while len(share) < size and rest:
            share.append(rest.pop(0))
        left -= len(share)
    shares[-1].extend(rest)
    items[:] = [item for share in shares for item in share]
