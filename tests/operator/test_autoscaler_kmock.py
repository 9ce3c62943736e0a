"""Autoscaling end to end: the real operator in the emulator scrapes real exporters on 127.0.0.x
(standing in for target and draft pods), writes the scale subresource or ``spec.draft.replicas``,
and the Deployments follow.

Timing: on a loaded machine one autoscaler round (list pods, scrape, two writes to the emulator,
which shares this process) can take longer than a 1 s interval or a 3 s window, so the tests
assert what the policy guarantees whatever the rounds cost (e.g. no scale-down sooner than the
window after the load stopped), never how many rounds fit into a window."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import kubernetes.config
import pytest
from kopf._cogs.aiokits.aioenums import FlagSetter  # what kopf hands a daemon as ``stopped``
from kopf.testing import KopfRunner
from multiguess_operator.autoscaler import loop
from multiguess_operator.handlers import autoscale
from multiguess_operator.resources import selector

from tests.operator.conftest import DEPLOYMENTS, PODS, SPECDEPLOYS, Cluster, eventually
from tests.operator.exporters import DraftExporter, Exporter, draft_exporter, exporter, free_port
from tests.operator.test_operator_kmock import cluster_events, specdeploy

SLOW = 30.0  # seconds to wait for what takes a few rounds on a loaded machine


def target_pod(name: str, ip: str, component: str = "target") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": selector("demo", component)},
        "spec": {"containers": [{"name": "target", "image": "x"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


@contextlib.asynccontextmanager
async def every_tenth_second(action: Callable[[], None]) -> AsyncIterator[None]:
    """Run ``action`` every 0.1 s until the block ends."""

    async def produce() -> None:
        while True:
            action()
            await asyncio.sleep(0.1)

    task = asyncio.create_task(produce())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def load(pod: Exporter, queue_seconds: float, accepted_per_step: float = 0.0) -> Any:
    """Ten requests per 0.1 s that each waited ``queue_seconds``, and twenty verification steps
    that each accepted ``accepted_per_step`` drafted tokens, until the block ends."""

    def produce() -> None:
        for _ in range(10):
            pod.queue.observe(queue_seconds)
        pod.steps(20, accepted_per_step)

    return every_tenth_second(produce)


def drafting(pod: DraftExporter, step_seconds: float) -> Any:
    """One draft step of ``step_seconds`` per 0.1 s: the pod is busy ``step_seconds / 0.1`` of the time."""

    def produce() -> None:
        pod.step.observe(step_seconds)
        pod.requests.inc(4)

    return every_tenth_second(produce)


def falling_back(pod: Exporter, kind: str) -> Any:
    """Half of the target's steps decode without a draft, after draft failures of ``kind``."""

    def produce() -> None:
        pod.steps(20, 1.0, fallbacks=10)
        pod.draft_failures.labels(kind=kind).inc()

    return every_tenth_second(produce)


def replicas(cluster: Cluster, resource: str, name: str) -> int | None:
    obj = cluster.get(resource, "default", name)
    return None if obj is None else obj["spec"]["replicas"]


def draft_replicas(cluster: Cluster) -> int | None:
    obj = cluster.get(SPECDEPLOYS, "default", "demo")
    return None if obj is None else obj["spec"]["draft"].get("replicas", 1)


def status_of(cluster: Cluster, pool: str) -> dict[str, Any]:
    return dict((cluster.get(SPECDEPLOYS, "default", "demo") or {}).get("status", {}).get(pool) or {})


def draft_status_shows(cluster: Cluster, desired: int) -> bool:
    """The status of the round that decided ``desired`` is written (it follows the replicas' patch)."""
    return status_of(cluster, "draftAutoscaling").get("desiredReplicas") == desired


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

        # p95 of 2 s against a 0.5 s target; each step emits 1 + 1.5 tokens
        async with load(first, queue_seconds=2.0, accepted_per_step=1.5):
            await eventually(
                lambda: replicas(cluster, SPECDEPLOYS, "demo") == 2, what="scale-up", timeout=SLOW
            )
            await eventually(
                lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 2, what="deployment follows"
            )
            await cluster.create(PODS, target_pod("demo-target-b", "127.0.0.3"))
            loaded = await eventually(
                lambda: status_of(cluster, "autoscaling").get("meanAcceptedLength"), what="acceptance"
            )
            assert loaded == pytest.approx(2.5)
        stopped_at = asyncio.get_running_loop().time()

        # Load stops: the signal drops to zero, and only after the 3 s window the replicas go back to 1.
        await eventually(lambda: replicas(cluster, SPECDEPLOYS, "demo") == 1, what="scale-down", timeout=SLOW)
        assert asyncio.get_running_loop().time() - stopped_at >= 3.0  # waited for the window
        await eventually(
            lambda: replicas(cluster, DEPLOYMENTS, "demo-target") == 1, what="deployment follows"
        )

    status = status_of(cluster, "autoscaling")
    reasons = [h["reason"] for h in status["history"]]
    assert "ScaleUp" in reasons or "ScaleUpLimited" in reasons
    assert "ScaleDown" in reasons
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

    status = await eventually(reported, what="unreachable pod in status", timeout=SLOW)
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


