"""Shared fixtures live in ``tests/fixtures/``, one module per concern."""

import pytest

pytest_plugins = [
    "fixtures.contracts",
    "fixtures.sandbox",
    "fixtures.project",
    "fixtures.generation",
    "fixtures.bad_inputs",
    "fixtures.postgres",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist (``make test`` runs ``-n 2 --dist loadgroup``), every test that needs the
    real model goes to one worker, so the session's model sandbox is loaded once."""
    for item in items:
        if item.get_closest_marker("model") is not None:
            item.add_marker(pytest.mark.xdist_group("model"))
