"""Helpers for tests that run real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import time

import httpx


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Poll ``/health/ready`` until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready within {timeout} s")
