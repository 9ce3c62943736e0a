"""How many replicas (pure): the Kubernetes HPA arithmetic on a load ratio, with its safeguards.

desired = ceil(current × ratio), where ratio = signal / target; within ±tolerance nothing changes;
a scale-up is capped at ×max_scale_up per decision; a scale-down goes only as far as the highest
recommendation of the stabilization window (so one quiet interval never sheds capacity); the result
is clamped to [min, max]. Without metrics there is no ratio, and no scale-down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


def decide(
    current: int, ratio: float | None, now: float, window: tuple[Recommendation, ...], config: PolicyConfig
) -> Decision:
    """One decision. ``ratio`` is signal / target (None: no pod could be scraped)."""
    recent = tuple(r for r in window if now - r.time < config.stabilization_seconds)
    if ratio is None:
        held = config.clamp(current)
        return Decision(held, held, "NoMetrics" if held == current else "OutOfBounds", recent)
    limited = False
    if current <= 0:
        raw = config.min_replicas
    elif abs(ratio - 1.0) <= config.tolerance:
        raw = current
    else:
        wanted = math.ceil(current * ratio - 1e-9)  # the epsilon keeps 2 × 1.5 at 3, not 4
        limit = max(math.ceil(current * config.max_scale_up), current + 1)
        raw, limited = min(wanted, limit), config.clamp(limit) < config.clamp(wanted)
    recommended = config.clamp(raw)
    recent = (*recent, Recommendation(now, recommended))
    if recommended > current:
        return Decision(recommended, recommended, "ScaleUpLimited" if limited else "ScaleUp", recent)
    floor = max(r.replicas for r in recent)
    replicas = config.clamp(min(current, floor))
    if replicas < current:
        return Decision(replicas, recommended, "ScaleDown", recent)
    if recommended < current:
        return Decision(replicas, recommended, "ScaleDownStabilized", recent)
    return Decision(replicas, recommended, "AtBounds" if recommended != raw else "Steady", recent)
