"""The operator end to end against the Kubernetes emulator: create, update, restore, delete, reject."""

from __future__ import annotations

from typing import Any

from kopf.testing import KopfRunner

from tests.operator.conftest import DEPLOYMENTS, PDBS, SERVICES, SPECDEPLOYS, Cluster, eventually


def specdeploy(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body = {
        "target": {"model": "org/target-7b", "gpu": {"product": "NVIDIA-A100-SXM4-40GB", "count": 2}},
        "draft": {
            "model": "org/draft-68m",
            "placement": "separate",
            "gpu": {"product": "Tesla-V100-SXM2-16GB"},
        },
    }
    body.update(spec)
    return {
        "apiVersion": "multiguess.io/v1alpha1",
        "kind": "SpeculativeDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


async def test_create_builds_pinned_children(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    target = await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-target"), what="target")
    pod = target["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    draft = await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-draft"), what="draft")
    assert (
        draft["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-V100-SXM2-16GB"
    )
    await eventually(lambda: cluster.names(SERVICES, "default") == {"demo", "demo-draft"}, what="services")
    await eventually(lambda: cluster.names(PDBS, "default") == {"demo-target", "demo-draft"}, what="pdbs")
    owner = target["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "SpeculativeDeployment" and owner["name"] == "demo"
