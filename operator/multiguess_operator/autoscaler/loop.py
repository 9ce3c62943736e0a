"""One autoscaling step per pool of one SpeculativeDeployment, and the state each keeps between steps.

Targets: scrape ready target pods → deltas since the last scrape → signal → policy → scale
subresource + ``status.autoscaling``. Drafts (``placement: separate``): scrape the draft pods and the
target pods → draft signal → the same policy → ``spec.draft.replicas`` + ``status.draftAutoscaling``.
The stabilization windows are kept in the status so an operator restart does not forget them.
"""

from __future__ import annotations

import asyncio
import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from multiguess_operator.autoscaler.metrics import (
    ACCEPTED_TOKENS,
    DRAFT_FAILURES,
    DRAFT_REFUSED,
    FALLBACK_STEPS,
    VERIFY_STEPS,
    Snapshot,
    mean,
    merge,
    parse_draft,
    quantile,
)
from multiguess_operator.autoscaler.policy import (
    Decision,
    PolicyConfig,
    Recommendation,
    acceptance_floor,
    capacity_at,
    decide,
)
from multiguess_operator.autoscaler.scraper import ready_targets, scrape
from multiguess_operator.kube import PODS, SPECDEPLOYS, Kube
from multiguess_operator.resources import DRAFT_PORT, selector
from multiguess_operator.spec import AutoscalingSpec, DeploymentSpec, DraftAutoscalingSpec

HISTORY_LENGTH = 10
SIGNAL_INTERVALS = 3  # the signal covers the last three scrape intervals (45 s at the default 15 s)
# Draft failures that more draft pods cure: too slow (timeout) or out of sessions (server, refused).
# Connection, protocol and incompatibility failures are breakage: more pods of it do not help.
CAPACITY_FAILURES = ("timeout", "server")
# The draft pods each target pod needs is learned from intervals in which the draft pool carried
# at least this share of its target load without fallbacks (an idle pool says little about it).
LEARN_DRAFT_SHARE_ABOVE = 0.5
DRAFT_SHARE_SMOOTHING = 0.3  # weight of a new interval in the learned drafts per target pod
MIN_SERVED_SHARE = 0.1  # when (nearly) every step fell back, count the demand as ten times today's


class Bounds(Protocol):
    """What the policy reads from either pool's autoscaling spec."""

    min_replicas: int
    max_replicas: int
    scale_down_stabilization_seconds: int
    max_scale_up_factor: float


@dataclass(frozen=True)
class Signal:
    """The load over one interval, reduced to a ratio to the target (None: nothing was scraped)."""

    ratio: float | None
    value: float | None  # the configured metric's value
    p95: float | None
    waiting_per_pod: float | None
    throughput: float | None = None  # requests/s that left the queue, all scraped pods together
    tokens_per_step: float | None = None  # mean accepted length: 1 + accepted / verify steps


def tokens_per_step(merged: Snapshot | None) -> float | None:
    """Tokens one verification step emitted per sequence over the interval (None: no steps)."""
    steps = merged.counter(VERIFY_STEPS) if merged is not None else 0.0
    return 1.0 + merged.counter(ACCEPTED_TOKENS) / steps if merged is not None and steps > 0 else None


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
    accepted = tokens_per_step(merged)
    if config.metric == "requestsWaiting":
        return Signal(waiting_ratio, waiting, p95, waiting, throughput, accepted)
    latency = None if merged is None else p95 if config.metric == "queueLatencyP95" else mean(merged)
    ratios = [waiting_ratio] + (
        [latency / config.target_queue_latency_seconds] if latency is not None else []
    )
    return Signal(max(ratios), latency, p95, waiting, throughput, accepted)


@dataclass(frozen=True)
class DraftSignal:
    """The draft pool's load over one interval: the largest of its three ratios to target."""

    ratio: float | None
    value: float | None  # busy fraction of a draft pod (share of wall time spent drafting)
    step_p95: float | None = None
    fallback_fraction: float | None = None  # target steps decoded without a draft
    fallbacks_counted: bool = False  # the fallbacks are what more draft pods cure
    capacity_failures: float = 0.0  # draft timeouts and refusals on the targets
    other_failures: float = 0.0  # connection, protocol, incompatibility
    throughput: float | None = None  # the policy's throughput floor does not apply to drafts


