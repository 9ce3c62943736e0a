"""The operator against API-server semantics the emulator now enforces: children written by
server-side apply only (a removed spec field leaves the live child), fields an earlier version
POSTed taken over, refusals in status and events, unknown GPU products, the draft secret, and
watches filtered by the API server."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kopf.testing import KopfRunner
from multiguess_operator.names import MANAGER
from multiguess_operator.resources import desired_children, stamp_hash
from multiguess_operator.spec import parse_spec

from tests.operator.conftest import (
    APPLY,
    DEPLOYMENTS,
    PDBS,
    SECRETS,
    SERVICES,
    SPECDEPLOYS,
    Cluster,
    eventually,
)
from tests.operator.test_operator_kmock import cluster_events, condition, specdeploy

CHILDREN = {"deployments", "services", "poddisruptionbudgets"}
A100, V100 = "NVIDIA-A100-SXM4-40GB", "Tesla-V100-SXM2-16GB"


def target(cluster: Cluster, name: str = "demo") -> dict[str, Any]:
    return cluster.get(DEPLOYMENTS, "default", f"{name}-target") or {}


def pod_of(deployment: Mapping[str, Any]) -> dict[str, Any]:
    return deployment.get("spec", {}).get("template", {}).get("spec", {})  # type: ignore[no-any-return]


def env_names(deployment: Mapping[str, Any]) -> set[str]:
    return {e["name"] for c in pod_of(deployment).get("containers", []) for e in c["env"]}


def operator_writes(cluster: Cluster) -> list[Any]:
    """The operator's own writes (the test's requests carry kmock's User-Agent)."""
    return [
        r
        for r in cluster
        if r.resource is not None
        and r.method in ("POST", "PATCH", "PUT")
        and not r.headers.get("User-Agent", "").startswith("kmock/")
    ]


async def add_gpu_nodes(cluster: Cluster, *products: str) -> None:
    for i, product in enumerate(products):
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": f"gpu-{i}", "labels": {"nvidia.com/gpu.product": product}},
        }
        await cluster._json("POST", "/api/v1/nodes", node)


async def test_children_are_only_applied_and_a_removed_field_leaves_the_live_child(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await add_gpu_nodes(cluster, A100, V100)
    body = specdeploy(
        "demo",
        hfTokenSecret="hf",
        nodeSelector={"zone": "a"},
        modelCache={"emptyDir": {"sizeLimit": "10Gi"}},
        pod={"labels": {"team": "llm"}},
    )
    body["spec"]["target"]["resources"] = {"limits": {"memory": "48Gi"}, "requests": {"memory": "32Gi"}}
    await cluster.create(SPECDEPLOYS, body)
    await eventually(lambda: "HF_TOKEN" in env_names(target(cluster)), what="target with every field")
    await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-draft"), what="draft")
    assert "MULTIGUESS_DRAFT_SECRET" in env_names(target(cluster))

    # Every field above removed or replaced at once: colocated, no token, no selector, no limits, a PVC.
    spec = dict(body["spec"])
    for key in ("hfTokenSecret", "nodeSelector", "pod"):
        spec[key] = None
    spec["target"] = {**spec["target"], "resources": None}
    spec["draft"] = {"model": "org/draft-68m", "placement": "colocated", "gpu": None}
    spec["modelCache"] = {"emptyDir": None, "pvc": "models"}
    await cluster.patch(SPECDEPLOYS, "default", "demo", {"spec": spec})

    def converged() -> bool:
        live = target(cluster)
        cache = next(v for v in pod_of(live)["volumes"] if v["name"] == "model-cache")
        return "persistentVolumeClaim" in cache and cluster.get(DEPLOYMENTS, "default", "demo-draft") is None

    await eventually(converged, what="applied again and draft pruned")
    live = target(cluster)
    pod = pod_of(live)
    assert not {"HF_TOKEN", "MULTIGUESS_DRAFT_URL", "MULTIGUESS_DRAFT_SECRET"} & env_names(live)
    assert "MULTIGUESS_DRAFT_DTYPE" in env_names(live)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": A100}
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache") == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "models"},
    }
    assert "team" not in live["spec"]["template"]["metadata"]["labels"]
    # The live child is exactly what the operator would apply now, no more (beyond server fields).
    (wanted,) = [
        c
        for c in desired_children(
            "demo",
            "default",
            parse_spec(cluster.get(SPECDEPLOYS, "default", "demo")["spec"]),
            "registry.test/multiguess-server:test",
        )  # type: ignore[index]
        if c["kind"] == "Deployment" and c["metadata"]["name"] == "demo-target"
    ]
    assert pod_of(live) == pod_of(stamp_hash(wanted))

    writes = operator_writes(cluster)
    to_children = [r for r in writes if r.resource.plural in CHILDREN]
    assert to_children, "the operator wrote no children"
    for request in to_children:
        assert request.method == "PATCH", f"{request.method} {request.url}: children are only applied"
        assert request.headers["Content-Type"].startswith(APPLY), request.url
        assert request.params["fieldManager"] == MANAGER and request.params["force"] == "true"
    assert {r.resource.plural for r in writes if r.method == "POST"} <= {"secrets", "events"}


