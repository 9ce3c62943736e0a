"""The e2e API checker against the real `multiguess serve`, configured the way pods are (env vars).

The cluster tests cannot run here, but what they assert about the server can: the same checker
runs against a real server process serving tiny models on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.check_api import CheckFailed, check_metrics, main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served(
    tiny_llama: Path, tiny_llama_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`multiguess serve` in its own process, configured only through MULTIGUESS_* variables."""
    port = _free_port()
    env = {
        **os.environ,
        "MULTIGUESS_TARGET": str(tiny_llama),
        "MULTIGUESS_DRAFT": str(tiny_llama_draft),
        "MULTIGUESS_MODEL_NAME": "tiny",
        "MULTIGUESS_NUM_CANDIDATES": "2",
        "MULTIGUESS_DEPTH": "3",
        "MULTIGUESS_MAX_NODES": "8",
        "MULTIGUESS_HOST": "127.0.0.1",
        "MULTIGUESS_PORT": str(port),
        "MULTIGUESS_LOG_LEVEL": "warning",
    }
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multiguess.cli", "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.returncode not in (0, -15):
            print(log.read_text()[-4000:])


def test_checker_passes_against_the_real_server(served: str) -> None:
    assert main([served, "--ready-timeout", "120"]) == 0


def test_load_mode_serves_requests(served: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([served, "--ready-timeout", "120", "--load-seconds", "2", "--concurrency", "2"]) == 0
    assert "requests in 2 s of load" in capsys.readouterr().out


def test_checker_fails_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"http://127.0.0.1:{_free_port()}", "--ready-timeout", "1"]) == 1
    assert "/health/ready never returned 200" in capsys.readouterr().err


def test_metrics_check_needs_growth() -> None:
    same = {"multiguess_generation_tokens_total": 5.0, "multiguess_request_queue_seconds_count": 1.0}
    with pytest.raises(CheckFailed, match="generation_tokens_total"):
        check_metrics(same, same, requests=1)