def compute_draft_signal(
    drafts: list[Snapshot],
    scraped_drafts: int,
    targets: list[Snapshot],
    config: DraftAutoscalingSpec,
    elapsed: float | None,
) -> DraftSignal:
    """Pure. ``drafts``/``targets``: the window's deltas of each pool; ``elapsed``: the seconds
    they span. Busy time is linear in load; step latency shows batches growing; the targets'
    fallbacks show demand the pool did not serve at all (a target whose draft timed out pauses
    speculation, so a saturated pool looks idle by its own metrics)."""
    merged = merge(drafts)
    if not scraped_drafts or merged is None or not elapsed:
        return DraftSignal(None, None)
    busy = merged.total / (elapsed * scraped_drafts)
    step_p95 = quantile(0.95, merged) if merged.count > 0 else 0.0
    ratios = [busy / config.target_busy_fraction, step_p95 / config.target_step_latency_seconds]
    seen = merge(targets)
    fraction = None
    capacity = other = 0.0
    if seen is not None:
        steps = seen.counter(VERIFY_STEPS)
        fraction = seen.counter(FALLBACK_STEPS) / steps if steps > 0 else None
        capacity = sum(seen.counter(DRAFT_FAILURES, kind=k) for k in CAPACITY_FAILURES)
        capacity += seen.counter(DRAFT_REFUSED)
        other = seen.counter(DRAFT_FAILURES) - sum(
            seen.counter(DRAFT_FAILURES, kind=k) for k in CAPACITY_FAILURES
        )
    counted = fraction is not None and not (other > 0 and capacity == 0)
    if counted and fraction is not None and fraction > config.target_fallback_fraction:
        # The steps that fell back are demand the pool did not serve: the busy time it would take
        # is today's over the share served (at least the target's, since a pool whose targets
        # paused speculation shows little busy time of its own).
        served = max(busy / config.target_busy_fraction, 1.0)
        ratios.append(served / max(1.0 - fraction, MIN_SERVED_SHARE))
    return DraftSignal(max(ratios), busy, step_p95, fraction, counted, capacity, other)


