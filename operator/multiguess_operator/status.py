"""Children's observed state → the custom resource's status (pure): conditions, replicas, endpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multiguess_operator.resources import selector_string
from multiguess_operator.spec import SpecError

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class Problem:
    """Something that makes the resource Degraded: a refused write, an unknown GPU product."""

    reason: str
    message: str


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
    problems: Sequence[Problem] = (),
) -> dict[str, tuple[bool, str, str]]:
    """Each condition type → (status, reason, message), from the spec check, the two rollouts and
    the problems the pass met. ``Ready`` is about the API (the target pods): targets serve, without
    speculation, while the draft is down, which is ``Degraded``."""
    if error is not None:
        return {
            "Ready": (False, error.reason, error.message),
            "Progressing": (False, error.reason, "the spec is invalid; nothing is rolled out"),
            "Degraded": (True, error.reason, error.message),
        }
    found = list(problems)  # first: the condition's reason is the first problem's
    if target is None:
        return {
            "Ready": (False, "ChildrenMissing", "the target Deployment does not exist yet"),
            "Progressing": (True, "Creating", "creating children"),
            "Degraded": _degraded(found),
        }
    parts = [("target", target)] + ([("draft", draft)] if needs_draft and draft is not None else [])
    stuck = [Problem("RolloutFailed", f"{role}: {r.stuck}") for role, r in parts if r.stuck]
    moving = [role for role, r in parts if not r.settled]
    if target.desired == 0:
        ready = (False, "ScaledToZero", "spec.replicas is 0")
    elif target.ready == 0:
        ready = (False, "PodsNotReady", "no ready pods: target")
    else:
        ready = (True, "PodsReady", f"{target.ready}/{target.desired} target pods ready")
        # Pods that are still starting (model loading takes minutes) are progress, not degradation;
        # but targets that serve while no draft pod does decode without speculation.
        if needs_draft and (draft is None or (draft.desired > 0 and draft.ready == 0)):
            missing = "does not exist" if draft is None else "has no ready pods"
            found.append(
                Problem("DraftUnavailable", f"the draft {missing}: targets decode without speculation")
            )
    if moving or (needs_draft and draft is None):
        progressing = (True, "RollingOut", f"rolling out: {', '.join(moving) or 'draft'}")
    else:
        progressing = (False, "Complete", "all pods are up to date")
    # The Deployment controller's own deadline (ProgressDeadlineExceeded) marks a failed rollout.
    return {
        "Ready": ready,
        "Progressing": progressing,
        "Degraded": _degraded(found[: len(problems)] + stuck + found[len(problems) :]),
    }


def _degraded(problems: Sequence[Problem]) -> tuple[bool, str, str]:
    """Degraded: the first problem's reason, every problem's message."""
    if not problems:
        return (False, "AsExpected", "")
    return (True, problems[0].reason, "; ".join(p.message for p in problems))


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
    problems: Sequence[Problem] = (),
) -> dict[str, Any]:
    """The full ``status`` this operator owns (the autoscaler owns ``status.autoscaling``)."""
    values = conditions(error, target, draft, needs_draft, problems)
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
