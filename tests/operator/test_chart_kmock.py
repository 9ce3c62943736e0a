"""The chart as installed in namespaced mode, end to end in the emulator: real helm renders it with
``operator.namespaces: [llm]`` and the example on, and the operator process runs with the
environment the chart's Deployment gives it (``python -m multiguess_operator``, peering included)
and reconciles the chart's example in the namespace the chart put it in."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from tests.operator.conftest import (
    DEPLOYMENTS,
    SERVICES,
    SPECDEPLOYS,
    Cluster,
    create_namespace,
    eventually,
)
from tests.operator.exporters import free_port
from tests.packaging.helm import by_kind, render
from tests.packaging.tools import require_tool


def chart_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


async def test_the_charts_example_is_reconciled_in_namespaced_mode(
    cluster: Cluster, kubeconfig: Path
) -> None:
    objects = render(require_tool("helm"), set_values=("operator.namespaces={llm}", "example.enabled=true"))
    (example,) = by_kind(objects, "SpeculativeDeployment")
    (peering,) = by_kind(objects, "KopfPeering")
    assert example["metadata"]["namespace"] == peering["metadata"]["namespace"] == "llm"
    env = chart_env(objects)
    assert env["MULTIGUESS_OPERATOR_NAMESPACES"] == "llm" and env["MULTIGUESS_OPERATOR_PEERING"]

    await create_namespace(cluster, "llm")
    await cluster._json("POST", "/apis/kopf.dev/v1/namespaces/llm/kopfpeerings", peering)
    await cluster.create(SPECDEPLOYS, example)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "multiguess_operator",
        env={
            **os.environ,
            **env,
            "KUBECONFIG": str(kubeconfig),
            "MULTIGUESS_OPERATOR_LIVENESS_PORT": str(free_port()),
        },
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        name = example["metadata"]["name"]
        target = await eventually(
            lambda: cluster.get(DEPLOYMENTS, "llm", f"{name}-target"), timeout=45, what="target"
        )
        await eventually(lambda: cluster.get(SERVICES, "llm", name), what="service")
        (container,) = target["spec"]["template"]["spec"]["containers"]
        assert container["image"] == env["MULTIGUESS_OPERATOR_IMAGE"]
        status = await eventually(
            lambda: (cluster.get(SPECDEPLOYS, "llm", name) or {}).get("status"), what="status"
        )
        assert status["endpoint"] == f"http://{name}.llm.svc:8000"
        peered = cluster.get("kopf.dev/v1/kopfpeerings", "llm", peering["metadata"]["name"]) or {}
        assert peered.get("status"), "the operator registered itself in the chart's peering object"
    finally:
        process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, stderr.decode()[-2000:]
