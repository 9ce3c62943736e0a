"""One autoscaling step for one SpeculativeDeployment, and the state it keeps between steps.

scrape ready pods → deltas since the last scrape → signal → policy → scale subresource + status.
The stabilization window is kept in ``status.autoscaling`` so an operator restart does not forget it.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from multiguess_operator.autoscaler.metrics import Snapshot, mean, merge, quantile
from multiguess_operator.autoscaler.policy import Decision, PolicyConfig, Recommendation, decide
from multiguess_operator.autoscaler.scraper import ready_targets, scrape
from multiguess_operator.kube import PODS, SPECDEPLOYS, Kube
from multiguess_operator.resources import selector
from multiguess_operator.spec import AutoscalingSpec, DeploymentSpec

HISTORY_LENGTH = 10
SIGNAL_INTERVALS = 3  # the signal covers the last three scrape intervals (45 s at the default 15 s)


@dataclass(frozen=True)
class Signal:
    """The load over one interval, reduced to a ratio to the target (None: nothing was scraped)."""

    ratio: float | None
    value: float | None  # the configured metric's value
    p95: float | None
    waiting_per_pod: float | None
    throughput: float | None = None  # requests/s that left the queue, all scraped pods together


def compute_signal(
    deltas: list[Snapshot], scraped: list[Snapshot], config: AutoscalingSpec, elapsed: float | None = None
) -> Signal:
    """Pure. Latency from the interval's queue histogram; waiting requests as the secondary signal:
    whichever is further above its target drives the ratio (a stalled queue shows no latencies)."""
    if not scraped:
        return Signal(None, None, None, None)
    waiting = sum(s.waiting for s in scraped) / len(scraped)
    waiting_ratio = waiting / config.target_waiting_requests
    merged = merge(deltas)
    p95 = quantile(0.95, merged) if merged else None
    throughput = merged.count / elapsed if merged is not None and elapsed else None
    if config.metric == "requestsWaiting":
        return Signal(waiting_ratio, waiting, p95, waiting, throughput)
    latency = None if merged is None else p95 if config.metric == "queueLatencyP95" else mean(merged)
    ratios = [waiting_ratio] + (
        [latency / config.target_queue_latency_seconds] if latency is not None else []
    )
    return Signal(max(ratios), latency, p95, waiting, throughput)


@dataclass
class Autoscaler:
    """State of one resource's autoscaler: last scrape per pod, the window and the decision history."""

    previous: dict[str, Snapshot] = field(default_factory=dict)
    window: tuple[Recommendation, ...] = ()
    capacity: float | None = None
    last_scrape: float | None = None
    members_since: float | None = None  # when the set of scraped pods last changed
    stable: bool = False  # the same pods served the whole signal window
    recent: list[tuple[float, Snapshot, float]] = field(default_factory=list)  # (time, delta, seconds)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_scale_time: str | None = None

    @classmethod
    def restore(cls, status: Mapping[str, Any] | None) -> Autoscaler:
        saved = (status or {}).get("autoscaling") or {}
        window = tuple(
            Recommendation(float(r["time"]), int(r["replicas"])) for r in saved.get("window") or []
        )
        capacity = saved.get("capacityPerPod")
        return cls(
            window=window,
            capacity=None if capacity is None else float(capacity),
            history=list(saved.get("history") or []),
            last_scale_time=saved.get("lastScaleTime"),
        )

    def observe(
        self, snapshots: dict[str, Snapshot], now: float, interval: float
    ) -> tuple[list[Snapshot], float | None]:
        """The traffic of the last SIGNAL_INTERVALS scrapes (one merged delta per scrape) and the time
        it spans; remember this scrape. A pod's first scrape is only a baseline. A p95 over 45 s of
        requests is steadier than over one 15 s interval, and HPA averages its metrics the same way."""
        span = SIGNAL_INTERVALS * interval
        deltas = [snap.minus(self.previous[uid]) for uid, snap in snapshots.items() if uid in self.previous]
        merged = merge(deltas)
        if merged is not None and self.last_scrape is not None:
            self.recent.append((now, merged, now - self.last_scrape))
        self.recent = [r for r in self.recent if now - r[0] < span - 1e-6] or self.recent[-1:]
        if set(snapshots) != set(self.previous) or self.members_since is None:
            self.members_since = now
        self.stable = now - self.members_since >= span - 1e-6
        self.previous, self.last_scrape = dict(snapshots), now
        if not deltas:
            return [], None
        return [r[1] for r in self.recent], sum(r[2] for r in self.recent)

    def decide(
        self, current: int, serving: int, signal: Signal, now: float, spec: AutoscalingSpec
    ) -> Decision:
        config = PolicyConfig(
            spec.min_replicas,
            spec.max_replicas,
            spec.scale_down_stabilization_seconds,
            max_scale_up=spec.max_scale_up_factor,
        )
        if not self.window and not self.history:
            # A fresh autoscaler has no past: treat the current size as just recommended, so the
            # first quiet interval after enabling autoscaling does not shed capacity at once.
            self.window = (Recommendation(now, current),)
        decision = decide(
            current,
            signal.ratio,
            now,
            self.window,
            config,
            serving,
            signal.throughput,
            self.capacity,
            learn=self.stable,
        )
        self.window, self.capacity = decision.window, decision.capacity
        entry = {
            "time": _iso(now),
            "from": current,
            "to": decision.replicas,
            "reason": decision.reason,
            "signal": _round(signal.value),
        }
        last = self.history[-1] if self.history else {}
        if (last.get("to"), last.get("reason")) != (entry["to"], entry["reason"]):
            self.history = [*self.history, entry][-HISTORY_LENGTH:]
        if decision.replicas != current:
            self.last_scale_time = entry["time"]
        return decision

    def status(
        self, signal: Signal, decision: Decision, scraped: int, unreachable: dict[str, str], metric: str
    ) -> dict[str, Any]:
        return {
            "metric": metric,
            "signal": _round(signal.value),
            "ratio": _round(signal.ratio),
            "queueLatencyP95Seconds": _round(signal.p95),
            "requestsWaitingPerPod": _round(signal.waiting_per_pod),
            "desiredReplicas": decision.replicas,
            "recommendedReplicas": decision.recommended,
            "reason": decision.reason,
            "lastScaleTime": self.last_scale_time,
            "scrapedPods": scraped,
            "unreachablePods": [f"{pod}: {error}" for pod, error in sorted(unreachable.items())],
            "window": [{"time": r.time, "replicas": r.replicas} for r in self.window],
            "capacityPerPod": _round(self.capacity),
            "throughput": _round(signal.throughput),
            "history": self.history,
        }


