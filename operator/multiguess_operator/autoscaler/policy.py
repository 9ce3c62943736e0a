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

A recommendation never goes below ``follow``: the pods another pool's size says are needed (the
draft pool's learned share of the target pods), so drafts are added with the targets, not after
the targets have started falling back to plain decoding.

With speculation a target pod's requests/s depend on the tokens each verification step emits
(mean accepted length): its steps/s are set by the hardware, each step emits that many tokens per
sequence. ``capacity_at`` carries a capacity learned at one acceptance over to another, so a fall
in acceptance lowers the floor's idea of a pod at once instead of after the next overflow, and
``acceptance_floor`` adds the pods today's throughput needs at the lower acceptance before the
queue shows it (reason ``AcceptanceFell``).
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
    learned: bool = False  # ``capacity`` was measured in this decision


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
    follow: int = 0,
    follow_reason: str = "FollowTargets",
) -> Decision:
    """One decision. ``current``: replicas asked for now; ``serving``: pods the signal came from
    (default: all of them); ``ratio``: signal / target, None when no pod could be scraped;
    ``throughput``: requests/s those pods started; ``capacity``: the last decision's; ``learn``: the
    same pods served the whole interval (pods that joined midway would dilute the rate);
    ``follow``: the least any recommendation may be (another pool's share)."""
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
    learned = False
    if learn and base > 0 and ratio > 1.0 + config.tolerance and throughput:
        capacity, learned = throughput / base, True  # per pod, while `base` pods were not enough
    followed = follow > raw
    recommended = config.clamp(max(raw, follow))
    recent = (*recent, Recommendation(now, recommended))
    if recommended > current:
        reason = follow_reason if followed else "ScaleUpLimited" if limited else "ScaleUp"
        return Decision(recommended, recommended, reason, recent, capacity, learned)
    stabilized = max(r.replicas for r in recent)
    floor = math.ceil(throughput / (HEADROOM * capacity)) if capacity and throughput else 0
    replicas = config.clamp(min(current, max(stabilized, floor)))
    if replicas < current:
        return Decision(replicas, recommended, "ScaleDown", recent, capacity, learned)
    if recommended < current:
        reason = "ScaleDownStabilized" if stabilized >= current or floor < current else "ThroughputFloor"
        return Decision(replicas, recommended, reason, recent, capacity, learned)
    reason = "AtBounds" if recommended != max(raw, follow) else "Steady"
    return Decision(replicas, recommended, reason, recent, capacity, learned)


def capacity_at(
    capacity: float | None, learned_at: float | None, tokens_per_step: float | None
) -> float | None:
    """A pod's requests/s at ``tokens_per_step``, from ``capacity`` measured at ``learned_at`` tokens
    per verification step (unchanged when either is unknown)."""
    if capacity is None or not learned_at or not tokens_per_step:
        return capacity
    return capacity * tokens_per_step / learned_at


def acceptance_floor(
    throughput: float | None,
    capacity: float | None,
    learned_at: float | None,
    tokens_per_step: float | None,
    tolerance: float = 0.1,
) -> int:
    """Pods that ``throughput`` needs at the capacity ``capacity_at`` gives for today's tokens per
    step, when acceptance fell by more than ``tolerance`` since the capacity was learned (0 when
    it did not, or when anything is unknown): the same requests now take more steps each."""
    if not throughput or not capacity or not learned_at or not tokens_per_step:
        return 0
    if tokens_per_step >= learned_at * (1 - tolerance):
        return 0
    now = capacity_at(capacity, learned_at, tokens_per_step)
    return math.ceil(throughput / (HEADROOM * now)) if now else 0
