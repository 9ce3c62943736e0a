"""A result's provenance: the commit of the code that made it and the machine it ran on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from multiguess import provenance

ROOT = Path(__file__).resolve().parents[1]


def test_the_commit_is_this_checkout_s_with_its_dirty_flag() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert re.fullmatch(re.escape(head) + "(-dirty)?", provenance.git_commit())


def test_a_record_names_commit_date_and_machine() -> None:
    record = provenance.provenance()
    assert set(record) == {"commit", "date", "machine"}
    assert record["date"].endswith("UTC") and "cores" in record["machine"]


def test_benchmark_results_do_not_make_a_checkout_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark run after another measures the same code: the results and pages the first
    wrote leave the commit clean; a changed source file does not."""

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    package = tmp_path / "server" / "multiguess"
    package.mkdir(parents=True)
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    files = [package / "code.py", tmp_path / "docs" / "bench" / "run.json", tmp_path / "README.md"]
    for file in files:
        file.write_text("one\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "first")
    monkeypatch.setattr(provenance, "__file__", str(package / "provenance.py"))
    for file in files[1:]:
        file.write_text("two\n")
    assert not provenance.git_commit().endswith("-dirty")
    files[0].write_text("two\n")
    assert provenance.git_commit().endswith("-dirty")
