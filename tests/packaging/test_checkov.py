"""checkov on the chart and the Dockerfile: nothing fails except the checks skipped with a reason.

checkov runs from a scratch directory without the config first, so the test sees every failing
check; those must be exactly the skips in .checkov.yaml (no unexplained failure, no stale skip).
Then it runs as documented, with the config, and must pass.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.packaging.tools import ROOT

CONFIG = ROOT / ".checkov.yaml"
TARGETS = {
    "helm": ["-d", str(ROOT / "charts" / "multiguess")],
    "dockerfile": ["-f", str(ROOT / "Dockerfile")],
}


def _skips() -> dict[str, str]:
    """Skipped check id -> the reason written after it."""
    reasons = {}
    for line in CONFIG.read_text().splitlines():
        match = re.match(r"\s*-\s*(CKV\w+)\s*(?:#\s*(.*))?$", line)
        if match:
            reasons[match.group(1)] = (match.group(2) or "").strip()
    return reasons


def _run(checkov: Path, helm: Path, cwd: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    """checkov's JSON reports; its helm framework renders the chart with the helm found on PATH."""
    env = {**os.environ, "PATH": f"{helm.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        [str(checkov), "--skip-download", "-o", "json", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        check=False,
    )
    report = json.loads(result.stdout)
    return result.returncode, report if isinstance(report, list) else [report]


def _failed_ids(reports: list[dict[str, Any]]) -> set[str]:
    """Failed check ids; a report without results means checkov ran nothing, which must fail too."""
    assert all("results" in report and report["summary"]["passed"] > 0 for report in reports), reports
    return {check["check_id"] for report in reports for check in report["results"]["failed_checks"]}


def test_every_skip_has_a_reason() -> None:
    skips = _skips()
    assert skips, "no skips parsed from .checkov.yaml"
    assert yaml.safe_load(CONFIG.read_text())["skip-check"] == list(skips)
    for check, reason in skips.items():
        assert len(reason.split()) >= 5, f"{check} is skipped without a reason"


def test_only_the_justified_checks_fail_without_the_config(checkov: Path, helm: Path, tmp_path: Path) -> None:
    failed: set[str] = set()
    for framework, target in TARGETS.items():
        _, reports = _run(checkov, helm, tmp_path, "--framework", framework, *target)
        failed |= _failed_ids(reports)
    assert failed == set(_skips())


@pytest.mark.parametrize("framework", TARGETS)
def test_passes_with_the_config(checkov: Path, helm: Path, framework: str) -> None:
    code, reports = _run(
        checkov, helm, ROOT, "--config-file", str(CONFIG), "--framework", framework, *TARGETS[framework]
    )
    assert _failed_ids(reports) == set()
    assert code == 0
