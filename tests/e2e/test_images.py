"""Both images built from the Dockerfile and run on this machine: `make e2e-images`.

scripts/images/e2e.sh builds the serving and operator images from a debootstrap base and a local
wheelhouse (no image registry, no PyTorch index), runs the serving image as a pod would (uid
10001, read-only root filesystem, the chart's writable mounts) against the README's requests and
the OpenAI client, and has the operator image reconcile examples/speculative.yaml against kmock's
emulator. Where no engine can run it skips, saying what is missing; it never passes without running.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.prerequisites import images_missing

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.images
@pytest.mark.timeout(3000)
def test_images_build_and_run() -> None:
    reason = images_missing()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "images" / "e2e.sh")], env=env, timeout=2900, check=False
    )
    assert result.returncode == 0, "scripts/images/e2e.sh failed; its log is above"