@dataclass(frozen=True)
class StepResult:
    current: int
    decision: Decision
    signal: Signal
    status: dict[str, Any]
    unreachable: dict[str, str]


async def step(
    kube: Kube, scaler: Autoscaler, name: str, namespace: str, spec: DeploymentSpec, now: float
) -> StepResult:
    """Scrape, decide, and write: the scale subresource (if changed) and ``status.autoscaling``."""
    pods = await asyncio.to_thread(kube.list, PODS, namespace, selector(name, "target"))
    snapshots, unreachable = await scrape(ready_targets(pods, spec.serving.port))
    deltas, elapsed = scaler.observe(snapshots, now, spec.autoscaling.interval_seconds)
    signal = compute_signal(deltas, list(snapshots.values()), spec.autoscaling, elapsed)
    decision = scaler.decide(spec.replicas, len(snapshots), signal, now, spec.autoscaling)
    if decision.replicas != spec.replicas:
        await asyncio.to_thread(
            kube.merge_patch, SPECDEPLOYS, namespace, name, {"spec": {"replicas": decision.replicas}}, "scale"
        )
    status = scaler.status(signal, decision, len(snapshots), unreachable, spec.autoscaling.metric)
    await asyncio.to_thread(
        kube.merge_patch, SPECDEPLOYS, namespace, name, {"status": {"autoscaling": status}}, "status"
    )
    return StepResult(spec.replicas, decision, signal, status, unreachable)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
