"""Both pools' signals: parsing real exporter output (histograms and counters), interval deltas,
resets, bucket interpolation, tokens per step, the draft pool's three ratios and its learned share;
scraping real HTTP exporters on 127.0.0.x including an unreachable pod and a restarted one."""

from __future__ import annotations

import functools
import http.server
import math
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multiguess_operator.autoscaler.loop import (
    Autoscaler,
    DraftAutoscaler,
    DraftSignal,
    compute_draft_signal,
    compute_signal,
    tokens_per_step,
)
from multiguess_operator.autoscaler.metrics import (
    ACCEPTED_TOKENS,
    DRAFT_FAILURES,
    DRAFT_REFUSED,
    DRAFT_REQUESTS,
    FALLBACK_STEPS,
    VERIFY_STEPS,
    MetricsError,
    Snapshot,
    mean,
    merge,
    parse,
    parse_draft,
    quantile,
)
from multiguess_operator.autoscaler.policy import PolicyConfig, decide
from multiguess_operator.autoscaler.scraper import PodTarget, fetch, ready_targets, scrape
from multiguess_operator.spec import AutoscalingSpec, DraftAutoscalingSpec

from tests.operator.exporters import exporter, free_port

INF = math.inf


def snap(buckets: dict[float, float], total: float = 0.0, waiting: float = 0.0) -> Snapshot:
    items = tuple(sorted(buckets.items()))
    return Snapshot(items, items[-1][1], total, waiting)


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ({0.1: 0, 0.5: 100, 1.0: 100, INF: 100}, 0.95, 0.1 + 0.4 * 0.95),  # interpolated inside (0.1, 0.5]
        ({0.1: 50, 0.5: 100, INF: 100}, 0.5, 0.1),  # exactly at a bound
        ({0.1: 0, 1.0: 0, INF: 10}, 0.95, 1.0),  # in +Inf: the highest finite bound
        ({0.25: 10, INF: 10}, 0.95, 0.25 * 0.95),  # first bucket interpolates from 0
        ({0.1: 0, INF: 0}, 0.95, 0.0),  # nothing observed
    ],
)
def test_quantile_interpolates_like_histogram_quantile(
    buckets: dict[float, float], q: float, expected: float
) -> None:
    assert quantile(q, snap(buckets)) == pytest.approx(expected)


def test_delta_and_reset() -> None:
    before = snap({0.5: 10, INF: 12}, total=3.0)
    after = snap({0.5: 15, INF: 20}, total=7.0)
    delta = after.minus(before)
    assert delta.buckets == ((0.5, 5), (INF, 8)) and delta.count == 8 and delta.total == pytest.approx(4.0)
    restarted = snap({0.5: 2, INF: 3}, total=1.0)
    assert restarted.minus(after) == restarted  # counts went down: the pod restarted
    assert after.minus(None) == after


def test_merge_sums_pods_and_refuses_mismatched_buckets() -> None:
    merged = merge([snap({0.5: 1, INF: 2}, 1.0, 3), snap({0.5: 3, INF: 4}, 2.0, 1)])
    assert merged is not None and merged.buckets == ((0.5, 4), (INF, 6)) and merged.waiting == 4
    assert merge([]) is None
    with pytest.raises(MetricsError):
        merge([snap({0.5: 1, INF: 2}), snap({1.0: 1, INF: 2})])


def test_parse_rejects_pages_without_the_histogram() -> None:
    with pytest.raises(MetricsError):
        parse("# HELP other_total x\n# TYPE other_total counter\nother_total 1\n")


