"""The operator's ClusterRole rules as data: the single source for the chart's ClusterRole and for
the test that checks them against the API requests the operator really makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiguess_operator.names import GROUP, MANAGER, PLURAL

CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")


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


RULES: tuple[Rule, ...] = (
    # The custom resource: kopf watches it and patches finalizers and its own annotations.
    Rule((GROUP,), (PLURAL,), ("get", "list", "watch", "patch")),
    Rule((GROUP,), (f"{PLURAL}/status",), ("patch",)),
    Rule((GROUP,), (f"{PLURAL}/scale",), ("patch",)),  # the autoscaler's decision
    # Children, reconciled and watched for drift.
    Rule(("apps",), ("deployments",), CHILD_VERBS),
    Rule(("",), ("services",), CHILD_VERBS),
    Rule(("policy",), ("poddisruptionbudgets",), CHILD_VERBS),
    # The autoscaler finds target pods to scrape.
    Rule(("",), ("pods",), ("list",)),
    # Events for notable actions (kopf posts core/v1 events).
    Rule(("",), ("events",), ("create",)),
    # kopf's resource discovery: it follows CRDs while it runs.
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch")),
)


# Only when MULTIGUESS_OPERATOR_NAMESPACES restricts the operator: kopf then follows namespaces.
NAMESPACED_MODE_RULES: tuple[Rule, ...] = (Rule(("",), ("namespaces",), ("list", "watch")),)


# Only when MULTIGUESS_OPERATOR_NAMESPACES restricts the operator: kopf then follows namespaces.
NAMESPACED_MODE_RULES: tuple[Rule, ...] = (Rule(("",), ("namespaces",), ("list", "watch")),)


def allows(group: str, resource: str, verb: str) -> bool:
    return any(rule.allows(group, resource, verb) for rule in RULES)


def cluster_role(name: str = MANAGER, namespaced_mode: bool = False) -> dict[str, Any]:
    """The ClusterRole manifest (the chart binds it to the operator's ServiceAccount)."""
    rules = RULES + (NAMESPACED_MODE_RULES if namespaced_mode else ())
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": MANAGER}},
        "rules": [rule.manifest() for rule in rules],
    }
