"""Fixtures for the packaging tests: the real helm (4 and 3) and checkov binaries from `.tools/bin`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packaging.tools import require_tool


@pytest.fixture(scope="session")
def helm() -> Path:
    return require_tool("helm")


@pytest.fixture(scope="session", params=["helm", "helm3"])
def any_helm(request: pytest.FixtureRequest) -> Path:
    """Each supported Helm major in turn: the chart must work with Helm 4 and Helm 3."""
    return require_tool(request.param)


@pytest.fixture(scope="session")
def checkov() -> Path:
    return require_tool("checkov")
