"""End-to-end tests take many minutes and a real cluster: they run only when selected (`-m e2e`)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip e2e-marked tests in a plain `pytest` run; `make e2e` selects them with `-m e2e`."""
    if "e2e" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="end-to-end test: run it with `make e2e` (pytest -m e2e tests/e2e)")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)
