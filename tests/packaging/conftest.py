"""Fixtures for the packaging tests: the real helm and checkov binaries from `.tools/bin`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packaging.tools import require_tool


@pytest.fixture(scope="session")
def helm() -> Path:
    return require_tool("helm")


@pytest.fixture(scope="session")
def checkov() -> Path:
    return require_tool("checkov")
