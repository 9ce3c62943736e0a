"""End-to-end tests take many minutes: the cluster ones run only when selected (`-m e2e`); the
images test (marked `images`) also runs in the plain suite, and skips where no engine can run."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip cluster e2e tests in a plain `pytest` run; `make e2e` selects them with `-m e2e`."""
    if "e2e" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="end-to-end test: run it with `make e2e` (pytest -m e2e tests/e2e)")
    for item in items:
        if item.get_closest_marker("e2e") is not None and item.get_closest_marker("images") is None:
            item.add_marker(skip)