@dataclass
class Autoscaler:
    """State of one pool's autoscaler: last scrape per pod, the window and the decision history."""

    previous: dict[str, Snapshot] = field(default_factory=dict)
    window: tuple[Recommendation, ...] = ()
    capacity: float | None = None  # requests/s per pod when the queue last overflowed (as learned)
    capacity_tokens: float | None = None  # tokens per step when ``capacity`` was learned
    effective_capacity: float | None = None  # ``capacity`` at the last interval's tokens per step
    last_scrape: float | None = None
    members_since: float | None = None  # when the set of scraped pods last changed
    stable: bool = False  # the same pods served the whole signal window
    recent: list[tuple[float, Snapshot, float]] = field(default_factory=list)  # (time, delta, seconds)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_scale_time: str | None = None

    @classmethod
    def restore(cls, saved: Mapping[str, Any] | None) -> Autoscaler:
        """From a pool's saved ``status`` block (``status.autoscaling`` or ``status.draftAutoscaling``)."""
        saved = saved or {}
        window = tuple(
            Recommendation(float(r["time"]), int(r["replicas"])) for r in saved.get("window") or []
        )
        learned = saved.get("learnedCapacity") or {}
        capacity = learned.get("perPod", saved.get("capacityPerPod"))
        tokens = learned.get("meanAcceptedLength")
        return cls(
            window=window,
            capacity=None if capacity is None else float(capacity),
            capacity_tokens=None if tokens is None else float(tokens),
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
        self,
        current: int,
        serving: int,
        signal: Signal | DraftSignal,
        now: float,
        spec: Bounds,
        follow: int = 0,
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
        accepted = signal.tokens_per_step if isinstance(signal, Signal) else None
        effective = capacity_at(self.capacity, self.capacity_tokens, accepted)
        fell = acceptance_floor(signal.throughput, self.capacity, self.capacity_tokens, accepted)
        decision = decide(
            current,
            signal.ratio,
            now,
            self.window,
            config,
            serving,
            signal.throughput,
            effective,
            learn=self.stable,
            follow=max(follow, fell),
            follow_reason="AcceptanceFell" if fell > follow else "FollowTargets",
        )
        self.window = decision.window
        if decision.learned:
            self.capacity, self.capacity_tokens = decision.capacity, accepted
        self.effective_capacity = decision.capacity
        entry = {
            "time": _iso(now),
            "from": current,
            "to": decision.replicas,
            "reason": decision.reason,
            "signal": _round(signal.value),
        }
        if accepted is not None:
            entry["meanAcceptedLength"] = _round(accepted)
        last = self.history[-1] if self.history else {}
        if (last.get("to"), last.get("reason")) != (entry["to"], entry["reason"]):
            self.history = [*self.history, entry][-HISTORY_LENGTH:]
        if decision.replicas != current:
            self.last_scale_time = entry["time"]
        return decision

    def pool_status(self, decision: Decision, scraped: int, unreachable: dict[str, str]) -> dict[str, Any]:
        """The fields both pools report."""
        return {
            "desiredReplicas": decision.replicas,
            "recommendedReplicas": decision.recommended,
            "reason": decision.reason,
            "lastScaleTime": self.last_scale_time,
            "scrapedPods": scraped,
            "unreachablePods": [f"{pod}: {error}" for pod, error in sorted(unreachable.items())],
            "window": [{"time": r.time, "replicas": r.replicas} for r in self.window],
            "history": self.history,
        }

    def status(
        self, signal: Signal, decision: Decision, scraped: int, unreachable: dict[str, str], metric: str
    ) -> dict[str, Any]:
        learned = (
            {"perPod": _round(self.capacity), "meanAcceptedLength": _round(self.capacity_tokens)}
            if self.capacity is not None
            else None
        )
        return {
            "metric": metric,
            "signal": _round(signal.value),
            "ratio": _round(signal.ratio),
            "queueLatencyP95Seconds": _round(signal.p95),
            "requestsWaitingPerPod": _round(signal.waiting_per_pod),
            "meanAcceptedLength": _round(signal.tokens_per_step),
            "capacityPerPod": _round(self.effective_capacity),
            "learnedCapacity": learned,
            "throughput": _round(signal.throughput),
            **self.pool_status(decision, scraped, unreachable),
        }


@dataclass
class DraftAutoscaler:
    """The draft pool's state: its own pods' scrapes, the targets' (for their fallbacks), and the
    draft pods each target pod needs, learned from the intervals that show it."""

    drafts: Autoscaler = field(default_factory=Autoscaler)
    targets: Autoscaler = field(default_factory=Autoscaler)
    per_target: float | None = None

    @classmethod
    def restore(cls, saved: Mapping[str, Any] | None) -> DraftAutoscaler:
        per_target = (saved or {}).get("draftsPerTarget")
        return cls(Autoscaler.restore(saved), per_target=None if per_target is None else float(per_target))

    def follow(self, target_replicas: int, serving_targets: int) -> int:
        """Draft pods for the targets' desired size at the learned share, while target pods are
        being added that the draft signal cannot show yet (0 otherwise, or until learned): drafts
        come up with the targets instead of after the new targets start falling back."""
        if not self.per_target or target_replicas <= serving_targets:
            return 0
        return math.ceil(target_replicas * self.per_target - 1e-9)

    def learn(
        self, signal: DraftSignal, serving_drafts: int, serving_targets: int, config: DraftAutoscalingSpec
    ) -> None:
        """One interval's draft pods per target pod: the pods that would carry today's busy time at
        the target busy fraction, over the target pods that made it. Only from stable, loaded
        intervals without fallbacks: the share of an idle or saturated pool is not the need."""
        if signal.value is None or not serving_targets or not self.drafts.stable:
            return
        load = signal.value / config.target_busy_fraction
        fallback = signal.fallback_fraction or 0.0
        if load < LEARN_DRAFT_SHARE_ABOVE or fallback > config.target_fallback_fraction:
            return
        sample = serving_drafts * load / serving_targets
        if self.per_target is None:
            self.per_target = sample
        else:
            self.per_target += DRAFT_SHARE_SMOOTHING * (sample - self.per_target)

    def status(
        self,
        signal: DraftSignal,
        decision: Decision,
        scraped: int,
        unreachable: dict[str, str],
        target_pods: int,
    ) -> dict[str, Any]:
        return {
            "ratio": _round(signal.ratio),
            "busyFraction": _round(signal.value),
            "stepLatencyP95Seconds": _round(signal.step_p95),
            "fallbackFraction": _round(signal.fallback_fraction),
            "fallbacksCounted": signal.fallbacks_counted,
            "capacityFailures": signal.capacity_failures,
            "otherFailures": signal.other_failures,
            "draftsPerTarget": _round(self.per_target),
            "targetPods": target_pods,
            **self.drafts.pool_status(decision, scraped, unreachable),
        }


@dataclass(frozen=True)
class StepResult:
    current: int
    decision: Decision
    signal: Signal | DraftSignal
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


async def draft_step(
    kube: Kube, scaler: DraftAutoscaler, name: str, namespace: str, spec: DeploymentSpec, now: float
) -> StepResult:
    """Scrape both pools, decide the draft pool's size, and write ``spec.draft.replicas`` (if
    changed) and ``status.draftAutoscaling``."""
    draft = spec.separate_draft
    assert draft is not None, "draft autoscaling runs only with placement: separate"
    config = draft.autoscaling
    draft_pods = await asyncio.to_thread(kube.list, PODS, namespace, selector(name, "draft"))
    target_pods = await asyncio.to_thread(kube.list, PODS, namespace, selector(name, "target"))
    (drafts, unreachable), (targets, _) = await asyncio.gather(
        scrape(ready_targets(draft_pods, DRAFT_PORT), parse=parse_draft),
        scrape(ready_targets(target_pods, spec.serving.port)),
    )
    draft_deltas, elapsed = scaler.drafts.observe(drafts, now, config.interval_seconds)
    target_deltas, _ = scaler.targets.observe(targets, now, config.interval_seconds)
    signal = compute_draft_signal(draft_deltas, len(drafts), target_deltas, config, elapsed)
    scaler.learn(signal, len(drafts), len(targets), config)
    follow = scaler.follow(spec.replicas, len(targets))
    decision = scaler.drafts.decide(draft.replicas, len(drafts), signal, now, config, follow)
    if decision.replicas != draft.replicas:
        patch = {"spec": {"draft": {"replicas": decision.replicas}}}
        await asyncio.to_thread(kube.merge_patch, SPECDEPLOYS, namespace, name, patch)
    status = scaler.status(signal, decision, len(drafts), unreachable, len(targets))
    await asyncio.to_thread(
        kube.merge_patch, SPECDEPLOYS, namespace, name, {"status": {"draftAutoscaling": status}}, "status"
    )
    return StepResult(draft.replicas, decision, signal, status, unreachable)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