async def test_fields_an_earlier_version_created_with_post_are_taken_over(
    cluster: Cluster, operator: KopfRunner
) -> None:
    """A child POSTed by an earlier operator (its fields owned by an Update entry) loses the fields
    the spec no longer asks for at the first pass: the Update entry is handed to the apply manager."""
    old_spec = parse_spec(
        {**specdeploy("demo", hfTokenSecret="hf")["spec"], "draft": {"model": "org/draft-68m"}}
    )
    old = stamp_hash(desired_children("demo", "default", old_spec, "old-image:1")[0])
    old["metadata"]["annotations"]["multiguess.io/desired-hash"] = "from-an-earlier-version"
    async with cluster.request(
        "POST", f"/apis/apps/v1/namespaces/default/deployments?fieldManager={MANAGER}", json=old
    ) as r:
        assert r.status < 400, await r.text()
    assert {e["operation"] for e in target(cluster)["metadata"]["managedFields"]} == {"Update"}

    await cluster.create(SPECDEPLOYS, specdeploy("demo", draft={"model": "org/draft-68m"}))
    await eventually(lambda: "HF_TOKEN" not in env_names(target(cluster)), what="HF_TOKEN removed")
    live = target(cluster)
    assert pod_of(live)["containers"][0]["image"] == "registry.test/multiguess-server:test"
    entries = {(e["manager"], e["operation"]) for e in live["metadata"]["managedFields"]}
    assert (MANAGER, "Update") not in entries and (MANAGER, "Apply") in entries


def team_label_policy(resource: str, obj: Mapping[str, Any]) -> tuple[int, str] | None:
    """A platform team's admission policy: serving pods must say which team they belong to."""
    labels = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    if resource == DEPLOYMENTS and "team" not in labels:
        return 403, 'admission webhook "policy.example.com" denied the request: pods need a "team" label'
    return None


async def test_a_refused_child_is_degraded_with_the_api_message_and_an_event(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await add_gpu_nodes(cluster, A100, V100)
    cluster.policies.append(team_label_policy)
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    degraded = await eventually(
        lambda: (c := condition(cluster, "default", "demo", "Degraded")) and c["status"] == "True" and c,
        what="Degraded",
    )
    assert degraded["reason"] == "ApiRefused"
    assert (
        'pods need a "team" label' in degraded["message"] and "Deployment demo-target" in degraded["message"]
    )
    await eventually(
        lambda: any(
            '"team" label' in e["message"] for e in cluster_events(cluster) if e.get("type") == "Warning"
        ),
        what="warning event",
    )
    assert cluster.get(SERVICES, "default", "demo") is not None  # what was not refused is there

    await cluster.patch(SPECDEPLOYS, "default", "demo", {"spec": {"pod": {"labels": {"team": "llm"}}}})
    await eventually(lambda: target(cluster), what="target once the policy is met")
    await eventually(
        lambda: (condition(cluster, "default", "demo", "Degraded") or {}).get("reason") == "AsExpected",
        what="Degraded cleared",
    )


async def test_an_unknown_gpu_product_is_a_condition(cluster: Cluster, operator: KopfRunner) -> None:
    await add_gpu_nodes(cluster, A100, V100)
    body = specdeploy("demo")
    body["spec"]["target"]["gpu"] = {"products": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H200"]}
    await cluster.create(SPECDEPLOYS, body)
    degraded = await eventually(
        lambda: (c := condition(cluster, "default", "demo", "Degraded")) and c["status"] == "True" and c,
        what="Degraded",
    )
    assert degraded["reason"] == "UnknownGpuProduct"
    assert "NVIDIA-H100-80GB-HBM3, NVIDIA-H200" in degraded["message"] and A100 in degraded["message"]
    assert "draft" not in degraded["message"]  # the V100 draft pool is fine
    assert target(cluster), "children are created anyway: a node may join"


async def test_the_draft_secret_is_created_once_and_never_regenerated(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    secret = await eventually(lambda: cluster.get(SECRETS, "default", "demo-draft-secret"), what="secret")
    value = base64.b64decode(secret["data"]["secret"])
    assert len(value) >= 32
    assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
    await cluster.patch(SPECDEPLOYS, "default", "demo", {"spec": {"replicas": 3}})
    await eventually(lambda: target(cluster).get("spec", {}).get("replicas") == 3, what="another pass")
    await eventually(lambda: cluster.get(PDBS, "default", "demo-draft"), what="draft budget")
    await cluster.remove(PDBS, "default", "demo-draft")  # and another
    await eventually(lambda: cluster.get(PDBS, "default", "demo-draft"), what="budget restored")
    assert cluster.get(SECRETS, "default", "demo-draft-secret") == secret
    ref = {"secretKeyRef": {"name": "demo-draft-secret", "key": "secret"}}
    for name in ("demo-target", "demo-draft"):
        env = {
            e["name"]: e
            for e in pod_of(cluster.get(DEPLOYMENTS, "default", name) or {})["containers"][0]["env"]
        }
        assert env["MULTIGUESS_DRAFT_SECRET"]["valueFrom"] == ref


async def test_child_watches_are_filtered_by_the_api_server(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: cluster.get(SERVICES, "default", "demo"), what="children")
    watches = {
        r.resource.plural: r.params.get("labelSelector")
        for r in cluster
        if r.resource is not None and r.params.get("watch") == "true" and r.resource.plural in CHILDREN
    }
    assert watches == dict.fromkeys(CHILDREN, f"app.kubernetes.io/managed-by={MANAGER}")
