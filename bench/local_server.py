"""A server process on 127.0.0.1 for the benchmark scripts: a free port, then start and wait."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ready(
    cmd: list[str], env: dict[str, str], port: int, timeout: float, quiet: bool = True
) -> subprocess.Popen:
    """Start ``cmd`` and return once ``/health/ready`` on ``port`` answers 200 (a server that
    exits or stays unready past ``timeout`` seconds raises)."""
    output = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(cmd, env=env, stdout=output, stderr=output)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"server did not become ready in {timeout:.0f} s: {' '.join(cmd)}")
