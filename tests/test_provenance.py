"""A result's provenance: the commit of the code that made it and the machine it ran on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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
