"""Find the packaging tools in `.tools/bin`, installing them with scripts/install_tools.py if missing.

Why a helper: CI runs `make tools` before the tests, but a developer running pytest directly
should get the same real tools, and a machine that cannot install them gets a skip that says
why instead of a silent pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = ROOT / ".tools" / "bin"
INSTALLER = ROOT / "scripts" / "install_tools.py"


def require_tool(name: str) -> Path:
    """Path of an executable in `.tools/bin`; install on demand, skip with the reason if impossible."""
    path = TOOLS_BIN / name
    if os.access(path, os.X_OK):
        return path
    command = [sys.executable, str(INSTALLER)]
    if name in ("helm", "helm3", "kubectl"):
        command.append("--no-checkov")
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if not os.access(path, os.X_OK):
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        pytest.skip(
            f"{name} is absent from {TOOLS_BIN} and `{' '.join(command)}` could not install it: {tail}"
        )
    return path
