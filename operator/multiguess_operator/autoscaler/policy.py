"""How many replicas (pure): the Kubernetes HPA arithmetic on a load ratio, with its safeguards.

recommended = ceil(serving × ratio), where ratio = signal / target and ``serving`` counts the pods
the signal came from (pods still starting are not counted, so their start-up time does not read as
a reason to add even more); within ±tolerance nothing changes; a scale-up adds at most
×max_scale_up per decision; the result is clamped to [min, max]. Without metrics there is no
ratio, and no scale-down.

Scale-down is where queue latency differs from CPU load: it is ~0 at any size with spare capacity
and says nothing about how much spare there is. So a scale-down goes only as far as

* the highest recommendation of the stabilization window (one quiet interval never sheds capacity),
* and not below what today's throughput needs: when the queue last overflowed its target, the pods
  were doing ``capacity`` requests/s each, so at throughput T a scale-down keeps at least
  T / (HEADROOM × capacity) pods. Throughput is linear in load where latency is not: the floor follows
  a falling load down, and a size that proved too small is not tried again at the same load, so
  the autoscaler does not cycle between too small and big enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A scale-down leaves each pod at most 75 % of the per-pod throughput at which the queue last
# overflowed: a queue overflows well before a pod is saturated, and a little below is not enough.
HEADROOM = 0.75


@dataclass(frozen=True)
class PolicyConfig:
    min_replicas: int
    max_replicas: int
    stabilization_seconds: float = 300.0
    tolerance: float = 0.1
    max_scale_up: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 < min <= max replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.max_scale_up < 1 or self.tolerance < 0 or self.stabilization_seconds < 0:
            raise ValueError("max_scale_up must be >= 1; tolerance and stabilization must be >= 0")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int  # what to run now
    recommended: int  # this interval's raw recommendation (after caps and bounds)
    reason: str
    window: tuple[Recommendation, ...]  # recommendations to remember for the next decisions
    capacity: float | None = None  # requests/s per pod when the queue last overflowed the target


def decide(
    current: int,
    ratio: float | None,
    now: float,
    window: tuple[Recommendation, ...],
    config: PolicyConfig,
    serving: int | None = None,
    throughput: float | None = None,
    capacity: float | None = None,
    learn: bool = True,
) -> Decision:
    """One decision. ``current``: replicas asked for now; ``serving``: pods the signal came from
    (default: all of them); ``ratio``: signal / target, None when no pod could be scraped;
    ``throughput``: requests/s those pods started; ``capacity``: the last decision's; ``learn``: the
    same pods served the whole interval (pods that joined midway would dilute the rate)."""
    recent = tuple(r for r in window if now - r.time < config.stabilization_seconds)
    if ratio is None:
        held = config.clamp(current)
        return Decision(held, held, "NoMetrics" if held == current else "OutOfBounds", recent, capacity)
    base = current if serving is None else serving
    limited = False
    if base <= 0:
        raw = max(current, config.min_replicas)
    elif abs(ratio - 1.0) <= config.tolerance:
        raw = current
    else:
        wanted = math.ceil(base * ratio - 1e-9)  # the epsilon keeps 2 × 1.5 at 3, not 4
        limit = max(math.ceil(base * config.max_scale_up), base + 1)
        raw, limited = min(wanted, limit), config.clamp(limit) < config.clamp(wanted)
    if learn and base > 0 and ratio > 1.0 + config.tolerance and throughput:
        capacity = throughput / base  # per pod, while `base` pods were not enough
    recommended = config.clamp(raw)
    recent = (*recent, Recommendation(now, recommended))
    if recommended > current:
        reason = "ScaleUpLimited" if limited else "ScaleUp"
        return Decision(recommended, recommended, reason, recent, capacity)
    stabilized = max(r.replicas for r in recent)
    floor = math.ceil(throughput / (HEADROOM * capacity)) if capacity and throughput else 0
    replicas = config.clamp(min(current, max(stabilized, floor)))
    if replicas < current:
        return Decision(replicas, recommended, "ScaleDown", recent, capacity)
    if recommended < current:
        reason = "ScaleDownStabilized" if stabilized >= current or floor < current else "ThroughputFloor"
        return Decision(replicas, recommended, reason, recent, capacity)
    return Decision(replicas, recommended, "AtBounds" if recommended != raw else "Steady", recent, capacity)