def pod(name: str, ip: str | None, ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_ready_pods_with_an_ip_are_scraped() -> None:
    pods = [
        pod("a", "10.0.0.1"),
        pod("b", "10.0.0.2", ready=False),
        pod("c", None),
        pod("d", "10.0.0.4", terminating=True),
    ]
    assert ready_targets(pods, 8000) == [PodTarget("a", "uid-a", "http://10.0.0.1:8000/metrics")]


SPEC = AutoscalingSpec(enabled=True, target_queue_latency_seconds=0.5, target_waiting_requests=4)


async def test_scrape_real_exporters_with_an_unreachable_pod_and_a_restart() -> None:
    port = free_port()
    targets = [PodTarget(f"pod-{i}", f"uid-{i}", f"http://127.0.0.{i}:{port}/metrics") for i in (2, 3, 4)]
    scaler = Autoscaler()
    with exporter("127.0.0.2", port) as first, exporter("127.0.0.3", port) as second:
        for value in [0.01] * 50:
            first.queue.observe(value)
        snapshots, errors = await scrape(targets, timeout=2)
        assert set(snapshots) == {"uid-2", "uid-3"}
        assert set(errors) == {"pod-4"}  # nothing listens on 127.0.0.4
        assert scaler.observe(snapshots, now=0.0, interval=1.0) == ([], None)  # first sight: a baseline

        for value in [0.1] * 90 + [2.0] * 10:  # the interval's traffic, on the first pod
            first.queue.observe(value)
        second.waiting.set(6)
        snapshots, _ = await scrape(targets, timeout=2)
        deltas, elapsed = scaler.observe(snapshots, now=10.0, interval=1.0)
        assert elapsed == 10.0
        merged = merge(deltas)
        assert merged is not None and merged.count == 100  # the 50 earlier observations are not counted
        assert mean(merged) == pytest.approx(0.29)
        p95 = quantile(0.95, merged)
        assert 1.0 < p95 <= 2.5  # the top 10 % sit in the (1, 2.5] bucket
        signal = compute_signal(deltas, list(snapshots.values()), SPEC, elapsed)
        assert signal.p95 == pytest.approx(p95)
        assert signal.throughput == pytest.approx(10.0)  # 100 requests in 10 s
        assert signal.ratio == pytest.approx(p95 / 0.5)
        assert signal.waiting_per_pod == 3.0

    with exporter("127.0.0.2", port) as restarted:  # pod 2 restarted: its counters start again
        for value in [0.2] * 4:
            restarted.queue.observe(value)
        snapshots, errors = await scrape(targets, timeout=2)
        assert set(errors) == {"pod-3", "pod-4"}
        deltas, _ = scaler.observe(snapshots, now=20.0, interval=1.0)
        assert [d.count for d in deltas] == [4]


async def test_a_server_without_metrics_is_an_error(tmp_path: Path) -> None:
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.5", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        snapshots, errors = await scrape([PodTarget("p", "u", f"http://127.0.0.5:{port}/metrics")], timeout=2)
    finally:
        server.shutdown()
        server.server_close()
    assert not snapshots and "HTTP 404" in errors["p"]


@pytest.mark.parametrize(
    ("metric", "ratio"),
    [("queueLatencyP95", 0.875 / 0.5), ("queueLatencyMean", 0.3 / 0.5), ("requestsWaiting", 2 / 4)],
)
def test_signal_per_metric(metric: str, ratio: float) -> None:
    delta = Snapshot(((0.5, 80), (1.0, 100), (INF, 100)), 100, 30.0, 2)
    spec = AutoscalingSpec(
        enabled=True, metric=metric, target_queue_latency_seconds=0.5, target_waiting_requests=4
    )  # type: ignore[arg-type]
    assert compute_signal([delta], [delta], spec).ratio == pytest.approx(ratio, rel=0.02)


def test_the_signal_covers_the_last_three_intervals() -> None:
    scaler = Autoscaler()
    quiet = snap({0.5: 0, INF: 0})
    busy = [snap({0.5: 0, INF: n}, total=2.0 * n) for n in (10, 20, 20, 20, 20)]
    scaler.observe({"p": quiet}, now=0.0, interval=15.0)
    counts = []
    for i, s in enumerate(busy, start=1):
        deltas, elapsed = scaler.observe({"p": s}, now=15.0 * i, interval=15.0)
        counts.append((sum(d.count for d in deltas), elapsed))
    # 10 new, 10 new, then nothing new: the slow requests leave the signal three intervals later.
    assert counts == [(10, 15.0), (20, 30.0), (20, 45.0), (10, 45.0), (0, 45.0)]


def test_signal_without_pods_is_none_and_a_stalled_queue_still_counts() -> None:
    assert compute_signal([], [], SPEC).ratio is None
    stalled = Snapshot(((0.5, 0), (INF, 0)), 0, 0.0, 20)  # nothing left the queue, 20 waiting
    assert compute_signal([stalled], [stalled], SPEC).ratio == pytest.approx(5.0)


def test_autoscaler_state_survives_a_restart_through_the_status() -> None:
    scaler = Autoscaler()
    spec = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=8, scale_down_stabilization_seconds=300)
    first = scaler.decide(4, 4, compute_signal([], [snap({INF: 0})], spec), now=1000.0, spec=spec)
    assert first.replicas == 4  # a fresh autoscaler holds: the current size counts as recommended
    scaler.capacity = 1.5
    status = scaler.status(compute_signal([], [snap({INF: 0})], spec), first, 1, {}, "queueLatencyP95")
    restored = Autoscaler.restore(status)
    assert restored.window == scaler.window and restored.capacity == 1.5
    assert restored.history == scaler.history


