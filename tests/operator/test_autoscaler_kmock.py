"""Autoscaling end to end: the real operator in the emulator scrapes real exporters on 127.0.0.x
(standing in for target pods), writes the scale subresource, and the target Deployment follows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import kubernetes.config
from kopf._cogs.aiokits.aioenums import FlagSetter  # what kopf hands a daemon as ``stopped``
from kopf.testing import KopfRunner
from multiguess_operator.handlers import autoscale
from multiguess_operator.resources import selector

from tests.operator.conftest import DEPLOYMENTS, PODS, SPECDEPLOYS, Cluster, eventually
from tests.operator.exporters import Exporter, exporter, free_port
from tests.operator.test_operator_kmock import cluster_events, specdeploy


def target_pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": selector("demo", "target")},
        "spec": {"containers": [{"name": "target", "image": "x"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


@contextlib.asynccontextmanager
async def load(pod: Exporter, queue_seconds: float) -> AsyncIterator[None]:
    """Requests that each waited ``queue_seconds`` in the queue, ten per 0.1 s, until the block ends."""

    async def produce() -> None:
        while True:
            for _ in range(10):
                pod.queue.observe(queue_seconds)
            await asyncio.sleep(0.1)

    task = asyncio.create_task(produce())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def replicas(cluster: Cluster, resource: str, name: str) -> int | None:
    obj = cluster.get(resource, "default", name)
    return None if obj is None else obj["spec"]["replicas"]


async def test_queue_latency_scales_up_and_back_down(cluster: Cluster, operator: KopfRunner) -> None:
    port = free_port()
    autoscaling = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueLatencySeconds": 0.5,
        "intervalSeconds": 1,
        "scaleDownStabilizationSeconds": 3,
    }
    body = specdeploy("demo", replicas=1, autoscaling=autoscaling, serving={"port": port})
    with exporter("127.0.0.2", port) as first, exporter("127.0.0.3", port):
        await cluster.create(PODS, target_pod("demo-target-a", "127.0.0.2"))
        await cluster.create(SPECDEPLOYS, body)
        await eventually(
            lambda: (
                (cluster.get(SPECDEPLOYS, "default", "demo") or {})
                .get("status", {})
                .get("autoscaling", {})
                .get("scrapedPods")
                == 1
            ),
            what="first scrape",
        )

        async with load(first, queue_seconds=2.0):  # p95 of 2 s against a 0.5 s target
            await eventually(lambda: replicas(cluster, SPECDEPLOYS, "demo") == 2, what="scale-up", timeout=10)
            await eventually(
                lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 2, what="deployment follows"
            )
            await cluster.create(PODS, target_pod("demo-target-b", "127.0.0.3"))

        # Load stops: the signal drops to zero, and after the 3 s window the replicas go back to 1.
        await eventually(lambda: replicas(cluster, SPECDEPLOYS, "demo") == 1, what="scale-down", timeout=15)
        await eventually(
            lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 1, what="deployment follows"
        )

    status = cluster.get(SPECDEPLOYS, "default", "demo")["status"]["autoscaling"]  # type: ignore[index]
    reasons = [h["reason"] for h in status["history"]]
    assert "ScaleUp" in reasons or "ScaleUpLimited" in reasons
    assert "ScaleDownStabilized" in reasons and "ScaleDown" in reasons
    assert reasons.index("ScaleDownStabilized") < reasons.index("ScaleDown")  # waited for the window
    assert status["lastScaleTime"]
    await eventually(lambda: {"ScaledUp", "ScaledDown"} <= {e["reason"] for e in cluster_events(cluster)})


async def test_unreachable_pods_are_reported_and_block_scale_down(
    cluster: Cluster, operator: KopfRunner
) -> None:
    port = free_port()
    autoscaling = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 4,
        "intervalSeconds": 1,
        "scaleDownStabilizationSeconds": 0,
    }
    await cluster.create(PODS, target_pod("demo-target-a", "127.0.0.6"))  # nothing listens there
    await cluster.create(
        SPECDEPLOYS, specdeploy("demo", replicas=3, autoscaling=autoscaling, serving={"port": port})
    )

    def reported() -> dict[str, Any] | None:
        auto = (cluster.get(SPECDEPLOYS, "default", "demo") or {}).get("status", {}).get("autoscaling", {})
        return auto if auto.get("unreachablePods") else None

    status = await eventually(reported, what="unreachable pod in status")
    assert status["unreachablePods"][0].startswith("demo-target-a:")
    assert status["reason"] == "NoMetrics"
    await asyncio.sleep(2.5)  # a few more rounds: still no scale-down without metrics
    assert replicas(cluster, SPECDEPLOYS, "demo") == 3


async def test_kubectl_scale_works_when_autoscaling_is_off(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create(SPECDEPLOYS, specdeploy("demo"))
    await eventually(lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 1, what="target")
    # What `kubectl scale specdeploy/demo --replicas=3` sends: a Scale patch to the subresource.
    await cluster.patch(SPECDEPLOYS, "default", "demo", {"spec": {"replicas": 3}}, "scale")
    await eventually(lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 3, what="deployment scaled")
    status = await eventually(lambda: (cluster.get(SPECDEPLOYS, "default", "demo") or {}).get("status"))
    assert status["selector"].count("=") == 3  # the scale subresource's labelSelectorPath
    assert "autoscaling" not in status


def tasks_beside_a_paused_autoscaler(cluster: Cluster, body: dict[str, Any]) -> list[str]:
    """Run the autoscale daemon in a loop of its own, as kopf does, and name the tasks that loop
    holds besides the daemon once the first round is written and the daemon pauses."""

    async def run() -> list[str]:
        kubernetes.config.load_kube_config()  # what the operator's login handler does
        stopped = FlagSetter[kopf.DaemonStoppingReason]().async_waiter
        daemon = asyncio.create_task(
            autoscale(
                stopped=stopped,
                body=kopf.Body(body),
                name="demo",
                namespace="default",
                logger=logging.getLogger("autoscale"),
            )
        )
        while not (cluster.get(SPECDEPLOYS, "default", "demo") or {}).get("status", {}).get("autoscaling"):
            if daemon.done():
                return [f"the daemon ended: {daemon.result()}"]
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # into the 3 s pause
        others = [t.get_name() for t in asyncio.all_tasks() if t not in (daemon, asyncio.current_task())]
        daemon.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await daemon
        return others

    return asyncio.run(run())


async def test_a_paused_autoscaler_holds_no_task_that_can_fail_the_operator_stop(
    cluster: Cluster, kubeconfig: Path
) -> None:
    """kopf re-raises the error of every task still alive when the operator stops. ``stopped.wait(n)``
    holds a task that ends in TimeoutError, so a daemon paused at that moment (kopf respawns one for
    events that arrive during shutdown) made ``kopf run`` fail; between rounds there must be none."""
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 3}
    body = await cluster.create(SPECDEPLOYS, specdeploy("demo", replicas=1, autoscaling=autoscaling))
    await cluster.create(PODS, target_pod("demo-target-a", "127.0.0.6"))  # nothing listens there
    assert await asyncio.to_thread(tasks_beside_a_paused_autoscaler, cluster, body) == []
