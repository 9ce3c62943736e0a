"""Converge one SpeculativeDeployment: children to their desired state, then status from what exists.

Level-based and idempotent: it reads each child, writes only what differs, and can run any number of
times, from any trigger (the resource itself, or an event on one of its children). Children are
written with server-side apply only, so each applied manifest is the whole truth: a field left out
of it is removed from the live object. What the API server refuses is reported, not raised.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from multiguess_operator.kube import CHILD_KINDS, DEPLOYMENTS, NODES, SECRETS, ApiError, Kube
from multiguess_operator.names import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from multiguess_operator.resources import (
    HASH_ANNOTATION,
    desired_children,
    draft_secret,
    endpoint,
    stamp_hash,
)
from multiguess_operator.spec import DeploymentSpec, GpuSpec, SpecError, check_name, parse_spec
from multiguess_operator.ssa import upgrade_patch
from multiguess_operator.status import Problem, Rollout, resource_status

REFUSED = "ApiRefused"
UNKNOWN_GPU = "UnknownGpuProduct"


@dataclass
class Outcome:
    """What one pass did (for events), what went wrong, and the status it observed."""

    status: dict[str, Any]
    error: SpecError | None = None
    actions: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    problems: list[Problem] = field(default_factory=list)


class ChildRefused(Exception):
    """The API server refused to read or write a child; ``current`` is what exists (or None)."""

    def __init__(self, label: str, error: ApiError, current: dict[str, Any] | None) -> None:
        super().__init__(f"{label}: {error}")
        self.current = current


def reconcile(kube: Kube, body: Mapping[str, Any], default_image: str, now: str) -> Outcome:
    """One full pass. An invalid spec leaves existing children alone and is reported, not raised."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    previous = body.get("status") or {}
    try:
        check_name(name)
        spec = parse_spec(body.get("spec") or {})
    except SpecError as error:
        target = Rollout.of(kube.get(DEPLOYMENTS, namespace, f"{name}-target"))
        status = resource_status(name, generation, None, error, target, None, False, previous, now)
        return Outcome(status, error)

    children = desired_children(name, namespace, spec, default_image)
    kopf.adopt(children, owner=dict(body))
    outcome = Outcome(status={})
    if spec.separate_draft is not None:
        outcome.problems += ensure_draft_secret(kube, body, name, namespace)
    observed: dict[str, dict[str, Any] | None] = {}
    for child in children:
        key = f"{child['kind']}/{child['metadata']['name']}"
        try:
            observed[key], action = converge_child(kube, stamp_hash(child))
        except ChildRefused as refused:
            observed[key], action = refused.current, None
            outcome.problems.append(Problem(REFUSED, str(refused)))
        if action:
            outcome.actions.append(action)
    try:
        outcome.actions += prune(kube, name, namespace, set(observed))
    except ApiError as e:
        outcome.problems.append(Problem(REFUSED, f"pruning children: {e}"))
    outcome.problems += gpu_problems(kube, spec)
    target = Rollout.of(observed.get(f"Deployment/{name}-target"))
    draft = Rollout.of(observed.get(f"Deployment/{name}-draft"))
    outcome.status = resource_status(
        name,
        generation,
        endpoint(name, namespace, spec),
        None,
        target,
        draft,
        spec.separate_draft is not None,
        previous,
        now,
        outcome.problems,
    )
    return outcome


def converge_child(
    kube: Kube, desired: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """Apply a missing, outdated or drifted child; leave a matching one untouched.

    Fields an earlier version wrote with POST/PATCH are first handed to the apply manager, so
    the apply can remove what the spec no longer asks for.
    """
    kind = CHILD_KINDS[desired["kind"]]
    meta = desired["metadata"]
    label = f"{desired['kind']} {meta['name']}"
    current: dict[str, Any] | None = None
    try:
        current = kube.get(kind, meta["namespace"], meta["name"])
        if current is None:
            return kube.apply(kind, desired), ("Created", f"created {label}")
        upgrade = upgrade_patch(current, MANAGER)
        if upgrade is not None:
            current = kube.json_patch(kind, meta["namespace"], meta["name"], upgrade)
            return kube.apply(kind, desired), ("Updated", f"updated {label} (took over its fields)")
        wanted_hash = meta["annotations"][HASH_ANNOTATION]
        current_hash = (current.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
        if current_hash == wanted_hash and contains(current, desired):
            return current, None
        reason = "Updated" if current_hash != wanted_hash else "Restored"
        return kube.apply(kind, desired), (reason, f"{reason.lower()} {label}")
    except ApiError as e:
        raise ChildRefused(label, e, current) from e


def ensure_draft_secret(kube: Kube, body: Mapping[str, Any], name: str, namespace: str) -> list[Problem]:
    """Create the draft protocol's random secret if it does not exist; never rewrite it.

    A create, not an apply: only a create fails (409) when the Secret exists, so two passes racing
    can never leave the target and draft pods with different secrets.
    """
    secret = draft_secret(name, namespace, secrets.token_urlsafe(32))
    kopf.adopt(secret, owner=dict(body))
    try:
        kube.create(SECRETS, secret)
    except ApiError as e:
        if e.status != 409:
            return [Problem(REFUSED, f"Secret {secret['metadata']['name']}: {e}")]
    return []


def gpu_problems(kube: Kube, spec: DeploymentSpec) -> list[Problem]:
    """Pools whose GPU products no node carries: their pods would stay Pending without a word."""
    pools: list[tuple[str, GpuSpec]] = [("target", spec.target.gpu)]
    draft = spec.separate_draft
    if draft is not None and draft.gpu is not None:
        pools.append(("draft", draft.gpu))
    problems = []
    known: dict[str, set[str]] = {}
    for role, gpu in pools:
        if gpu.product_label not in known:
            try:
                known[gpu.product_label] = set(kube.labels_of(NODES, gpu.product_label))
            except ApiError:
                return []  # nodes cannot be listed (RBAC): nothing is known, so nothing is claimed
        have = known[gpu.product_label]
        if not have & set(gpu.allowed_products):
            listed = ", ".join(sorted(have)) or "none (is GPU feature discovery labelling them?)"
            problems.append(
                Problem(
                    UNKNOWN_GPU,
                    f"{role}: no node has {gpu.product_label} in [{', '.join(gpu.allowed_products)}] "
                    f"(the nodes have: {listed}); its pods stay Pending until such a node joins",
                )
            )
    return problems


def prune(kube: Kube, name: str, namespace: str, keep: set[str]) -> list[tuple[str, str]]:
    """Delete labelled children that the spec no longer asks for (e.g. the draft after a placement change)."""
    actions = []
    owned = {INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGER}
    for kind_name, kind in CHILD_KINDS.items():
        for obj in kube.list(kind, namespace, owned):
            key = f"{kind_name}/{obj['metadata']['name']}"
            if key not in keep and kube.delete(kind, namespace, obj["metadata"]["name"]):
                actions.append(("Deleted", f"deleted {kind_name} {obj['metadata']['name']}"))
    return actions


def delete_children(kube: Kube, name: str, namespace: str) -> list[str]:
    """Remove every child of a deleted resource (owner references do the same where a GC runs)."""
    return [message for _, message in prune(kube, name, namespace, keep=set())]


def contains(actual: Any, desired: Any) -> bool:
    """True if every field in ``desired`` has the same value in ``actual`` (servers add defaults)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return bool(actual == desired)


def status_changed(previous: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether writing ``status`` would change anything (avoids write → event → write loops)."""
    return not contains(previous, status)
