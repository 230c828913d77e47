"""Shared fixtures live in ``tests/fixtures/``, one module per concern."""

pytest_plugins = [
    "fixtures.contracts",
    "fixtures.sandbox",
    "fixtures.project",
    "fixtures.generation",
    "fixtures.bad_inputs",
    "fixtures.postgres",
    "fixtures.engines",
]
