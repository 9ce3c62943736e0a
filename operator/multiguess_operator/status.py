"""Children's observed state → the custom resource's status (pure): conditions, replicas, endpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multiguess_operator.resources import selector_string
from multiguess_operator.spec import SpecError

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class Rollout:
    """What one child Deployment reports about itself."""

    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    observed_current: bool = True  # the Deployment controller has seen the latest template
    stuck: str | None = None  # message of a failed rollout (ProgressDeadlineExceeded, ReplicaFailure)

    @classmethod
    def of(cls, deployment: Mapping[str, Any] | None) -> Rollout | None:
        if deployment is None:
            return None
        spec, status = deployment.get("spec", {}), deployment.get("status") or {}
        stuck = None
        for cond in status.get("conditions") or []:
            failed_progress = (
                cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded"
            )
            if failed_progress or (cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"):
                stuck = cond.get("message") or cond.get("reason") or cond["type"]
        generation = deployment.get("metadata", {}).get("generation")
        observed = status.get("observedGeneration")
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
            observed_current=generation is None or observed is None or observed >= generation,
            stuck=stuck,
        )

    @property
    def settled(self) -> bool:
        return self.observed_current and self.updated >= self.desired and self.ready >= self.desired


def conditions(
    error: SpecError | None,
    target: Rollout | None,
    draft: Rollout | None,
    needs_draft: bool,
) -> dict[str, tuple[bool, str, str]]:
    """Each condition type → (status, reason, message), from the spec check and the two rollouts."""
    if error is not None:
        return {
            "Ready": (False, error.reason, error.message),
            "Progressing": (False, error.reason, "the spec is invalid; nothing is rolled out"),
            "Degraded": (True, error.reason, error.message),
        }
    if target is None or (needs_draft and draft is None):
        missing = "target" if target is None else "draft"
        return {
            "Ready": (False, "ChildrenMissing", f"the {missing} Deployment does not exist yet"),
            "Progressing": (True, "Creating", "creating children"),
            "Degraded": (False, "AsExpected", ""),
        }
    parts = [("target", target)] + ([("draft", draft)] if needs_draft and draft is not None else [])
    stuck = [f"{role}: {r.stuck}" for role, r in parts if r.stuck]
    unavailable = [role for role, r in parts if r.desired > 0 and r.ready == 0]
    moving = [role for role, r in parts if not r.settled]
    if target.desired == 0:
        ready = (False, "ScaledToZero", "spec.replicas is 0")
    elif unavailable:
        ready = (False, "PodsNotReady", f"no ready pods: {', '.join(unavailable)}")
    else:
        ready = (True, "PodsReady", f"{target.ready}/{target.desired} target pods ready")
    if moving:
        progressing = (True, "RollingOut", f"rolling out: {', '.join(moving)}")
    else:
        progressing = (False, "Complete", "all pods are up to date")
    # Pods that are still starting (model loading takes minutes) are progress, not degradation; the
    # Deployment controller's own deadline (ProgressDeadlineExceeded) is what marks a failure.
    degraded = (True, "RolloutFailed", "; ".join(stuck)) if stuck else (False, "AsExpected", "")
    return {"Ready": ready, "Progressing": progressing, "Degraded": degraded}


def render_conditions(
    values: Mapping[str, tuple[bool, str, str]],
    previous: Sequence[Mapping[str, Any]],
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """Conditions in API form; lastTransitionTime only moves when a condition's status flips."""
    before = {c.get("type"): c for c in previous}
    result = []
    for ctype in CONDITION_TYPES:
        ok, reason, message = values[ctype]
        status = "True" if ok else "False"
        old = before.get(ctype)
        since = (
            old["lastTransitionTime"]
            if old and old.get("status") == status and "lastTransitionTime" in old
            else now
        )
        cond: dict[str, Any] = {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        result.append(cond)
    return result


def resource_status(
    name: str,
    generation: int | None,
    endpoint: str | None,
    error: SpecError | None,
    target: Rollout | None,
    draft: Rollout | None,
    needs_draft: bool,
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """The full ``status`` this operator owns (the autoscaler owns ``status.autoscaling``)."""
    values = conditions(error, target, draft, needs_draft)
    desired = target.desired if target else 0
    ready = target.ready if target else 0
    status: dict[str, Any] = {
        "conditions": render_conditions(values, previous.get("conditions") or [], generation, now),
        "replicas": target.replicas if target else 0,
        "readyReplicas": ready,
        "replicaSummary": f"{ready}/{desired}",
        "selector": selector_string(name),
    }
    if endpoint is not None:
        status["endpoint"] = endpoint
    if generation is not None:
        status["observedGeneration"] = generation
    return status
