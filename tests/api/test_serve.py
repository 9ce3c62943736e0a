"""`multiguess serve`: flags and their environment variables, and a graceful SIGTERM drain."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from multiguess.cli import build_parser
from multiguess.commands.serve import served_name

from tests.api.helpers import metric, sse_events
from tests.servers import wait_ready


def parse(*argv: str) -> object:
    return build_parser().parse_args(["serve", *argv])


def env_name(flag: str) -> str:
    return "MULTIGUESS_" + flag.lstrip("-").replace("-", "_").upper()


def running(
    cmd: list[str], env: dict[str, str], port: int, ready_within: float
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A fixture's body: ``cmd`` in its own process until ready on ``port``, killed at the end
    if the test left it running."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout=ready_within, process=proc)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


SERVE_FLAGS = ["--target", "--draft", "--draft-quantization", "--dtype", "--device", "--num-candidates",
               "--depth", "--max-nodes", "--max-batch", "--max-model-len", "--host", "--port", "--max-queue",
               "--request-timeout", "--model-name", "--log-level", "--api-key", "--api-key-file",
               "--protect-metrics", "--max-body-size", "--draft-secret", "--draft-secret-file"]  # fmt: skip


def test_every_flag_has_an_environment_variable_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MULTIGUESS_NUM_CANDIDATES", "5")
    monkeypatch.setenv("MULTIGUESS_MAX_QUEUE", "7")
    monkeypatch.setenv("MULTIGUESS_REQUEST_TIMEOUT", "2.5")
    monkeypatch.setenv("MULTIGUESS_LOG_LEVEL", "WARNING")
    args = parse("--max-queue", "9")
    assert (args.num_candidates, args.max_queue, args.request_timeout) == (5, 9, 2.5)
    assert (args.depth, args.port, args.target, args.log_level) == (4, 8000, None, "warning")
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())  # type: ignore[union-attr]
    for flag in SERVE_FLAGS:
        assert flag in help_text and env_name(flag) in help_text, flag


def test_bad_values_fail_with_the_flags_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--port", "eighty"], ["--request-timeout", "0"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit) as exc:
            parse(*argv)
        assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_served_name_defaults_to_the_target_folder() -> None:
    assert served_name(parse()) == "multiguess-default"
    assert served_name(parse("--target", "/models/SmolLM2-135M/")) == "SmolLM2-135M"
    assert served_name(parse("--target", "/m/x", "--model-name", "prod")) == "prod"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve_process(tiny_llama: Path, tiny_llama_draft: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """The real command in its own process, configured the way pods are: mostly by env."""
    port = free_port()
    env = {
        **os.environ,
        "MULTIGUESS_TARGET": str(tiny_llama),
        "MULTIGUESS_DRAFT": str(tiny_llama_draft),
        "MULTIGUESS_DTYPE": "float32",
        "MULTIGUESS_MAX_MODEL_LEN": "512",
        "MULTIGUESS_HOST": "127.0.0.1",
        "MULTIGUESS_PORT": str(port),
        "MULTIGUESS_MODEL_NAME": "from-env",
        "MULTIGUESS_LOG_LEVEL": "warning",
    }
    cmd = [
        sys.executable,
        "-m",
        "multiguess.cli",
        "serve",
        "--model-name",
        "from-cli",
        "--shutdown-grace",
        "30",
    ]
    yield from running(cmd, env, port, ready_within=120)


def test_sigterm_drains_in_flight_requests_then_exits_zero(
    serve_process: tuple[subprocess.Popen, str],
) -> None:
    proc, url = serve_process
    body = {"prompt": "w1 w2", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "depth": 0}
    with httpx.Client(base_url=url, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["from-cli"]
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=stream_body) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 200
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == whole
    assert proc.wait(30) == 0, proc.stdout.read() if proc.stdout else ""
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health/live", timeout=2)


@pytest.fixture
def short_grace(tiny_llama: Path, tiny_llama_draft: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    env = {**os.environ, "MULTIGUESS_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "multiguess.cli", "serve", "--target", str(tiny_llama), "--draft",
           str(tiny_llama_draft), "--dtype", "float32", "--max-model-len", "512", "--host", "127.0.0.1",
           "--port", str(port), "--model-name", "tiny", "--shutdown-grace", "1.5"]  # fmt: skip
    yield from running(cmd, env, port, ready_within=240)


def test_when_the_grace_runs_out_clients_get_503s_and_error_events(
    short_grace: tuple[subprocess.Popen, str],
) -> None:
    """During the drain a new connection is answered 503 (not refused); requests still running
    when the grace ends get a 503 in the API's error shape, streams an error event."""
    proc, url = short_grace
    body = {"prompt": "w1 w2", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "depth": 0}
    # Four speculative samples of 500 tokens: longer than the grace on any machine.
    batch = {**body, "prompt": ["w1 w2", "w3", "w4 w5", "w6"], "depth": 4}
    results: dict[str, httpx.Response] = {}

    def whole() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            results["whole"] = client.post("/v1/completions", json=batch)

    waiter = threading.Thread(target=whole)
    stream_body = {**body, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=stream_body) as resp,
    ):
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        waiter.start()
        while (
            metric(client, "multiguess_requests_running") + metric(client, "multiguess_requests_waiting") < 5
        ):
            time.sleep(0.02)  # until the second request is admitted
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=10) as fresh:  # a new connection, mid-drain
            refused = fresh.post("/v1/completions", json={**body, "max_tokens": 1})
            ready = fresh.get("/health/ready")
        events = sse_events([first, *lines])
    waiter.join(30)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert ready.status_code == 503
    assert events[-1]["error"]["code"] == "shutting_down", events[-1]
    assert results["whole"].status_code == 503 and results["whole"].json()["error"]["code"] == "shutting_down"
    assert proc.wait(30) == 0
