"""The end-to-end tests: one real cluster per kind and mode, driven by the shell scripts here.

Each script creates a cluster, builds and loads both images, installs the chart, waits for the
example to be Ready, sends /generate and OpenAI requests, checks metrics and scaling, uninstalls
and deletes the cluster. Without Docker or the cluster tool the test skips and says which is
missing; it never passes without running.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.prerequisites import SCRIPTS, missing

E2E_DIR = Path(__file__).resolve().parent


@pytest.mark.e2e
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("cluster", sorted(SCRIPTS))
def test_end_to_end(cluster: str, mode: str) -> None:
    reason = missing(cluster, mode)
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "MODE": mode, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(E2E_DIR / SCRIPTS[cluster])], env=env, timeout=3500, check=False)
    assert result.returncode == 0, f"{SCRIPTS[cluster]} (MODE={mode}) failed; its log is above"
