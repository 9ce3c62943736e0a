"""scripts/install_tools.py: extraction from the wheel's nested archives, idempotence, real versions."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.packaging.tools import INSTALLER


def _installer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_tools", INSTALLER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_wheel(path: Path, binaries: dict[str, bytes]) -> Path:
    """A wheel shaped like the CDK layer: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as zipped:
        for name, data in binaries.items():
            zipped.writestr(name, data)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("aws_cdk/layer/_jsii/layer@2.2.2.jsii.tgz", tgz.getvalue())
    return path


def test_extracts_helm_and_kubectl_as_executables(tmp_path: Path) -> None:
    wheel = _fake_wheel(
        tmp_path / "layer.whl", {"helm/helm": b"HELM", "kubectl/kubectl": b"KUBECTL", "x/y": b""}
    )
    binaries = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}
    written = _installer().extract_layer_binaries(wheel, tmp_path / "bin", binaries)
    assert sorted(p.name for p in written) == ["helm", "kubectl"]
    assert (tmp_path / "bin" / "helm").read_bytes() == b"HELM"
    assert (tmp_path / "bin" / "kubectl").read_bytes() == b"KUBECTL"
    assert all(os.access(p, os.X_OK) for p in written)
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["helm", "kubectl"]


def test_a_wheel_without_the_layer_is_a_clear_error(tmp_path: Path) -> None:
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zipped:
        zipped.writestr("pkg/__init__.py", "")
    with pytest.raises(RuntimeError, match=r"expected one \.jsii\.tgz"):
        _installer().extract_layer_binaries(wheel, tmp_path / "bin", {"helm/helm": "helm"})


def test_second_run_is_quick_and_downloads_nothing(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("helm", "helm3", "kubectl"):
        (bin_dir / name).write_bytes(b"#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(INSTALLER), "--no-checkov", "--tools-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert time.monotonic() - started < 10
    assert "already" in result.stdout
    assert not (tmp_path / "cache").exists()


def _version(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def test_installed_helm_and_kubectl_are_the_pinned_versions(helm: Path) -> None:
    assert "v4.1.4" in _version(str(helm), "version", "--short")
    assert "v1.35.2" in _version(str(helm.parent / "kubectl"), "version", "--client")
    assert "v3.17.2" in _version(str(helm.parent / "helm3"), "version", "--short")