def test_the_serving_images_own_metrics_parse() -> None:
    """Contract check against the real server registry (names, buckets, waiting gauge)."""
    server_metrics = pytest.importorskip("multiguess.metrics", reason="serving package not installed")
    from prometheus_client import generate_latest

    metrics = server_metrics.Metrics()
    for seconds in (0.02, 0.3, 0.3, 4.0):
        metrics.queue.observe(seconds)
    metrics.waiting.set(3)
    parsed = parse(generate_latest(metrics.registry).decode())
    assert parsed.count == 4 and parsed.waiting == 3 and parsed.total == pytest.approx(4.62)
    assert quantile(0.5, parsed) <= 0.5 < quantile(0.95, parsed)


async def test_a_failed_fetch_returns_its_error_instead_of_raising() -> None:
    """kopf re-raises the error of every task alive when the operator stops, and each fetch is a
    task: a pod refusing the scrape during shutdown failed the operator's exit (CI, stop 18)."""
    port = free_port()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        error = await fetch(session, PodTarget("p", "u", f"http://127.0.0.4:{port}/metrics"))
    assert isinstance(error, str) and error.startswith("ClientConnectorError:")


def counted(buckets: dict[float, float], total: float = 0.0, **counters: float) -> Snapshot:
    """A snapshot with counters given by series (``kind_timeout`` for ``...{kind=timeout}``)."""
    series = {}
    for key, value in counters.items():
        name, _, kind = key.partition("_kind_")
        series[f"{name}{{kind={kind}}}" if kind else name] = value
    items = tuple(sorted(buckets.items()))
    return Snapshot(items, items[-1][1], total, 0.0, tuple(sorted(series.items())))


VERIFY, ACCEPTED, FALLBACK = VERIFY_STEPS, ACCEPTED_TOKENS, FALLBACK_STEPS


def target_counters(steps: float, accepted: float, fallbacks: float = 0.0, **failures: float) -> Snapshot:
    values = {VERIFY: steps, ACCEPTED: accepted, FALLBACK: fallbacks}
    values |= {f"{DRAFT_FAILURES}{{kind={k}}}": v for k, v in failures.items()}
    return Snapshot(((INF, 0.0),), 0.0, 0.0, 0.0, tuple(sorted(values.items())))


def test_counters_parse_by_series_and_subtract_like_the_histogram() -> None:
    page = (
        "# TYPE multiguess_request_queue_seconds histogram\n"
        'multiguess_request_queue_seconds_bucket{le="+Inf"} 3\n'
        "multiguess_request_queue_seconds_count 3\nmultiguess_request_queue_seconds_sum 1\n"
        "# TYPE multiguess_spec_verify_steps counter\nmultiguess_spec_verify_steps_total 40\n"
        "# TYPE multiguess_remote_draft_failures counter\n"
        'multiguess_remote_draft_failures_total{kind="timeout"} 2\n'
        'multiguess_remote_draft_failures_total{kind="connection"} 1\n'
    )
    before = parse(page)
    assert before.counter(VERIFY) == 40 and before.counter(DRAFT_FAILURES) == 3
    assert before.counter(DRAFT_FAILURES, kind="timeout") == 2
    after = parse(page.replace("_total 40", "_total 70").replace('"timeout"} 2', '"timeout"} 5'))
    delta = after.minus(before)
    assert delta.counter(VERIFY) == 30 and delta.counter(DRAFT_FAILURES, kind="timeout") == 3
    restarted = parse(page.replace("_total 40", "_total 4"))
    assert restarted.minus(before) == restarted  # a counter went down: the pod restarted


def test_tokens_per_step_is_the_mean_accepted_length() -> None:
    scaler = Autoscaler()
    spec = AutoscalingSpec(enabled=True)
    queue = {0.5: 0, INF: 0}
    scaler.observe({"p": counted(queue, **{VERIFY: 100, ACCEPTED: 50})}, now=0.0, interval=15.0)
    deltas, elapsed = scaler.observe({"p": counted(queue, **{VERIFY: 300, ACCEPTED: 350})}, 15.0, 15.0)
    assert compute_signal(deltas, deltas, spec, elapsed).tokens_per_step == pytest.approx(2.5)
    assert tokens_per_step(None) is None


DRAFT_SPEC = DraftAutoscalingSpec(
    enabled=True, target_busy_fraction=0.5, target_step_latency_seconds=0.1, target_fallback_fraction=0.05
)


def draft_delta(steps: int, seconds: float) -> Snapshot:
    return Snapshot(((0.05, 0.0), (0.1, float(steps)), (INF, float(steps))), float(steps), steps * seconds, 0)


