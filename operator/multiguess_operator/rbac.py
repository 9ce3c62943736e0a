"""The operator's RBAC rules as data: the single source for the chart's roles and for the test that
checks them against the API requests the operator really makes.

Two scopes. Watching every namespace, everything is granted by one ClusterRole. Watching a list of
namespaces (``MULTIGUESS_OPERATOR_NAMESPACES``), the namespaced rules go into a Role in each of them
and the ClusterRole keeps only what has no namespace: CRD discovery, the namespace list kopf
follows, and the nodes whose GPU product labels the operator checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiguess_operator.names import GROUP, MANAGER, PLURAL

# Server-side apply is a PATCH; one that creates the object also needs ``create``.
CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
PEERING_GROUP = "kopf.dev"
PEERING_VERBS = ("list", "watch", "patch")


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def allows(self, group: str, resource: str, verb: str) -> bool:
        return group in self.api_groups and resource in self.resources and verb in self.verbs

    def manifest(self) -> dict[str, Any]:
        return {
            "apiGroups": list(self.api_groups),
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }


# Granted in each watched namespace (or cluster-wide when every namespace is watched).
NAMESPACE_RULES: tuple[Rule, ...] = (
    # The custom resource: kopf watches it and patches finalizers and its own annotations.
    Rule((GROUP,), (PLURAL,), ("get", "list", "watch", "patch")),
    Rule((GROUP,), (f"{PLURAL}/status",), ("patch",)),
    Rule((GROUP,), (f"{PLURAL}/scale",), ("patch",)),  # the autoscaler's decision
    # Children, server-side applied and watched for drift.
    Rule(("apps",), ("deployments",), CHILD_VERBS),
    Rule(("",), ("services",), CHILD_VERBS),
    Rule(("policy",), ("poddisruptionbudgets",), CHILD_VERBS),
    # The draft protocol's secret: created once, never read back (no get: secrets stay unreadable).
    Rule(("",), ("secrets",), ("create",)),
    # The autoscaler finds target pods to scrape.
    Rule(("",), ("pods",), ("list",)),
    # Events for notable actions (kopf posts core/v1 events).
    Rule(("",), ("events",), ("create",)),
)

# Cluster-scoped in either mode.
CLUSTER_RULES: tuple[Rule, ...] = (
    # kopf's resource discovery: it follows CRDs while it runs.
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch")),
    # GPU products the cluster has (node labels), so an unknown one is reported.
    Rule(("",), ("nodes",), ("list",)),
)

# Only when MULTIGUESS_OPERATOR_NAMESPACES restricts the operator: kopf then follows namespaces.
NAMESPACED_MODE_RULES: tuple[Rule, ...] = (Rule(("",), ("namespaces",), ("list", "watch")),)

# Leader election (kopf peering): a ClusterKopfPeering when watching everything, else a KopfPeering
# in each watched namespace.
CLUSTER_PEERING = Rule((PEERING_GROUP,), ("clusterkopfpeerings",), PEERING_VERBS)
NAMESPACE_PEERING = Rule((PEERING_GROUP,), ("kopfpeerings",), PEERING_VERBS)

RULES: tuple[Rule, ...] = NAMESPACE_RULES + CLUSTER_RULES + (CLUSTER_PEERING,)


def rules(namespaced_mode: bool) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
    """(cluster-wide rules, per-namespace rules) for one mode."""
    if namespaced_mode:
        return CLUSTER_RULES + NAMESPACED_MODE_RULES, (*NAMESPACE_RULES, NAMESPACE_PEERING)
    return RULES, ()


def allows(group: str, resource: str, verb: str, namespaced_mode: bool = False) -> bool:
    cluster, namespaced = rules(namespaced_mode)
    return any(rule.allows(group, resource, verb) for rule in cluster + namespaced)


def cluster_role(name: str = MANAGER, namespaced_mode: bool = False) -> dict[str, Any]:
    """The ClusterRole manifest (the chart binds it to the operator's ServiceAccount)."""
    cluster, _ = rules(namespaced_mode)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": MANAGER}},
        "rules": [rule.manifest() for rule in cluster],
    }


def namespace_role(namespace: str, name: str = MANAGER) -> dict[str, Any]:
    """The Role of one watched namespace in namespaced mode."""
    _, namespaced = rules(namespaced_mode=True)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": MANAGER}},
        "rules": [rule.manifest() for rule in namespaced],
    }
