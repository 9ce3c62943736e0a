"""RBAC: the ClusterRole is valid, and exactly covers what the operator does against the API — every
request of a full scenario (create, drift, update, autoscale, delete) is allowed, every rule is used."""

from __future__ import annotations

import asyncio

import kubernetes_validate
from kopf.testing import KopfRunner
from multiguess_operator.rbac import RULES, allows, cluster_role

from tests.operator.conftest import DEPLOYMENTS, PODS, SERVICES, SPECDEPLOYS, Cluster, eventually
from tests.operator.exporters import exporter, free_port
from tests.operator.test_autoscaler_kmock import load, replicas, target_pod
from tests.operator.test_operator_kmock import specdeploy

VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def test_cluster_role_is_a_valid_manifest() -> None:
    kubernetes_validate.validate(cluster_role(), "1.33", strict=True)
    kubernetes_validate.validate(cluster_role(namespaced_mode=True), "1.33", strict=True)


def operator_requests(cluster: Cluster) -> set[tuple[str, str, str]]:
    """(api group, resource[/subresource], verb) of every request the operator made."""
    used = set()
    for request in cluster:
        if request.resource is None or request.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # discovery, or the test itself acting as a user
        if request.resource.plural is None:
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        if request.method == "GET":
            verb = "watch" if request.params.get("watch") == "true" else "get" if request.name else "list"
        else:
            verb = VERBS[request.method]
        used.add((request.resource.group or "", resource, verb))
    return used


async def test_rules_cover_exactly_what_the_operator_uses(cluster: Cluster, operator: KopfRunner) -> None:
    port = free_port()
    autoscaling = {
        "enabled": True,
        "maxReplicas": 3,
        "intervalSeconds": 1,
        "scaleDownStabilizationSeconds": 0,
    }
    with exporter("127.0.0.7", port) as pod:
        await cluster.create(PODS, target_pod("demo-target-a", "127.0.0.7"))
        await cluster.create(SPECDEPLOYS, specdeploy("demo", autoscaling=autoscaling, serving={"port": port}))
        await eventually(lambda: cluster.get(SERVICES, "default", "demo-draft"), what="children")
        async with load(pod, queue_seconds=3.0):
            await eventually(lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 2, what="autoscaled")
        await cluster.remove(SERVICES, "default", "demo-draft")  # drift → recreate
        await cluster.patch(
            SPECDEPLOYS, "default", "demo", {"metadata": {"labels": {"team": "a"}}}
        )  # → patch all
        await eventually(
            lambda: (
                (cluster.get(SERVICES, "default", "demo-draft") or {})
                .get("metadata", {})
                .get("labels", {})
                .get("team")
                == "a"
            ),
            what="children relabelled",
        )
        await cluster.remove(SPECDEPLOYS, "default", "demo")
        await eventually(lambda: cluster.get(SPECDEPLOYS, "default", "demo") is None, what="deleted")
    await asyncio.sleep(0.5)

    used = operator_requests(cluster)
    denied = sorted(u for u in used if not allows(*u))
    assert denied == [], f"requests the ClusterRole would deny: {denied}"
    granted = {
        (g, r, v) for rule in RULES for g in rule.api_groups for r in rule.resources for v in rule.verbs
    }
    assert sorted(granted - used) == [], "granted but never used: drop them"
