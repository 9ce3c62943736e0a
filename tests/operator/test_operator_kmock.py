"""The operator end to end against the Kubernetes emulator: create, update, restore, delete, reject."""

from __future__ import annotations

from typing import Any

from kopf.testing import KopfRunner

from tests.operator.conftest import DEPLOYMENTS, PDBS, SERVICES, SPECDEPLOYS, Cluster, eventually


def specdeploy(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body = {
        "target": {"model": "org/target-7b", "gpu": {"product": "NVIDIA-A100-SXM4-40GB", "count": 2}},
        "draft": {
            "model": "org/draft-68m",
            "placement": "separate",
            "gpu": {"product": "Tesla-V100-SXM2-16GB"},
        },
    }
    body.update(spec)
    return {
        "apiVersion": "multiguess.io/v1alpha1",
        "kind": "SpeculativeDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


async def test_create_builds_pinned_children(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    target = await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-target"), what="target")
    pod = target["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    draft = await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-draft"), what="draft")
    assert (
        draft["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-V100-SXM2-16GB"
    )
    await eventually(lambda: cluster.names(SERVICES, "default") == {"demo", "demo-draft"}, what="services")
    await eventually(lambda: cluster.names(PDBS, "default") == {"demo-target", "demo-draft"}, what="pdbs")
    owner = target["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "SpeculativeDeployment" and owner["name"] == "demo"


def condition(cluster: Cluster, namespace: str, name: str, ctype: str) -> dict[str, Any] | None:
    obj = cluster.get(SPECDEPLOYS, namespace, name) or {}
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond["type"] == ctype:
            return cond  # type: ignore[no-any-return]
    return None


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


async def test_spec_update_rolls_out(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-target"), what="target")
    await cluster.patch(
        SPECDEPLOYS,
        "default",
        "demo",
        {"spec": {"replicas": 3, "speculation": {"numCandidates": 6, "depth": 4, "maxNodes": 24}}},
    )

    def rolled() -> bool:
        target = cluster.get(DEPLOYMENTS, "default", "demo-target") or {}
        return (
            target.get("spec", {}).get("replicas") == 3 and env_of(target)["MULTIGUESS_NUM_CANDIDATES"] == "6"
        )

    await eventually(rolled, what="updated target")
    strategy = cluster.get(DEPLOYMENTS, "default", "demo-target")["spec"]["strategy"]  # type: ignore[index]
    assert strategy["type"] == "RollingUpdate"


async def test_deleted_child_is_recreated_and_edited_child_restored(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: cluster.get(SERVICES, "default", "demo-draft"), what="draft service")
    await cluster.remove(SERVICES, "default", "demo-draft")
    await eventually(lambda: cluster.get(SERVICES, "default", "demo-draft"), what="service recreated")

    await cluster.patch(
        DEPLOYMENTS,
        "default",
        "demo-target",
        {"spec": {"template": {"spec": {"nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}}}}},
    )

    def restored() -> bool:
        target = cluster.get(DEPLOYMENTS, "default", "demo-target") or {}
        selector = target["spec"]["template"]["spec"]["nodeSelector"]
        return selector == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}

    await eventually(restored, what="nodeSelector restored")


async def test_status_follows_the_children(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo", replicas=2))
    await eventually(lambda: condition(cluster, "default", "demo", "Ready"), what="conditions")
    assert condition(cluster, "default", "demo", "Ready")["status"] == "False"  # type: ignore[index]
    # Play the Deployment controller: the pods come up.
    ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
    await cluster.patch(DEPLOYMENTS, "default", "demo-target", {"status": ready}, "status")
    await cluster.patch(
        DEPLOYMENTS,
        "default",
        "demo-draft",
        {"status": {**ready, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
        "status",
    )
    await eventually(
        lambda: (condition(cluster, "default", "demo", "Ready") or {}).get("status") == "True",
        what="Ready=True",
    )
    status = cluster.get(SPECDEPLOYS, "default", "demo")["status"]  # type: ignore[index]
    assert status["readyReplicas"] == 2 and status["replicas"] == 2
    assert status["endpoint"] == "http://demo.default.svc:8000"
    assert "app.kubernetes.io/instance=demo" in status["selector"]
    assert condition(cluster, "default", "demo", "Progressing")["status"] == "False"  # type: ignore[index]
    await eventually(lambda: "Created" in {e["reason"] for e in cluster_events(cluster)}, what="events")


def cluster_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [obj.raw for (res, _, _), obj in cluster.objects.items() if res.plural == "events"]


async def test_delete_removes_every_child(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: len(cluster.names(PDBS, "default")) == 2, what="children")
    await cluster.remove(SPECDEPLOYS, "default", "demo")
    await eventually(lambda: cluster.get(SPECDEPLOYS, "default", "demo") is None, what="finalizer released")
    assert cluster.names(DEPLOYMENTS, "default") == set()
    assert cluster.names(SERVICES, "default") == set()
    assert cluster.names(PDBS, "default") == set()


async def test_placement_change_prunes_the_draft(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "demo-draft"), what="draft")
    await cluster.patch(
        SPECDEPLOYS,
        "default",
        "demo",
        {"spec": {"draft": {"model": "org/draft-68m", "placement": "colocated", "gpu": None}}},
    )
    await eventually(lambda: cluster.names(DEPLOYMENTS, "default") == {"demo-target"}, what="draft pruned")
    await eventually(lambda: cluster.names(SERVICES, "default") == {"demo"}, what="draft service pruned")
    await eventually(lambda: cluster.names(PDBS, "default") == {"demo-target"}, what="draft budget pruned")
    assert "MULTIGUESS_DRAFT_URL" not in env_of(cluster.get(DEPLOYMENTS, "default", "demo-target"))  # type: ignore[arg-type]


async def test_invalid_spec_is_a_condition_and_others_keep_working(
    cluster: Cluster, operator: KopfRunner
) -> None:
    bad = specdeploy("bad", autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2})
    await cluster.create(SPECDEPLOYS, bad)
    await cluster.create(SPECDEPLOYS, specdeploy("good"))
    ready = await eventually(lambda: condition(cluster, "default", "bad", "Ready"), what="bad condition")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "minReplicas must not exceed" in ready["message"]
    await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "good-target"), what="good target")
    assert cluster.get(DEPLOYMENTS, "default", "bad-target") is None
    await eventually(  # kopf posts events from a queue, a moment after the handler
        lambda: any(
            "minReplicas" in e["message"] for e in cluster_events(cluster) if e.get("type") == "Warning"
        ),
        what="warning event",
    )
    # Fixing the spec recovers.
    await cluster.patch(SPECDEPLOYS, "default", "bad", {"spec": {"autoscaling": {"minReplicas": 1}}})
    await eventually(lambda: cluster.get(DEPLOYMENTS, "default", "bad-target"), what="fixed target")


async def test_two_namespaces_stay_independent(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo", "team-a"))
    await cluster.create(SPECDEPLOYS, specdeploy("demo", "team-b", replicas=4))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "team-a", "demo-target"), what="team-a")
    await eventually(lambda: cluster.get(DEPLOYMENTS, "team-b", "demo-target"), what="team-b")
    assert cluster.get(DEPLOYMENTS, "team-a", "demo-target")["spec"]["replicas"] == 1  # type: ignore[index]
    assert cluster.get(DEPLOYMENTS, "team-b", "demo-target")["spec"]["replicas"] == 4  # type: ignore[index]
    await cluster.remove(SPECDEPLOYS, "team-a", "demo")
    await eventually(lambda: cluster.names(DEPLOYMENTS, "team-a") == set(), what="team-a cleaned")
    assert cluster.names(DEPLOYMENTS, "team-b") == {"demo-target", "demo-draft"}
    assert cluster.get(SPECDEPLOYS, "team-b", "demo") is not None
