"""Run the real helm binary against the chart and parse what it renders."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.packaging.tools import ROOT

CHART = ROOT / "charts" / "multiguess"
RELEASE = "mg"
NAMESPACE = "mg-system"


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


def run_helm(helm: Path, *args: str) -> str:
    """Run helm, returning stdout; raise HelmError with stderr on failure."""
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def value_args(values_files: Iterable[Path] = (), set_values: Sequence[str] = ()) -> list[str]:
    """helm's `-f FILE` and `--set K=V` arguments."""
    args: list[str] = []
    for path in values_files:
        args += ["-f", str(path)]
    for item in set_values:
        args += ["--set", item]
    return args


def render(
    helm: Path,
    values_files: Iterable[Path] = (),
    set_values: Sequence[str] = (),
    include_crds: bool = False,
) -> list[dict[str, Any]]:
    """`helm template` the chart; the rendered objects as dicts (empty documents dropped)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *value_args(values_files, set_values)]
    if include_crds:
        args.append("--include-crds")
    return [doc for doc in yaml.safe_load_all(run_helm(helm, *args)) if doc]


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rendered objects of one kind."""
    return [obj for obj in objects if obj.get("kind") == kind]
