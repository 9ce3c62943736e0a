"""The commands the README and the user guide mark as CPU-runnable run as written.

A fenced block whose info string is ``bash test`` (``bash test slow`` when it loads models and
takes more than a few seconds) is a promise that it works on a CPU machine after
``make setup``: each one runs here in bash with ``set -e -o pipefail``, from the
repository root, with the virtualenv's ``bin/`` (and ``.tools/bin`` for helm and kubectl) first
on ``PATH``. Blocks run the embedded default pair for real (a few seconds to load each) and
everything slower (training, benchmarks) only as ``--help``. Whatever a block leaves running in
the background is stopped with its process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/GUIDE.md")
FENCE = re.compile(r"^```bash test( slow)?\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return [(name, script) for name, script, _ in marked()]


def marked() -> list[tuple[str, str, bool]]:
    """(document#n, script, slow) for every tested block, in document order."""
    found = []
    for name in DOCUMENTS:
        text = (ROOT / name).read_text()
        for number, match in enumerate(FENCE.finditer(text), 1):
            found.append((f"{name}#{number}", match.group(2), bool(match.group(1))))
    return found


def cases() -> list:
    return [
        pytest.param(name, script, id=name, marks=[pytest.mark.slow] if slow else [])
        for name, script, slow in marked()
    ]


def test_the_guide_marks_commands_to_run() -> None:
    names = {name.split("#")[0] for name, _ in blocks()}
    assert names == set(DOCUMENTS), "README.md and docs/GUIDE.md each have ```bash test blocks"


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(("name", "script"), cases())
def test_marked_commands_run_as_written(name: str, script: str, tmp_path: Path) -> None:
    for port in map(int, re.findall(r"--port (\d+)", script)):
        if port_in_use(port):
            pytest.skip(f"port {port}, which {name} serves on, is taken by another process")
    if re.search(r"^\s*(helm|kubectl)\b", script, re.M) and not (ROOT / ".tools" / "bin" / "helm").exists():
        pytest.skip("helm/kubectl are not installed in .tools/bin (make tools)")
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), str(ROOT / ".tools" / "bin"), os.environ["PATH"]]
    )
    log = tmp_path / "output.txt"
    with log.open("w") as sink:  # a file, not a pipe: a background server must not hold it open
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=ROOT,
            env=os.environ | {"PATH": path},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            process.wait(timeout=420)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    output = log.read_text()
    assert process.returncode == 0, f"{name} failed:\n{script}\n--- output ---\n{output[-4000:]}"