async def test_the_draft_pool_scales_on_its_busy_time_and_on_the_targets_fallbacks(
    cluster: Cluster, operator: KopfRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Busy drafts → more drafts; drafts that look idle while the targets time out on them and
    decode plainly → more drafts; fallbacks from a broken connection → not a reason to scale."""
    port, draft_port = free_port(), free_port()
    # Draft pods serve on DRAFT_PORT; a draft server on this machine may hold it on every address.
    monkeypatch.setattr(loop, "DRAFT_PORT", draft_port)
    draft = {
        **specdeploy("demo")["spec"]["draft"],
        "autoscaling": {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 4,
            "intervalSeconds": 1,
            "scaleDownStabilizationSeconds": 3,
            "targetBusyFraction": 0.5,
            "targetStepLatencySeconds": 1.0,
        },
    }
    body = specdeploy("demo", replicas=1, draft=draft, serving={"port": port})
    with (
        exporter("127.0.0.42", port) as target,
        draft_exporter("127.0.0.44", draft_port) as first,
        draft_exporter("127.0.0.45", draft_port),
    ):
        await cluster.create(PODS, target_pod("demo-target-a", "127.0.0.42"))
        await cluster.create(PODS, target_pod("demo-draft-a", "127.0.0.44", "draft"))
        await cluster.create(SPECDEPLOYS, body)
        await eventually(lambda: status_of(cluster, "draftAutoscaling").get("scrapedPods") == 1, timeout=SLOW)

        async with drafting(first, step_seconds=0.09):  # busy up to 90 % of the time against 50 %
            await eventually(lambda: draft_replicas(cluster) == 2, what="busy: scale-up", timeout=SLOW)
            await eventually(lambda: replicas(cluster, DEPLOYMENTS, "demo-draft") == 2, what="draft follows")
            await cluster.create(PODS, target_pod("demo-draft-b", "127.0.0.45", "draft"))
            # Two pods share the busy time now, enough to learn the pool's share but not to grow.
            share = await eventually(
                lambda: status_of(cluster, "draftAutoscaling").get("draftsPerTarget"), timeout=SLOW
            )
            # Learned only from intervals at half the target busy time or more, from one or two
            # draft pods busy at most 90 % against 50 %, for one target pod.
            assert 0.5 <= share <= 2 * 0.9 / 0.5
            assert draft_replicas(cluster) == 2

        async with falling_back(target, "timeout"):  # the drafts look idle; the target times out
            await eventually(lambda: draft_replicas(cluster) == 4, what="fallbacks: scale-up", timeout=SLOW)
            counted = await eventually(
                lambda: status_of(cluster, "draftAutoscaling") if draft_status_shows(cluster, 4) else None
            )
            assert counted["fallbacksCounted"] and counted["fallbackFraction"] == pytest.approx(0.5)
            assert counted["busyFraction"] < 0.5  # below its target: by its own metrics the pool is idle
        async with falling_back(target, "connection"):  # breakage: more drafts would not help
            stopped_at = asyncio.get_running_loop().time()
            await eventually(lambda: draft_replicas(cluster) == 1, what="scale-down", timeout=SLOW)
            assert asyncio.get_running_loop().time() - stopped_at >= 3.0  # waited for the window
            broken = await eventually(
                lambda: status_of(cluster, "draftAutoscaling") if draft_status_shows(cluster, 1) else None
            )
            assert not broken["fallbacksCounted"] and broken["otherFailures"] > 0
        await eventually(lambda: replicas(cluster, DEPLOYMENTS, "demo-draft") == 1, what="draft follows")

    reasons = [h["reason"] for h in status_of(cluster, "draftAutoscaling")["history"]]
    assert "ScaleDown" in reasons and any(r.startswith("ScaleUp") for r in reasons)
    await eventually(
        lambda: {"DraftScaledUp", "DraftScaledDown"} <= {e["reason"] for e in cluster_events(cluster)}
    )
