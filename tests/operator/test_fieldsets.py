"""The emulator's server-side apply (tests/operator/fieldsets.py) behaves as kube-apiserver does where
the operator depends on it, and the operator's hand-over (multiguess_operator.ssa) fixes the case
that made removed fields stay on live children."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from multiguess_operator.resources import stamp_hash
from multiguess_operator.ssa import upgrade_patch, upgraded_managed_fields

from tests.operator import fieldsets
from tests.operator.test_resources import children, specs

MANAGER = "multiguess-operator"


def deployment(env: dict[str, str], **pod: Any) -> dict[str, Any]:
    container = {"name": "target", "image": "i", "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": {"template": {"spec": {"containers": [container], **pod}}},
    }


def env_names(obj: dict[str, Any]) -> list[str]:
    return [e["name"] for e in obj["spec"]["template"]["spec"]["containers"][0]["env"]]


def created(obj: dict[str, Any], manager: str = MANAGER) -> dict[str, Any]:
    """What a POST with ``fieldManager`` stores."""
    stored = dict(obj)
    fieldsets.record_update(None, stored, manager, list(fieldsets.paths(obj)), "t0")
    return stored


def test_apply_removes_what_its_manager_applied_before_and_leaves_out_now() -> None:
    first = fieldsets.apply(
        None, deployment({"A": "1", "B": "2"}, nodeSelector={"zone": "a"}), MANAGER, True, "t"
    )
    second = fieldsets.apply(first, deployment({"A": "1"}), MANAGER, True, "t")
    assert env_names(second) == ["A"]
    assert "nodeSelector" not in second["spec"]["template"]["spec"]


def test_fields_created_by_post_survive_an_apply_that_leaves_them_out() -> None:
    """The bug: an object POSTed and then applied keeps what the POST set (the Update entry owns it)."""
    after = fieldsets.apply(
        created(deployment({"A": "1", "B": "2"})), deployment({"A": "1"}), MANAGER, True, "t"
    )
    assert env_names(after) == ["A", "B"]


def test_handing_the_update_entry_over_lets_the_next_apply_remove() -> None:
    stored = created(deployment({"A": "1", "B": "2"}, volumes=[{"name": "cache", "emptyDir": {}}]))
    stored["metadata"]["resourceVersion"] = "7"
    patch = upgrade_patch(stored, MANAGER)
    assert patch is not None and patch[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "7"}
    stored["metadata"]["managedFields"] = patch[1]["value"]
    assert [(e["manager"], e["operation"]) for e in stored["metadata"]["managedFields"]] == [
        (MANAGER, "Apply")
    ]
    wanted = deployment({"A": "1"}, volumes=[{"name": "cache", "persistentVolumeClaim": {"claimName": "m"}}])
    after = fieldsets.apply(stored, wanted, MANAGER, True, "t")
    assert env_names(after) == ["A"]
    assert after["spec"]["template"]["spec"]["volumes"] == [
        {"name": "cache", "persistentVolumeClaim": {"claimName": "m"}}
    ]
    assert upgrade_patch(after, MANAGER) is None


def test_hand_over_merges_into_an_existing_apply_entry_and_keeps_others() -> None:
    entries = [
        {
            "manager": MANAGER,
            "operation": "Update",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {"f:a": {}}},
        },
        {
            "manager": MANAGER,
            "operation": "Apply",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {"f:b": {}}},
        },
        {
            "manager": "kubectl",
            "operation": "Update",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {"f:c": {}}},
        },
        {"manager": MANAGER, "operation": "Update", "subresource": "status", "fieldsV1": {"f:status": {}}},
    ]
    upgraded = upgraded_managed_fields(entries, MANAGER)
    assert upgraded is not None
    assert [(e["manager"], e["operation"], e.get("subresource")) for e in upgraded] == [
        (MANAGER, "Apply", None),
        ("kubectl", "Update", None),
        (MANAGER, "Update", "status"),
    ]
    assert upgraded[0]["fieldsV1"] == {"f:spec": {"f:a": {}, "f:b": {}}}
    assert upgraded_managed_fields(upgraded, MANAGER) is None


def test_another_managers_fields_stay_and_a_forced_apply_takes_conflicting_ones() -> None:
    ours = fieldsets.apply(None, deployment({"A": "1"}), MANAGER, True, "t")
    edited = fieldsets.apply(ours, deployment({"A": "2", "X": "9"}), "kubectl", True, "t")
    assert env_names(edited) == ["A", "X"]
    with pytest.raises(fieldsets.ApplyConflict):
        fieldsets.apply(edited, deployment({"A": "1"}), MANAGER, False, "t")
    restored = fieldsets.apply(edited, deployment({"A": "1"}), MANAGER, True, "t")
    env = restored["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "A", "value": "1"} in env and {"name": "X", "value": "9"} in env


def test_merge_patch_of_two_objects_turns_one_into_the_other() -> None:
    before = {"a": {"b": 1, "c": [1]}, "d": 2}
    after = {"a": {"c": [2]}, "e": 3}
    patch = fieldsets.merge_patch(before, after)
    assert patch == {"a": {"b": None, "c": [2]}, "d": None, "e": 3}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=specs, second=specs)
def test_the_next_apply_leaves_exactly_the_new_manifest(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    """Whatever two specs follow each other, every field the second one does not produce is gone
    from the live Deployment after its apply (and nothing the first one set lingers)."""
    live = None
    for raw in (first, second):
        wanted = stamp_hash(children(raw)["Deployment/demo-target"])
        live = fieldsets.apply(live, wanted, MANAGER, True, "t")
    assert live is not None
    del live["metadata"]["managedFields"]
    assert live == wanted
