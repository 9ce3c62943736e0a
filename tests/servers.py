"""Helpers for tests that run real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(url: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> None:
    """Poll ``/health/ready`` until it answers 200; fail at once if ``process`` (the server's,
    when it runs in its own) exits, with what it printed when that was piped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise RuntimeError(
                f"the server for {url} exited with {process.returncode} before it was ready\n{output}"
            )
        try:
            if httpx.get(f"{url}/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready within {timeout} s")
