"""What a machine lacks to run an end-to-end test; the e2e test skips with exactly this reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

SCRIPTS = {"kind": "kind.sh", "minikube": "minikube.sh"}


def docker_engine_answers() -> bool:
    """A docker client alone is not enough: `docker info` needs a running engine."""
    if shutil.which("docker") is None:
        return False
    try:
        return (
            subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0
        )
    except subprocess.TimeoutExpired:
        return False


def missing(
    cluster: str,
    mode: str,
    which: Callable[[str], str | None] = shutil.which,
    engine: Callable[[], bool] = docker_engine_answers,
) -> str | None:
    """None when `cluster` in `mode` can run here, else why not (the probes are parameters)."""
    if cluster not in SCRIPTS or mode not in ("cpu", "gpu"):
        raise ValueError(f"unknown cluster/mode {cluster}/{mode}")
    needed = ["docker", cluster]
    if mode == "gpu":
        needed.append("nvidia-smi")
        if cluster == "kind":
            needed.append("nvkind")
    absent = [tool for tool in needed if which(tool) is None]
    if absent:
        return f"{cluster} e2e ({mode}) needs {', '.join(absent)} on PATH"
    if not engine():
        return f"{cluster} e2e ({mode}) needs a running Docker engine: `docker info` failed"
    return None


def images_missing(
    which: Callable[[str], str | None] = shutil.which,
    is_root: Callable[[], bool] = lambda: os.geteuid() == 0,
    engine: Callable[[], bool] = docker_engine_answers,
) -> str | None:
    """None when scripts/images/e2e.sh can run here, else why not: it needs a docker client and
    debootstrap, and an engine that answers or one it can start itself (dockerd, as root)."""
    absent = [tool for tool in ("docker", "debootstrap") if which(tool) is None]
    if absent:
        return f"images e2e needs {', '.join(absent)} on PATH (apt-get install docker.io debootstrap)"
    if engine():
        return None
    if which("dockerd") is None:
        return "images e2e needs a Docker engine: none answers and dockerd is not installed"
    if not is_root():
        return "images e2e needs root to start dockerd (no engine answers)"
    return None