@pytest.mark.parametrize(
    ("targets", "ratio", "counted"),
    [
        ([], 0.8 / 0.5, False),  # busy 80 % of 10 s on each of 2 pods (no targets scraped)
        ([target_counters(100, 200)], 0.8 / 0.5, True),  # no fallbacks
        ([target_counters(100, 100, 50, timeout=5)], 0.8 / 0.5 / 0.5, True),  # half the demand unserved
        ([target_counters(100, 100, 50, server=5)], 0.8 / 0.5 / 0.5, True),  # refused: out of sessions
        ([target_counters(100, 200, 1, timeout=1)], 0.8 / 0.5, True),  # 1 %: under the 5 % target
        ([target_counters(100, 100, 50, connection=5)], 0.8 / 0.5, False),  # breakage is no reason
    ],
)
def test_draft_signal_is_the_largest_of_busy_time_step_latency_and_fallbacks(
    targets: list[Snapshot], ratio: float, counted: bool
) -> None:
    drafts = [draft_delta(100, 0.08), draft_delta(100, 0.08)]  # 8 s of drafting per pod in 10 s
    signal = compute_draft_signal(drafts, 2, targets, DRAFT_SPEC, elapsed=10.0)
    assert signal.value == pytest.approx(0.8) and signal.fallbacks_counted == counted
    assert signal.ratio == pytest.approx(ratio, rel=0.02)
    assert signal.step_p95 is not None and signal.step_p95 <= 0.1


def test_a_pool_that_looks_idle_while_its_targets_fall_back_scales_up() -> None:
    """Targets that timed out pause speculation and send nothing: the pool's own busy time is low."""
    drafts = [draft_delta(10, 0.05)]  # 5 % busy
    signal = compute_draft_signal(drafts, 1, [target_counters(100, 20, 90, timeout=3)], DRAFT_SPEC, 10.0)
    assert signal.ratio == pytest.approx(1.0 / 0.1)  # 90 % unserved: ten times the target's busy time


def test_draft_signal_without_draft_pods_or_deltas_is_none() -> None:
    assert compute_draft_signal([], 0, [], DRAFT_SPEC, None).ratio is None
    assert compute_draft_signal([], 2, [target_counters(10, 10)], DRAFT_SPEC, None).ratio is None


def test_drafts_per_target_is_learned_from_loaded_intervals_and_leads_target_scale_ups() -> None:
    scaler = DraftAutoscaler()
    scaler.drafts.stable = True
    idle = DraftSignal(0.1, 0.1, fallback_fraction=0.0)
    scaler.learn(idle, 2, 8, DRAFT_SPEC)
    assert scaler.per_target is None  # an idle pool says nothing about what a target needs
    loaded = DraftSignal(0.8, 0.4, fallback_fraction=0.0)  # 2 drafts at 80 % of their target, 8 targets
    scaler.learn(loaded, 2, 8, DRAFT_SPEC)
    assert scaler.per_target == pytest.approx(2 * 0.8 / 8)
    scaler.learn(DraftSignal(5.0, 0.4, fallback_fraction=0.3), 2, 8, DRAFT_SPEC)
    assert scaler.per_target == pytest.approx(0.2)  # a saturated pool's share is not the need
    assert scaler.follow(16, 8) == 4  # 8 more targets coming: drafts for all 16 now
    assert scaler.follow(8, 8) == 0  # the targets are serving: the drafts' own signal rules
    status = scaler.status(loaded, decide(2, 0.8, 0.0, (), PolicyConfig(1, 4)), 2, {}, 8)
    assert DraftAutoscaler.restore(status).per_target == pytest.approx(0.2)


def test_the_serving_images_speculation_and_draft_metrics_parse() -> None:
    """Contract check against the real registries: the target's speculation counters and remote
    drafter failures by kind, the draft server's step histogram."""
    server_metrics = pytest.importorskip("multiguess.metrics", reason="serving package not installed")
    remote = pytest.importorskip("multiguess.remote.metrics", reason="serving package not installed")
    from prometheus_client import generate_latest

    target = server_metrics.Metrics()
    client = remote.ClientMetrics(target.registry)
    target.queue.observe(0.1)
    target.spec["verify_steps"].inc(10)
    target.spec["accepted_tokens"].inc(15)
    target.fallback_steps.labels(reason="timeout").inc(2)
    client.failures.labels(kind="timeout").inc(3)
    client.refused.inc(1)
    page = parse(generate_latest(target.registry).decode())
    assert tokens_per_step(page) == pytest.approx(2.5)
    assert page.counter(FALLBACK_STEPS) == 2 and page.counter(DRAFT_FAILURES, kind="timeout") == 3
    assert page.counter(DRAFT_REFUSED) == 1

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    draft = remote.ServerMetrics(registry)
    for seconds in (0.004, 0.006):
        draft.step.observe(seconds)
    draft.requests.inc(8)
    parsed = parse_draft(generate_latest(registry).decode())
    assert parsed.count == 2 and parsed.total == pytest.approx(0.01) and parsed.counter(DRAFT_REQUESTS) == 8
