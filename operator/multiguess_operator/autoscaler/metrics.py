"""Prometheus text → per-pod snapshots → the queue-latency signal over one interval (pure).

Counters and histograms only ever grow within one process, so the interval's traffic is the
difference of two scrapes; a smaller count means the pod restarted and the new values are the
whole interval (as Prometheus' ``increase()`` treats resets).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

QUEUE_HISTOGRAM = "multiguess_request_queue_seconds"
WAITING_GAUGE = "multiguess_requests_waiting"


class MetricsError(ValueError):
    """A scrape that is not usable Prometheus text with the queue histogram."""


@dataclass(frozen=True)
class Snapshot:
    """One pod's queue histogram (cumulative bucket counts by upper bound) and waiting gauge."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending, ending at +Inf
    count: float
    total: float  # sum of observed seconds
    waiting: float

    def minus(self, earlier: Snapshot | None) -> Snapshot:
        """Traffic since ``earlier``; the whole snapshot if there is none or the pod restarted."""
        if earlier is None or self.count < earlier.count or _bounds(self) != _bounds(earlier):
            return self
        before = dict(earlier.buckets)
        return Snapshot(
            buckets=tuple((le, n - before[le]) for le, n in self.buckets),
            count=self.count - earlier.count,
            total=self.total - earlier.total,
            waiting=self.waiting,
        )


def _bounds(s: Snapshot) -> tuple[float, ...]:
    return tuple(le for le, _ in s.buckets)


def parse(text: str) -> Snapshot:
    """Read the queue histogram and waiting gauge from a /metrics page (summed over label sets)."""
    buckets: dict[float, float] = {}
    count = total = waiting = 0.0
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise MetricsError(f"not Prometheus text: {e}") from e
    for family in families:
        for sample in family.samples:
            if sample.name == f"{QUEUE_HISTOGRAM}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
                seen = True
            elif sample.name == f"{QUEUE_HISTOGRAM}_count":
                count += sample.value
            elif sample.name == f"{QUEUE_HISTOGRAM}_sum":
                total += sample.value
            elif sample.name == WAITING_GAUGE:
                waiting += sample.value
    if not seen or math.inf not in buckets:
        raise MetricsError(f"no {QUEUE_HISTOGRAM} histogram in the scrape")
    return Snapshot(tuple(sorted(buckets.items())), count, total, waiting)


def merge(snapshots: Iterable[Snapshot]) -> Snapshot | None:
    """Sum of several pods' interval snapshots (bucket bounds must agree; pods run one image)."""
    items = list(snapshots)
    if not items:
        return None
    bounds = _bounds(items[0])
    if any(_bounds(s) != bounds for s in items):
        raise MetricsError("pods report different histogram buckets")
    return Snapshot(
        buckets=tuple((le, sum(dict(s.buckets)[le] for s in items)) for le in bounds),
        count=sum(s.count for s in items),
        total=sum(s.total for s in items),
        waiting=sum(s.waiting for s in items),
    )


def quantile(q: float, snapshot: Snapshot) -> float:
    """The q-quantile by linear interpolation inside its bucket, as PromQL's histogram_quantile.

    0 when nothing was observed; the highest finite bound when the quantile is in the +Inf bucket.
    """
    if snapshot.count <= 0:
        return 0.0
    rank = q * snapshot.buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in snapshot.buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            in_bucket = cumulative - below
            return lower + (le - lower) * ((rank - below) / in_bucket if in_bucket > 0 else 1.0)
        lower, below = le, cumulative
    return lower


def mean(snapshot: Snapshot) -> float:
    return snapshot.total / snapshot.count if snapshot.count > 0 else 0.0
