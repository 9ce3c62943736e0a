"""RBAC: the roles are valid, and exactly cover what the operator does against the API — every
request of a full scenario (create, drift, update, autoscale, delete, leader election) is allowed,
every rule is used — watching every namespace (one ClusterRole) and watching a namespace list
(a Role per namespace plus the cluster-scoped rest)."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes_validate
import pytest
from kmock import action
from multiguess_operator.rbac import allows, cluster_role, namespace_role, rules

from tests.operator.conftest import (
    DEPLOYMENTS,
    PEERING,
    PODS,
    SERVICES,
    SPECDEPLOYS,
    Cluster,
    create_namespace,
    create_peering,
    eventually,
    running_operator,
)
from tests.operator.exporters import exporter, free_port
from tests.operator.test_autoscaler_kmock import load, target_pod
from tests.operator.test_operator_kmock import specdeploy

VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def test_roles_are_valid_manifests() -> None:
    kubernetes_validate.validate(cluster_role(), "1.33", strict=True)
    kubernetes_validate.validate(cluster_role(namespaced_mode=True), "1.33", strict=True)
    kubernetes_validate.validate(namespace_role("llm"), "1.33", strict=True)


def operator_requests(cluster: Cluster) -> set[tuple[str | None, str, str, str]]:
    """(namespace, api group, resource[/subresource], verb) of every request the operator made."""
    used = set()
    for request in cluster:
        if request.resource is None or request.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # discovery, or the test itself acting as a user
        if request.resource.plural is None:
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        if request.method == "GET":
            verbs = ["watch" if request.params.get("watch") == "true" else "get" if request.name else "list"]
        else:
            verbs = [VERBS[request.method]]
        if request.method == "PATCH" and request.action == action.CREATE:
            verbs.append("create")  # a server-side apply that created the object
        for verb in verbs:
            used.add((request.namespace, request.resource.group or "", resource, verb))
    return used


def granted(namespaced_mode: bool) -> set[tuple[str, str, str]]:
    cluster, namespaced = rules(namespaced_mode)
    return {
        (g, r, v)
        for rule in cluster + namespaced
        for g in rule.api_groups
        for r in rule.resources
        for v in rule.verbs
    }


async def scenario(cluster: Cluster, namespace: str) -> None:
    """Create, autoscale, drift, relabel, delete: everything the operator does to one resource."""
    port = free_port()
    autoscaling = {
        "enabled": True,
        "maxReplicas": 3,
        "intervalSeconds": 1,
        "scaleDownStabilizationSeconds": 0,
    }
    with exporter("127.0.0.7", port) as pod:
        await cluster.create(
            PODS,
            {
                **target_pod("demo-target-a", "127.0.0.7"),
                "metadata": {**target_pod("demo-target-a", "127.0.0.7")["metadata"], "namespace": namespace},
            },
        )
        body = specdeploy("demo", namespace, autoscaling=autoscaling, serving={"port": port})
        await cluster.create(SPECDEPLOYS, body)
        await eventually(lambda: cluster.get(SERVICES, namespace, "demo-draft"), what="children")
        async with load(pod, queue_seconds=3.0):
            await eventually(
                lambda: (
                    (cluster.get(DEPLOYMENTS, namespace, "demo-target") or {}).get("spec", {}).get("replicas")
                    == 2
                ),
                timeout=30,
                what="autoscaled",
            )
        await cluster.remove(SERVICES, namespace, "demo-draft")  # drift → recreate
        await cluster.patch(
            SPECDEPLOYS, namespace, "demo", {"metadata": {"labels": {"team": "a"}}}
        )  # → patch all

        def relabelled() -> bool:
            labels = (
                (cluster.get(SERVICES, namespace, "demo-draft") or {}).get("metadata", {}).get("labels", {})
            )
            return labels.get("team") == "a"

        await eventually(relabelled, what="children relabelled")
        await cluster.remove(SPECDEPLOYS, namespace, "demo")
        await eventually(lambda: cluster.get(SPECDEPLOYS, namespace, "demo") is None, what="deleted")
    await asyncio.sleep(0.5)


def check(used: set[tuple[str | None, str, str, str]], namespaced_mode: bool, watched: str | None) -> None:
    cluster_rules, namespace_rules = rules(namespaced_mode)
    denied = []
    for namespace, group, resource, verb in sorted(used, key=str):
        by_cluster = any(r.allows(group, resource, verb) for r in cluster_rules)
        by_role = namespace == watched and any(r.allows(group, resource, verb) for r in namespace_rules)
        if not (by_cluster or by_role):
            denied.append((namespace, group, resource, verb))
    assert denied == [], f"requests the roles would deny: {denied}"
    assert all(allows(g, r, v, namespaced_mode) for _, g, r, v in used)
    unused = granted(namespaced_mode) - {(g, r, v) for _, g, r, v in used}
    assert sorted(unused) == [], "granted but never used: drop them"


async def test_cluster_role_covers_exactly_what_the_operator_uses(
    cluster: Cluster, kubeconfig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MULTIGUESS_OPERATOR_IMAGE", "registry.test/multiguess-server:test")
    await create_peering(cluster)
    async with running_operator(["-A", f"--peering={PEERING}", "--priority=100"]):
        await scenario(cluster, "default")
    check(operator_requests(cluster), namespaced_mode=False, watched=None)


async def test_namespaced_roles_cover_exactly_what_the_operator_uses(
    cluster: Cluster, kubeconfig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watching ``llm`` only: namespaced requests go to ``llm`` alone, the rest are cluster-scoped."""
    monkeypatch.setenv("MULTIGUESS_OPERATOR_IMAGE", "registry.test/multiguess-server:test")
    await create_namespace(cluster, "llm")
    await create_peering(cluster, "llm")
    async with running_operator(["--namespace=llm", f"--peering={PEERING}", "--priority=100"]):
        await scenario(cluster, "llm")
    used = operator_requests(cluster)
    assert {ns for ns, *_ in used} <= {"llm", None}
    check(used, namespaced_mode=True, watched="llm")
