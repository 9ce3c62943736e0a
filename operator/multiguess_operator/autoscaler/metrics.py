"""Prometheus text → per-pod snapshots: one histogram, one gauge and some counters (pure).

A target pod's snapshot is its queue histogram, waiting gauge and speculation counters; a draft
pod's is its draft-step histogram and request counter.

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
VERIFY_STEPS = "multiguess_spec_verify_steps_total"
ACCEPTED_TOKENS = "multiguess_spec_accepted_tokens_total"
FALLBACK_STEPS = "multiguess_spec_fallback_steps_total"
DRAFT_FAILURES = "multiguess_remote_draft_failures_total"  # label kind: timeout, connection, ...
DRAFT_REFUSED = "multiguess_remote_draft_refused_total"
TARGET_COUNTERS = (VERIFY_STEPS, ACCEPTED_TOKENS, FALLBACK_STEPS, DRAFT_FAILURES, DRAFT_REFUSED)
DRAFT_STEP_HISTOGRAM = "multiguess_draft_step_seconds"
DRAFT_REQUESTS = "multiguess_draft_requests_total"


class MetricsError(ValueError):
    """A scrape that is not usable Prometheus text with the expected histogram."""


@dataclass(frozen=True)
class Snapshot:
    """One pod's histogram (cumulative bucket counts by upper bound), gauge and counters.

    Counters are keyed by series: the sample name, with its labels as ``name{label=value}``."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending, ending at +Inf
    count: float
    total: float  # sum of observed seconds
    waiting: float
    counters: tuple[tuple[str, float], ...] = ()  # (series, value), sorted by series

    def minus(self, earlier: Snapshot | None) -> Snapshot:
        """Traffic since ``earlier``; the whole snapshot if there is none or the pod restarted."""
        if earlier is None or self.count < earlier.count or _bounds(self) != _bounds(earlier):
            return self
        before, counted = dict(earlier.buckets), dict(earlier.counters)
        if any(value < counted.get(series, 0.0) for series, value in self.counters):
            return self
        return Snapshot(
            buckets=tuple((le, n - before[le]) for le, n in self.buckets),
            count=self.count - earlier.count,
            total=self.total - earlier.total,
            waiting=self.waiting,
            counters=tuple((series, value - counted.get(series, 0.0)) for series, value in self.counters),
        )

    def counter(self, name: str, **labels: str) -> float:
        """A counter's value, summed over every label set (or only the series with ``labels``)."""
        wanted = _series(name, labels) if labels else None
        return sum(
            value
            for series, value in self.counters
            if (series == wanted if wanted else series.split("{", 1)[0] == name)
        )


def _bounds(s: Snapshot) -> tuple[float, ...]:
    return tuple(le for le, _ in s.buckets)


def _series(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def parse(
    text: str,
    histogram: str = QUEUE_HISTOGRAM,
    gauge: str | None = WAITING_GAUGE,
    counters: tuple[str, ...] = TARGET_COUNTERS,
) -> Snapshot:
    """Read ``histogram`` and ``gauge`` (summed over label sets) and every series of ``counters``
    from a /metrics page. Counters a pod does not export (no remote drafter) are simply absent."""
    buckets: dict[float, float] = {}
    values: dict[str, float] = {}
    count = total = waiting = 0.0
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise MetricsError(f"not Prometheus text: {e}") from e
    for family in families:
        for sample in family.samples:
            if sample.name == f"{histogram}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
                seen = True
            elif sample.name == f"{histogram}_count":
                count += sample.value
            elif sample.name == f"{histogram}_sum":
                total += sample.value
            elif sample.name == gauge:
                waiting += sample.value
            elif sample.name in counters:
                series = _series(sample.name, dict(sample.labels))
                values[series] = values.get(series, 0.0) + sample.value
    if not seen or math.inf not in buckets:
        raise MetricsError(f"no {histogram} histogram in the scrape")
    return Snapshot(tuple(sorted(buckets.items())), count, total, waiting, tuple(sorted(values.items())))


def parse_draft(text: str) -> Snapshot:
    """A draft server's page: its step histogram and the requests it drafted."""
    return parse(text, DRAFT_STEP_HISTOGRAM, None, (DRAFT_REQUESTS,))


def merge(snapshots: Iterable[Snapshot]) -> Snapshot | None:
    """Sum of several pods' interval snapshots (bucket bounds must agree; pods run one image)."""
    items = list(snapshots)
    if not items:
        return None
    bounds = _bounds(items[0])
    if any(_bounds(s) != bounds for s in items):
        raise MetricsError("pods report different histogram buckets")
    counters: dict[str, float] = {}
    for s in items:
        for series, value in s.counters:
            counters[series] = counters.get(series, 0.0) + value
    return Snapshot(
        buckets=tuple((le, sum(dict(s.buckets)[le] for s in items)) for le in bounds),
        count=sum(s.count for s in items),
        total=sum(s.total for s in items),
        waiting=sum(s.waiting for s in items),
        counters=tuple(sorted(counters.items())),
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
