"""Status from the children (pure): Ready/Progressing/Degraded for each rollout situation, and
lastTransitionTime that only moves when a condition flips."""

from __future__ import annotations

from typing import Any

import pytest
from multiguess_operator.spec import SpecError
from multiguess_operator.status import Problem, Rollout, conditions, render_conditions, resource_status


def deployment(
    desired: int,
    ready: int,
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
    stuck: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "replicas": max(desired, ready),
        "readyReplicas": ready,
        "updatedReplicas": desired if updated is None else updated,
        "observedGeneration": observed,
    }
    if stuck:
        status["conditions"] = [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet has timed out progressing",
            }
        ]
    return {"metadata": {"generation": generation}, "spec": {"replicas": desired}, "status": status}


def flags(values: dict[str, tuple[bool, str, str]]) -> tuple[tuple[bool, str], ...]:
    return tuple((values[t][0], values[t][1]) for t in ("Ready", "Progressing", "Degraded"))


@pytest.mark.parametrize(
    ("target", "draft", "expected"),
    [
        (deployment(2, 2), None, ((True, "PodsReady"), (False, "Complete"), (False, "AsExpected"))),
        (
            deployment(2, 0, updated=0),
            None,
            ((False, "PodsNotReady"), (True, "RollingOut"), (False, "AsExpected")),
        ),
        (deployment(3, 2), None, ((True, "PodsReady"), (True, "RollingOut"), (False, "AsExpected"))),
        (
            deployment(2, 2, generation=2, observed=1),
            None,
            ((True, "PodsReady"), (True, "RollingOut"), (False, "AsExpected")),
        ),
        (
            deployment(2, 1, stuck=True),
            None,
            ((True, "PodsReady"), (True, "RollingOut"), (True, "RolloutFailed")),
        ),
        (deployment(0, 0), None, ((False, "ScaledToZero"), (False, "Complete"), (False, "AsExpected"))),
    ],
)
def test_conditions_of_a_target_rollout(
    target: dict[str, Any], draft: Any, expected: tuple[Any, ...]
) -> None:
    assert flags(conditions(None, Rollout.of(target), draft, needs_draft=False)) == expected


def test_a_draft_that_is_down_degrades_but_targets_stay_ready() -> None:
    """Targets serve without speculation while no draft pod is ready: Degraded, still Ready."""
    target = Rollout.of(deployment(2, 2))
    down = conditions(None, target, Rollout.of(deployment(1, 0, updated=1)), needs_draft=True)
    assert flags(down) == ((True, "PodsReady"), (True, "RollingOut"), (True, "DraftUnavailable"))
    assert "without speculation" in down["Degraded"][2]
    missing = conditions(None, target, None, needs_draft=True)
    assert flags(missing)[0] == (True, "PodsReady") and flags(missing)[2] == (True, "DraftUnavailable")
    up = conditions(None, target, Rollout.of(deployment(1, 1)), needs_draft=True)
    assert flags(up) == ((True, "PodsReady"), (False, "Complete"), (False, "AsExpected"))


def test_everything_starting_is_progress_not_degradation() -> None:
    starting = Rollout.of(deployment(1, 0, updated=1))
    values = conditions(None, Rollout.of(deployment(2, 0, updated=2)), starting, needs_draft=True)
    assert flags(values) == ((False, "PodsNotReady"), (True, "RollingOut"), (False, "AsExpected"))


def test_problems_degrade_with_the_api_message() -> None:
    refused = Problem("ApiRefused", "Deployment demo-target: HTTP 422: spec.template...: Forbidden: x")
    gpu = Problem("UnknownGpuProduct", "target: no node has nvidia.com/gpu.product in [H100]")
    values = conditions(None, Rollout.of(deployment(1, 1)), None, False, [refused, gpu])
    assert values["Ready"][0] is True
    assert values["Degraded"] == (True, "ApiRefused", f"{refused.message}; {gpu.message}")
    missing = conditions(None, None, None, False, [refused])
    assert missing["Degraded"] == (True, "ApiRefused", refused.message)


def test_invalid_spec_wins() -> None:
    error = SpecError("InvalidSpec", "speculation.maxNodes must be at least speculation.depth")
    values = conditions(error, Rollout.of(deployment(1, 1)), None, needs_draft=False)
    assert flags(values) == ((False, "InvalidSpec"), (False, "InvalidSpec"), (True, "InvalidSpec"))
    assert values["Ready"][2] == error.message


def test_transition_time_moves_only_on_a_flip() -> None:
    first = render_conditions(
        conditions(None, Rollout.of(deployment(1, 0, updated=0)), None, False), [], 1, "t1"
    )
    same = render_conditions(
        conditions(None, Rollout.of(deployment(1, 0, updated=0)), None, False), first, 2, "t2"
    )
    flipped = render_conditions(conditions(None, Rollout.of(deployment(1, 1)), None, False), same, 2, "t3")
    ready = [{c["type"]: c for c in conds}["Ready"] for conds in (first, same, flipped)]
    assert [r["lastTransitionTime"] for r in ready] == ["t1", "t1", "t3"]
    assert [r["observedGeneration"] for r in ready] == [1, 2, 2]


def test_resource_status_summarises_replicas() -> None:
    status = resource_status(
        "demo", 4, "http://demo.ns.svc:8000", None, Rollout.of(deployment(3, 2)), None, False, {}, "now"
    )
    assert (status["replicas"], status["readyReplicas"], status["replicaSummary"]) == (3, 2, "2/3")
    assert status["observedGeneration"] == 4 and status["endpoint"] == "http://demo.ns.svc:8000"
