"""Converge one SpeculativeDeployment: children to their desired state, then status from what exists.

Level-based and idempotent: it reads each child, writes only what differs, and can run any number of
times, from any trigger (the resource itself, or an event on one of its children).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from multiguess_operator.kube import CHILD_KINDS, DEPLOYMENTS, ApiError, Kube
from multiguess_operator.names import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from multiguess_operator.resources import HASH_ANNOTATION, desired_children, endpoint, stamp_hash
from multiguess_operator.spec import SpecError, check_name, parse_spec
from multiguess_operator.status import Rollout, resource_status


@dataclass
class Outcome:
    """What one pass did (for events) and the status it observed."""

    status: dict[str, Any]
    error: SpecError | None = None
    actions: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)


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
    observed: dict[str, dict[str, Any]] = {}
    for child in children:
        current, action = converge_child(kube, stamp_hash(child))
        observed[f"{child['kind']}/{child['metadata']['name']}"] = current
        if action:
            outcome.actions.append(action)
    outcome.actions += prune(kube, name, namespace, set(observed))
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
    )
    return outcome


def converge_child(kube: Kube, desired: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """Create a missing child, re-apply a drifted or outdated one, leave a matching one untouched."""
    kind = CHILD_KINDS[desired["kind"]]
    meta = desired["metadata"]
    label = f"{desired['kind']} {meta['name']}"
    current = kube.get(kind, meta["namespace"], meta["name"])
    if current is None:
        try:
            return kube.create(kind, desired), ("Created", f"created {label}")
        except ApiError as e:
            if e.status != 409:  # 409: created concurrently by another trigger; apply over it
                raise
            return kube.apply(kind, desired), None
    wanted_hash = meta["annotations"][HASH_ANNOTATION]
    current_hash = (current.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
    if current_hash == wanted_hash and contains(current, desired):
        return current, None
    reason = "Updated" if current_hash != wanted_hash else "Restored"
    return kube.apply(kind, desired), (reason, f"{reason.lower()} {label}")


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
