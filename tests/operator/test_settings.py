"""Operator settings from the environment, and the `python -m multiguess_operator` entry point."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from multiguess_operator.settings import DEFAULT_IMAGE, Settings, SettingsError

from tests.operator.conftest import DEPLOYMENTS, SPECDEPLOYS, Cluster, eventually
from tests.operator.exporters import free_port
from tests.operator.test_operator_kmock import specdeploy


def test_defaults() -> None:
    assert Settings.from_env({}) == Settings(DEFAULT_IMAGE, (), "plain", 8080)


def test_values() -> None:
    env = {
        "MULTIGUESS_OPERATOR_IMAGE": "reg/img:2",
        "MULTIGUESS_OPERATOR_NAMESPACES": " a, b ,,",
        "MULTIGUESS_OPERATOR_LOG_FORMAT": "JSON",
        "MULTIGUESS_OPERATOR_LIVENESS_PORT": "9090",
        "MULTIGUESS_OPERATOR_PEERING": "multiguess",
        "MULTIGUESS_OPERATOR_PRIORITY": "7",
    }
    assert Settings.from_env(env) == Settings("reg/img:2", ("a", "b"), "json", 9090, "multiguess", 7)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("MULTIGUESS_OPERATOR_LOG_FORMAT", "xml"),
        ("MULTIGUESS_OPERATOR_LIVENESS_PORT", "http"),
        ("MULTIGUESS_OPERATOR_PRIORITY", "high"),
    ],
)
def test_bad_values_are_clear_errors(key: str, value: str) -> None:
    with pytest.raises(SettingsError, match=key):
        Settings.from_env({key: value})


async def test_python_dash_m_runs_the_operator(cluster: Cluster, kubeconfig: Path) -> None:
    """The container's command, as a real process: it reconciles and answers its liveness probe."""
    port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "MULTIGUESS_OPERATOR_LIVENESS_PORT": str(port),
        "MULTIGUESS_OPERATOR_IMAGE": "reg/multiguess:9",
        "MULTIGUESS_OPERATOR_LOG_FORMAT": "json",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "multiguess_operator",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await cluster.create(SPECDEPLOYS, specdeploy("demo"))
        target = await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-target"), timeout=30)
        assert target["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/multiguess:9"

        async def live() -> bool:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/healthz") as r,
            ):
                return r.status == 200

        assert await eventually(live, timeout=10)
    finally:
        process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=20)
    assert b'"message"' in stderr  # JSON log lines
