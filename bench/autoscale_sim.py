"""Discrete-event simulation of the autoscaler: the operator's real signal and policy code
(``Autoscaler.observe/decide``, ``compute_signal``, ``compute_draft_signal``, ``DraftAutoscaler``)
against a fleet of simulated serving pods.

Each pod runs ``slots`` requests at once (the engine's batch) and queues the rest FIFO; the Service
spreads requests at random over ready pods (kube-proxy); a new pod serves only after a start-up
delay (scheduling + model loading); a removed pod stops receiving traffic and drains. Every
``interval`` the autoscaler scrapes each ready pod's cumulative queue histogram (the serving image's
buckets) and waiting gauge, exactly as the operator does over HTTP.

    .venv/bin/python bench/autoscale_sim.py --plot docs/img/autoscale.png --json bench/autoscale_sim.json

``--two-pool`` runs the speculative fleet instead (targets and a separate draft pool; see
``simulate_two_pool``) under three policies in one run and plots it:

    .venv/bin/python bench/autoscale_sim.py --two-pool --plot docs/img/autoscale-two-pool.png
"""

from __future__ import annotations

import argparse
import bisect
import collections
import heapq
import itertools
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from multiguess_operator.autoscaler.loop import (
    Autoscaler,
    DraftAutoscaler,
    compute_draft_signal,
    compute_signal,
)
from multiguess_operator.autoscaler.metrics import (
    ACCEPTED_TOKENS,
    DRAFT_FAILURES,
    FALLBACK_STEPS,
    VERIFY_STEPS,
    Snapshot,
)
from multiguess_operator.spec import AutoscalingSpec, DraftAutoscalingSpec

# The serving image's multiguess_request_queue_seconds buckets (server/multiguess/metrics.py).
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf)


@dataclass(frozen=True)
class Profile:
    """Service time of one request on one pod. Defaults: DESIGN.md's measured ~40 ms per generated
    token for the embedded target on 2 CPU cores, 128-token replies (lognormal, CV 0.5), 8 batch slots;
    a GPU profile changes the scale of the numbers, not the dynamics."""

    per_token_seconds: float = 0.040
    tokens_mean: float = 128.0
    tokens_cv: float = 0.5
    slots: int = 8
    startup_seconds: float = 90.0
    max_queue: int = 64  # spec.serving.maxQueue: a pod answers 429 when its queue is full

    @property
    def mean_service_seconds(self) -> float:
        return self.per_token_seconds * self.tokens_mean

    @property
    def pod_capacity_rps(self) -> float:
        return self.slots / self.mean_service_seconds

    def service_time(self, rng: random.Random) -> float:
        sigma = math.sqrt(math.log(1 + self.tokens_cv**2))
        tokens = rng.lognormvariate(math.log(self.tokens_mean) - sigma**2 / 2, sigma)
        return max(1.0, tokens) * self.per_token_seconds


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[tuple[float, float], ...]  # (duration s, offered load in pods' worth of work)
    min_replicas: int
    max_replicas: int
    max_scale_up: float = 2.0  # spec.autoscaling.maxScaleUpFactor
    bursty: bool = False  # on/off bursts (×burst_factor) on top of the phases, exponential sojourns
    burst_factor: float = 3.0
    burst_mean_seconds: float = 45.0
    quiet_mean_seconds: float = 180.0


@dataclass
class Pod:
    ready_at: float
    busy: int = 0
    queue: collections.deque[float] = field(default_factory=collections.deque)
    cumulative: list[int] = field(default_factory=lambda: [0] * len(QUEUE_BUCKETS))
    count: int = 0
    total: float = 0.0
    draining: bool = False
    verify_steps: float = 0.0  # the speculation counters (two-pool model only)
    accepted_tokens: float = 0.0
    fallback_steps: float = 0.0
    draft_timeouts: float = 0.0

    def snapshot(self) -> Snapshot:
        running, buckets = 0, []
        for le, n in zip(QUEUE_BUCKETS, self.cumulative, strict=True):
            running += n
            buckets.append((float(le), float(running)))
        counters = (
            (ACCEPTED_TOKENS, self.accepted_tokens),
            (f"{DRAFT_FAILURES}{{kind=timeout}}", self.draft_timeouts),
            (FALLBACK_STEPS, self.fallback_steps),
            (VERIFY_STEPS, self.verify_steps),
        )
        return Snapshot(tuple(buckets), float(self.count), self.total, float(len(self.queue)), counters)

    def observe(self, seconds: float) -> None:
        self.cumulative[bisect.bisect_left(QUEUE_BUCKETS, seconds)] += 1
        self.count += 1
        self.total += seconds


@dataclass
class Interval:
    time: float
    offered_pods: float
    desired: int
    ready: int
    p95_true: float | None
    signal: float | None
    reason: str
    rejected: int = 0  # 429s in the interval (queue full)


def rate_schedule(scenario: Scenario, profile: Profile, rng: random.Random) -> list[tuple[float, float]]:
    """Piecewise-constant arrival rate as (start time, requests/s)."""
    points: list[tuple[float, float]] = []
    start = 0.0
    for duration, pods in scenario.phases:
        points.append((start, pods * profile.pod_capacity_rps))
        start += duration
    if scenario.bursty:
        bursty, t, on = [], 0.0, False
        while t < start:
            base = next(rate for s, rate in reversed(points) if s <= t)
            bursty.append((t, base * (scenario.burst_factor if on else 1.0)))
            t += rng.expovariate(1 / (scenario.burst_mean_seconds if on else scenario.quiet_mean_seconds))
            on = not on
        points = _merge_schedules(points, bursty, scenario, start)
    points.append((start, 0.0))
    return points


def _merge_schedules(
    base: list[tuple[float, float]], bursts: list[tuple[float, float]], scenario: Scenario, end: float
) -> list[tuple[float, float]]:
    times = sorted({t for t, _ in base} | {t for t, _ in bursts})
    merged = []
    for t in times:
        rate = next(r for s, r in reversed(base) if s <= t)
        burst_rate = next(r for s, r in reversed(bursts) if s <= t)
        factor = scenario.burst_factor if burst_rate > next(r for s, r in reversed(base) if s <= t) else 1.0
        merged.append((t, rate * factor))
    return [(t, r) for t, r in merged if t < end]


def simulate(
    scenario: Scenario, profile: Profile, interval: float, stabilization: float, target: float, seed: int
) -> list[Interval]:
    rng = random.Random(seed)
    schedule = rate_schedule(scenario, profile, rng)
    end = schedule[-1][0]
    spec = AutoscalingSpec(
        enabled=True,
        min_replicas=scenario.min_replicas,
        max_replicas=scenario.max_replicas,
        target_queue_latency_seconds=target,
        interval_seconds=int(interval),
        scale_down_stabilization_seconds=int(stabilization),
        max_scale_up_factor=scenario.max_scale_up,
    )
    initial = max(scenario.min_replicas, math.ceil(scenario.phases[0][1] / 0.7))
    pods = {i: Pod(ready_at=0.0) for i in range(initial)}
    next_id = initial
    desired = initial
    scaler = Autoscaler()
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def push(t: float, kind: str, pod_id: int = -1) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, pod_id))

    def start(pod_id: int, now: float, arrived: float) -> None:
        pod = pods[pod_id]
        pod.busy += 1
        wait = now - arrived
        pod.observe(wait)
        started.append(wait)
        push(now + profile.service_time(rng), "done", pod_id)

    def next_arrival(now: float) -> float | None:
        t = now
        while True:
            idx = bisect.bisect_right([s for s, _ in schedule], t) - 1
            rate = schedule[idx][1]
            boundary = schedule[idx + 1][0] if idx + 1 < len(schedule) else math.inf
            if rate <= 0:
                if math.isinf(boundary):
                    return None
                t = boundary
                continue
            candidate = t + rng.expovariate(rate)
            if candidate < boundary:
                return candidate
            t = boundary  # memoryless: redraw at the rate change

    first = next_arrival(0.0)
    if first is not None:
        push(first, "arrival")
    push(interval, "scrape")
    started: list[float] = []
    records: list[Interval] = []
    rejected = [0]
    while events:
        now, _, kind, pod_id = heapq.heappop(events)
        if now > end:
            break
        if kind == "arrival":
            ready = [i for i, p in pods.items() if p.ready_at <= now and not p.draining]
            chosen = rng.choice(ready)
            pod = pods[chosen]
            if pod.busy < profile.slots:
                start(chosen, now, now)
            elif len(pod.queue) < profile.max_queue:
                pod.queue.append(now)
            else:
                rejected[0] += 1
            following = next_arrival(now)
            if following is not None:
                push(following, "arrival")
        elif kind == "done":
            pod = pods[pod_id]
            pod.busy -= 1
            if pod.queue:
                start(pod_id, now, pod.queue.popleft())
            elif pod.draining and pod.busy == 0:
                del pods[pod_id]
        elif kind == "scrape":
            ready_ids = [i for i, p in pods.items() if p.ready_at <= now and not p.draining]
            snapshots = {str(i): pods[i].snapshot() for i in ready_ids}
            deltas, elapsed = scaler.observe(snapshots, now, interval)
            signal = compute_signal(deltas, list(snapshots.values()), spec, elapsed)
            decision = scaler.decide(desired, len(ready_ids), signal, now, spec)
            p95 = _p95(started)
            offered = next(r for s, r in reversed(schedule) if s <= now) / profile.pod_capacity_rps
            records.append(
                Interval(
                    now, offered, desired, len(ready_ids), p95, signal.value, decision.reason, rejected[0]
                )
            )
            started, rejected[0] = [], 0
            if decision.replicas > desired:
                for _ in range(decision.replicas - desired):
                    pods[next_id] = Pod(ready_at=now + profile.startup_seconds)
                    next_id += 1
            elif decision.replicas < desired:
                # Not-yet-ready pods go first, then the newest; a removed pod drains its work.
                victims = sorted(
                    (i for i, p in pods.items() if not p.draining),
                    key=lambda i: (pods[i].ready_at <= now, -i),
                )[: desired - decision.replicas]
                for i in victims:
                    pods[i].draining = True
                    pods[i].queue, requeue = collections.deque(), list(pods[i].queue)
                    for arrived in requeue:  # queued work is retried elsewhere
                        others = [j for j, p in pods.items() if p.ready_at <= now and not p.draining]
                        target_pod = pods[rng.choice(others)]
                        target_pod.queue.append(arrived)
                    if pods[i].busy == 0:
                        del pods[i]
            desired = decision.replicas
            push(now + interval, "scrape")
    return records


def _p95(values: list[float]) -> float | None:
    if len(values) < 20:
        return None
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def summarize(records: list[Interval], scenario: Scenario, target: float) -> dict[str, Any]:
    """Scale events, direction changes, and for each load increase: when p95 got back under target
    (after its peak) and how often a 15 s interval's p95 still went over it for the rest of the phase."""
    desired = [r.desired for r in records]
    changes = [(a, b) for a, b in itertools.pairwise(desired) if a != b]
    directions = [1 if b > a else -1 for a, b in changes]
    reversals = sum(1 for a, b in itertools.pairwise(directions) if a != b)
    recoveries = []
    t0 = 0.0
    for (duration, load), previous in zip(scenario.phases[1:], scenario.phases, strict=False):
        t0 += previous[0]
        if load <= previous[1]:
            continue
        phase = [r for r in records if t0 <= r.time < t0 + duration and r.p95_true is not None]
        peak = max(range(len(phase)), key=lambda i: phase[i].p95_true or 0.0)
        back = next((i for i in range(peak, len(phase)) if (phase[i].p95_true or 0.0) <= target), len(phase))
        rest = phase[back:]
        recoveries.append(
            {
                "step_at_s": t0,
                "load_from": previous[1],
                "load_to": load,
                "peak_p95_s": round(phase[peak].p95_true or 0.0, 2),
                "back_under_target_after_s": phase[back].time - t0 if rest else None,
                "over_target_afterwards_pct": round(
                    100 * sum((r.p95_true or 0.0) > target for r in rest) / max(1, len(rest)), 1
                ),
                "max_p95_afterwards_s": round(max(((r.p95_true or 0.0) for r in rest), default=0.0), 2),
            }
        )
    steady = [r for r in records if r.p95_true is not None]
    return {
        "scenario": scenario.name,
        "scale_events": len(changes),
        "direction_reversals": reversals,
        "max_replicas": max(desired),
        "final_replicas": desired[-1],
        "rejected_requests": sum(r.rejected for r in records),
        "intervals_over_target_pct": round(
            100 * sum(r.p95_true > target for r in steady) / max(1, len(steady)), 1
        ),
        "steps": recoveries,
    }


SCENARIOS = (
    Scenario("poisson step ×4", ((600, 1.5), (2400, 6.0), (2400, 1.5)), min_replicas=2, max_replicas=40),
    Scenario(
        "bursty (×3 bursts)",
        ((600, 2.0), (3600, 4.0), (1200, 2.0)),
        min_replicas=2,
        max_replicas=40,
        bursty=True,
    ),
    Scenario(
        "large step 20→250 pods",
        ((600, 20.0), (2400, 250.0), (1800, 60.0)),
        min_replicas=10,
        max_replicas=1000,
        max_scale_up=4.0,
    ),
)


def plot(results: list[tuple[Scenario, list[Interval]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 6.5), sharex="col")
    for col, (scenario, records) in enumerate(results):
        minutes = [r.time / 60 for r in records]
        top, bottom = axes[0][col], axes[1][col]
        top.step(
            minutes,
            [r.offered_pods for r in records],
            where="post",
            label="offered load (pods' worth)",
            color="0.6",
        )
        top.step(minutes, [r.desired for r in records], where="post", label="desired replicas", color="C0")
        top.step(
            minutes, [r.ready for r in records], where="post", label="ready replicas", color="C2", ls="--"
        )
        top.set_title(scenario.name)
        top.set_ylabel("pods")
        top.legend(fontsize=7, loc="upper right")
        bottom.plot(
            minutes,
            [r.p95_true if r.p95_true is not None else float("nan") for r in records],
            color="C3",
            lw=1,
            label="p95 queue latency (true, per interval)",
        )
        bottom.axhline(target, color="k", ls=":", label=f"target {target} s")
        bottom.set_yscale("symlog", linthresh=0.05)
        bottom.set_ylim(0, None)
        bottom.set_xlabel("minutes")
        bottom.set_ylabel("seconds")
        bottom.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# -- Two pools: targets and a separate draft pool ------------------------------------------------

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, math.inf)
TICK_SECONDS = 5.0  # the draft pool's mean-field state is recomputed this often


@dataclass(frozen=True)
class SpecProfile:
    """A speculative fleet on GPUs: the numbers are illustrative, the mechanisms are the product's.

    A target pod verifies its batch in one forward of ``plain_step_seconds`` (on a GPU nearly flat
    in the tree's size, DESIGN.md), after a draft round trip: network plus a wait for the draft
    server's current batch plus its own batch. A draft server batches whatever queued, so its batch
    grows with load and its step is ``draft_batch_seconds / (1 - busy)``; each sequence-step costs
    it ``draft_seconds_per_step`` of compute. A draft step that takes longer than the targets'
    ``draft_timeout_seconds`` fails; the target's guard then pauses speculation for
    ``pause_seconds`` and decodes plainly (one token per step, no round trip, no draft load)."""

    plain_step_seconds: float = 0.030
    draft_batch_seconds: float = 0.005
    draft_seconds_per_step: float = 0.0005
    network_seconds: float = 0.002
    draft_timeout_seconds: float = 0.25
    pause_seconds: float = 30.0
    tokens_mean: float = 1024.0
    tokens_cv: float = 0.5
    slots: int = 8
    max_queue: int = 64
    target_startup_seconds: float = 120.0
    draft_startup_seconds: float = 60.0

    def seconds_per_token(self, accepted_length: float) -> float:
        """Per sequence, speculating with an idle draft pool."""
        return (self.plain_step_seconds + self.idle_round_trip) / accepted_length

    @property
    def idle_round_trip(self) -> float:
        return self.network_seconds + 1.5 * self.draft_batch_seconds

    def pod_capacity_rps(self, accepted_length: float) -> float:
        return self.slots / (self.tokens_mean * self.seconds_per_token(accepted_length))

    def service_time(self, rng: random.Random, seconds_per_token: float) -> float:
        sigma = math.sqrt(math.log(1 + self.tokens_cv**2))
        tokens = rng.lognormvariate(math.log(self.tokens_mean) - sigma**2 / 2, sigma)
        return max(1.0, tokens) * seconds_per_token


@dataclass(frozen=True)
class DraftState:
    """The draft pool and the targets that use it, at one tick (mean field: load spreads evenly)."""

    busy: float  # share of a draft pod's time spent drafting
    step_seconds: float
    round_trip: float
    timeouts_per_pod: float  # draft timeouts per target pod per second
    paused: float  # share of target sequence-time decoded without speculation
    seconds_per_token: float  # per sequence, speculating and paused steps together


def draft_state(
    profile: SpecProfile, accepted_length: float, busy_sequences: float, draft_pods: int
) -> DraftState:
    """The fixed point of a closed loop: draft load raises the round trip, a longer round trip
    times out more often, each timeout pauses a target's speculation, paused targets send no draft
    load. Draft round trips are taken as exponential (mean ``round_trip``); found by bisection on
    the paused share, which the loop's response decreases monotonically."""
    v = profile.plain_step_seconds

    def respond(paused: float) -> tuple[float, DraftState]:
        sequences = (1 - paused) * busy_sequences  # those that wait for a draft each step
        if draft_pods <= 0:
            busy, step = 1.0, math.inf
        else:
            # The draft pods' busy share and the round trip set each other: more load, longer
            # batches, longer round trips, fewer steps per second. Bisection on the busy share.
            low, high = 0.0, 0.9999
            for _ in range(40):
                busy = (low + high) / 2
                trip = profile.network_seconds + 1.5 * profile.draft_batch_seconds / (1 - busy)
                implied = profile.draft_seconds_per_step * sequences / (v + trip) / draft_pods
                low, high = (busy, high) if implied > busy else (low, busy)
            busy = high
            step = profile.draft_batch_seconds / (1 - busy)
        trip = profile.network_seconds + 1.5 * step
        timeout = math.exp(-profile.draft_timeout_seconds / trip) if math.isfinite(trip) else 1.0
        rate = timeout / (v + trip) if math.isfinite(trip) else 1.0 / v
        implied = profile.pause_seconds * rate / (1 + profile.pause_seconds * rate)
        speculating = (1 - paused) * accepted_length / (v + trip) if math.isfinite(trip) else 0.0
        tokens = speculating + paused / v
        return implied, DraftState(busy, step, trip, rate * (1 - paused), paused, 1 / max(tokens, 1e-9))

    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        implied, _ = respond(middle)
        low, high = (middle, high) if implied > middle else (low, middle)
    return respond(high)[1]


@dataclass(frozen=True)
class TwoPoolScenario:
    name: str
    load: tuple[
        tuple[float, float], ...
    ]  # (start s, offered load in target pods' worth at the start's acceptance)
    acceptance: tuple[tuple[float, float], ...]  # (time s, mean accepted length), linear in between
    duration: float
    min_targets: int = 10
    max_targets: int = 1000
    min_drafts: int = 1
    max_drafts: int = 64
    max_scale_up: float = 2.0

    def accepted_length(self, t: float) -> float:
        points = self.acceptance
        for (t0, a0), (t1, a1) in itertools.pairwise(points):
            if t0 <= t < t1:
                return a0 + (a1 - a0) * (t - t0) / (t1 - t0)
        return points[-1][1] if t >= points[-1][0] else points[0][1]

    def offered(self, t: float) -> float:
        return next(load for start, load in reversed(self.load) if start <= t)


@dataclass(frozen=True)
class Policy:
    name: str
    scale_drafts: bool
    fixed_drafts: int | None = None  # None: sized for the initial load


@dataclass
class TwoPoolInterval:
    time: float
    offered_pods: float
    targets: int
    targets_ready: int
    drafts: int
    drafts_ready: int
    accepted_length: float
    measured_tokens_per_step: float | None
    paused: float
    draft_busy: float
    p95_queue: float | None
    target_reason: str
    draft_reason: str


@dataclass
class TwoPoolRun:
    policy: Policy
    intervals: list[TwoPoolInterval]
    queue_waits: list[float]
    e2e: list[float]
    target_gpu_seconds: float
    draft_gpu_seconds: float
    rejected: int


def drafts_for(profile: SpecProfile, offered_rps: float, accepted_length: float, busy: float) -> int:
    """Draft pods that carry ``offered_rps`` at ``busy`` (Little's law for the busy sequences)."""
    sequences = offered_rps * profile.tokens_mean * profile.seconds_per_token(accepted_length)
    steps = sequences / (profile.plain_step_seconds + profile.idle_round_trip)
    return max(1, math.ceil(steps * profile.draft_seconds_per_step / busy))


def simulate_two_pool(
    scenario: TwoPoolScenario,
    profile: SpecProfile,
    policy: Policy,
    interval: float,
    stabilization: float,
    target: float,
    seed: int,
) -> TwoPoolRun:
    """The operator's two autoscalers (or the targets' alone) against targets and drafts.

    Targets are simulated request by request, as in ``simulate``; a request's service time is its
    reply length × the seconds per token of the draft pool's state when it starts. The draft pool
    is a mean-field model recomputed every ``TICK_SECONDS`` (``draft_state``); every scrape reads
    both pools' metrics as the operator would: queue histograms and speculation counters from the
    targets, draft step histograms from the drafts."""
    rng = random.Random(seed)
    base_rps = profile.pod_capacity_rps(scenario.accepted_length(0.0))
    target_spec = AutoscalingSpec(
        enabled=True,
        min_replicas=scenario.min_targets,
        max_replicas=scenario.max_targets,
        target_queue_latency_seconds=target,
        interval_seconds=int(interval),
        scale_down_stabilization_seconds=int(stabilization),
        max_scale_up_factor=scenario.max_scale_up,
    )
    draft_spec = DraftAutoscalingSpec(
        enabled=True,
        min_replicas=scenario.min_drafts,
        max_replicas=scenario.max_drafts,
        interval_seconds=int(interval),
        scale_down_stabilization_seconds=int(stabilization),
        max_scale_up_factor=scenario.max_scale_up,
    )
    first_load = scenario.load[0][1]
    initial = max(scenario.min_targets, math.ceil(first_load / 0.7))
    sized = drafts_for(
        profile, first_load * base_rps, scenario.accepted_length(0.0), draft_spec.target_busy_fraction
    )
    drafts_wanted = policy.fixed_drafts or sized
    pods = {i: Pod(ready_at=0.0) for i in range(initial)}
    next_id = initial
    desired = initial
    draft_ready_at = [0.0] * drafts_wanted  # one entry per draft pod
    scaler, draft_scaler = Autoscaler(), DraftAutoscaler()
    state = draft_state(profile, scenario.accepted_length(0.0), 0.0, drafts_wanted)
    run = TwoPoolRun(policy, [], [], [], 0.0, 0.0, 0)
    events: list[tuple[float, int, str, int]] = []
    seq = itertools.count()
    draft_metrics = {"count": [0.0] * len(STEP_BUCKETS), "sum": 0.0}
    started: list[float] = []
    ready_ids: list[int] = []

    def push(t: float, kind: str, pod_id: int = -1) -> None:
        heapq.heappush(events, (t, next(seq), kind, pod_id))

    def refresh(now: float) -> None:
        ready_ids[:] = [i for i, p in pods.items() if p.ready_at <= now and not p.draining]

    def begin(pod_id: int, now: float, arrived: float) -> None:
        pod = pods[pod_id]
        pod.busy += 1
        wait = now - arrived
        pod.observe(wait)
        started.append(wait)
        service = profile.service_time(rng, state.seconds_per_token)
        run.queue_waits.append(wait)
        run.e2e.append(wait + service)
        push(now + service, "done", pod_id)

    def arrival_rate(t: float) -> float:
        return scenario.offered(t) * base_rps

    push(rng.expovariate(arrival_rate(0.0)), "arrival")
    push(TICK_SECONDS, "tick")
    refresh(0.0)
    ticks = 0
    while events:
        now, _, kind, pod_id = heapq.heappop(events)
        if now > scenario.duration:
            break
        if kind == "arrival":
            chosen = rng.choice(ready_ids)
            pod = pods.get(chosen)
            if pod is None or pod.draining:
                refresh(now)
                chosen = rng.choice(ready_ids)
                pod = pods[chosen]
            if pod.busy < profile.slots:
                begin(chosen, now, now)
            elif len(pod.queue) < profile.max_queue:
                pod.queue.append(now)
            else:
                run.rejected += 1
            push(now + rng.expovariate(arrival_rate(now)), "arrival")
        elif kind == "done":
            pod = pods[pod_id]
            pod.busy -= 1
            if pod.queue:
                begin(pod_id, now, pod.queue.popleft())
            elif pod.draining and pod.busy == 0:
                del pods[pod_id]
        elif kind == "tick":
            ticks += 1
            refresh(now)
            accepted = scenario.accepted_length(now)
            ready_drafts = sum(1 for r in draft_ready_at if r <= now)
            busy_sequences = float(sum(p.busy for p in pods.values()))
            state = draft_state(profile, accepted, busy_sequences, ready_drafts)
            record_tick(profile, state, accepted, pods, draft_metrics)
            run.target_gpu_seconds += len(pods) * TICK_SECONDS
            run.draft_gpu_seconds += len(draft_ready_at) * TICK_SECONDS
            if ticks % round(interval / TICK_SECONDS) == 0:
                snapshots = {str(i): pods[i].snapshot() for i in ready_ids}
                deltas, elapsed = scaler.observe(snapshots, now, interval)
                signal = compute_signal(deltas, list(snapshots.values()), target_spec, elapsed)
                decision = scaler.decide(desired, len(ready_ids), signal, now, target_spec)
                draft_reason = "Fixed"
                if policy.scale_drafts:
                    drafts = {
                        str(i): draft_snapshot(draft_metrics)
                        for i, r in enumerate(draft_ready_at)
                        if r <= now
                    }
                    draft_deltas, draft_elapsed = draft_scaler.drafts.observe(drafts, now, interval)
                    target_deltas, _ = draft_scaler.targets.observe(snapshots, now, interval)
                    dsignal = compute_draft_signal(
                        draft_deltas, len(drafts), target_deltas, draft_spec, draft_elapsed
                    )
                    draft_scaler.learn(dsignal, len(drafts), len(ready_ids), draft_spec)
                    follow = draft_scaler.follow(decision.replicas, len(ready_ids))
                    ddecision = draft_scaler.drafts.decide(
                        len(draft_ready_at), len(drafts), dsignal, now, draft_spec, follow
                    )
                    draft_reason = ddecision.reason
                    resize_drafts(
                        draft_ready_at, ddecision.replicas, now + profile.draft_startup_seconds, now
                    )
                run.intervals.append(
                    TwoPoolInterval(
                        now,
                        scenario.offered(now),
                        desired,
                        len(ready_ids),
                        len(draft_ready_at),
                        ready_drafts,
                        accepted,
                        signal.tokens_per_step,
                        state.paused,
                        state.busy,
                        _p95(started),
                        decision.reason,
                        draft_reason,
                    )
                )
                started = []
                next_id = resize_targets(pods, desired, decision.replicas, now, profile, next_id, rng)
                desired = decision.replicas
                refresh(now)
            push(now + TICK_SECONDS, "tick")
    return run


def record_tick(
    profile: SpecProfile,
    state: DraftState,
    accepted: float,
    pods: dict[int, Pod],
    draft_metrics: dict[str, Any],
) -> None:
    """One tick's speculation counters on every target pod and step histogram on the draft pods."""
    v = profile.plain_step_seconds
    for pod in pods.values():
        if pod.busy:
            speculating = pod.busy * (1 - state.paused) * TICK_SECONDS / (v + state.round_trip)
            plain = pod.busy * state.paused * TICK_SECONDS / v
            pod.verify_steps += speculating + plain
            pod.accepted_tokens += speculating * (accepted - 1)
            pod.fallback_steps += plain
            pod.draft_timeouts += state.timeouts_per_pod * TICK_SECONDS
    if math.isfinite(state.step_seconds):
        batches = state.busy * TICK_SECONDS / state.step_seconds
        draft_metrics["count"][bisect.bisect_left(STEP_BUCKETS, state.step_seconds)] += batches
        draft_metrics["sum"] += state.busy * TICK_SECONDS


def draft_snapshot(draft_metrics: dict[str, Any]) -> Snapshot:
    """Every ready draft pod shows the same (mean-field) cumulative step histogram."""
    running, buckets = 0.0, []
    for le, n in zip(STEP_BUCKETS, draft_metrics["count"], strict=True):
        running += n
        buckets.append((float(le), running))
    return Snapshot(tuple(buckets), running, draft_metrics["sum"], 0.0)


def resize_drafts(ready_at: list[float], wanted: int, ready_time: float, now: float) -> None:
    """Add pods that serve after their start-up, or remove not-yet-ready ones first, then the newest."""
    while len(ready_at) < wanted:
        ready_at.append(ready_time)
    while len(ready_at) > wanted:
        starting = [i for i, r in enumerate(ready_at) if r > now]
        ready_at.pop(starting[-1] if starting else len(ready_at) - 1)


def resize_targets(
    pods: dict[int, Pod],
    current: int,
    wanted: int,
    now: float,
    profile: SpecProfile,
    next_id: int,
    rng: random.Random,
) -> int:
    if wanted > current:
        for _ in range(wanted - current):
            pods[next_id] = Pod(ready_at=now + profile.target_startup_seconds)
            next_id += 1
    elif wanted < current:
        victims = sorted(
            (i for i, p in pods.items() if not p.draining), key=lambda i: (pods[i].ready_at <= now, -i)
        )[: current - wanted]
        for i in victims:
            pods[i].draining = True
            pods[i].queue, requeue = collections.deque(), list(pods[i].queue)
            others = [j for j, p in pods.items() if p.ready_at <= now and not p.draining]
            for arrived in requeue:  # queued work is retried elsewhere
                pods[rng.choice(others)].queue.append(arrived)
            if pods[i].busy == 0:
                del pods[i]
    return next_id


def summarize_two_pool(run: TwoPoolRun, target: float) -> dict[str, Any]:
    timed = [r for r in run.intervals if r.p95_queue is not None]
    waits, e2e = sorted(run.queue_waits), sorted(run.e2e)
    return {
        "policy": run.policy.name,
        "target_gpu_hours": round(run.target_gpu_seconds / 3600, 1),
        "draft_gpu_hours": round(run.draft_gpu_seconds / 3600, 1),
        "gpu_hours": round((run.target_gpu_seconds + run.draft_gpu_seconds) / 3600, 1),
        "p95_queue_s": round(waits[int(0.95 * (len(waits) - 1))], 3),
        "p95_e2e_s": round(e2e[int(0.95 * (len(e2e) - 1))], 2),
        "intervals_over_target_pct": round(
            100 * sum((r.p95_queue or 0.0) > target for r in timed) / max(1, len(timed)), 1
        ),
        "max_targets": max(r.targets for r in run.intervals),
        "max_drafts": max(r.drafts for r in run.intervals),
        "mean_paused_pct": round(100 * statistics.fmean(r.paused for r in run.intervals), 1),
        "requests": len(run.queue_waits),
        "rejected_requests": run.rejected,
    }


TWO_POOL_SCENARIO = TwoPoolScenario(
    "ramp 40 → 200 → 60 target pods' worth; acceptance 3.0 → 1.8 → 3.0 at the peak",
    load=tuple(
        [(0.0, 40.0)]
        + [(600.0 + 60.0 * k, 40.0 + 4.0 * (k + 1)) for k in range(40)]  # +4 pods' worth a minute
        + [(4800.0 + 60.0 * k, 200.0 - 4.0 * (k + 1)) for k in range(35)]  # back to 60
    ),
    acceptance=((0.0, 3.0), (3300.0, 3.0), (3600.0, 1.8), (4200.0, 1.8), (4500.0, 3.0)),
    duration=6900.0,
)


def two_pool_policies(scenario: TwoPoolScenario, profile: SpecProfile, busy: float) -> tuple[Policy, ...]:
    """Scaling both pools; the targets alone (drafts stay at what the initial load needs); a
    fixed draft pool sized for the peak load at the best acceptance."""
    peak_rps = max(load for _, load in scenario.load) * profile.pod_capacity_rps(
        scenario.accepted_length(0.0)
    )
    peak = drafts_for(profile, peak_rps, max(a for _, a in scenario.acceptance), busy)
    return (
        Policy("two-pool", scale_drafts=True),
        Policy("targets only", scale_drafts=False),
        Policy(f"fixed draft pool ({peak})", scale_drafts=False, fixed_drafts=peak),
    )


def plot_two_pool(runs: list[TwoPoolRun], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(5.4 * len(runs), 8.5), sharex=True, sharey="row")
    for col, run in enumerate(runs):
        rows = run.intervals
        minutes = [r.time / 60 for r in rows]
        pods, latency, spec = axes[0][col], axes[1][col], axes[2][col]
        pods.step(
            minutes,
            [r.offered_pods for r in rows],
            where="post",
            color="0.6",
            label="offered (target pods' worth at 3.0)",
        )
        pods.step(minutes, [r.targets for r in rows], where="post", color="C0", label="target pods")
        pods.step(minutes, [5 * r.drafts for r in rows], where="post", color="C1", label="draft pods × 5")
        pods.set_title(run.policy.name)
        pods.set_ylabel("pods")
        pods.legend(fontsize=7, loc="upper left")
        latency.plot(
            minutes,
            [r.p95_queue if r.p95_queue is not None else float("nan") for r in rows],
            color="C3",
            lw=1,
            label="p95 queue latency per 15 s",
        )
        latency.axhline(target, color="k", ls=":", label=f"target {target} s")
        latency.set_yscale("symlog", linthresh=0.05)
        latency.set_ylim(0, None)
        latency.set_ylabel("seconds")
        latency.legend(fontsize=7, loc="upper left")
        spec.plot(
            minutes,
            [r.accepted_length for r in rows],
            color="0.5",
            ls="--",
            label="acceptance (true mean accepted length)",
        )
        spec.plot(
            minutes,
            [r.measured_tokens_per_step or float("nan") for r in rows],
            color="C2",
            lw=1,
            label="tokens per step, as scraped",
        )
        spec.plot(
            minutes,
            [1 + 2 * r.paused for r in rows],
            color="C3",
            lw=1,
            label="1 + 2 × share of steps without a draft",
        )
        spec.set_ylim(0.9, 3.3)
        spec.set_xlabel("minutes")
        spec.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.5, help="target p95 queue latency, seconds")
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--stabilization", type=float, default=300.0)
    parser.add_argument(
        "--startup", type=float, default=Profile.startup_seconds, help="pod start-up delay, s"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--two-pool", action="store_true", help="targets and drafts, three policies")
    args = parser.parse_args(argv)
    if args.two_pool:
        return main_two_pool(args)
    profile = Profile(startup_seconds=args.startup)
    results, summaries = [], []
    for scenario in SCENARIOS:
        records = simulate(scenario, profile, args.interval, args.stabilization, args.target, args.seed)
        results.append((scenario, records))
        summaries.append(summarize(records, scenario, args.target))
        print(json.dumps(summaries[-1]))
    if args.plot:
        plot(results, args.target, args.plot)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "profile": asdict(profile),
                    "target_s": args.target,
                    "interval_s": args.interval,
                    "stabilization_s": args.stabilization,
                    "seed": args.seed,
                    "results": summaries,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


def main_two_pool(args: argparse.Namespace) -> int:
    profile = SpecProfile()
    scenario = TWO_POOL_SCENARIO
    policies = two_pool_policies(scenario, profile, DraftAutoscalingSpec().target_busy_fraction)
    runs = []
    for policy in policies:
        run = simulate_two_pool(
            scenario, profile, policy, args.interval, args.stabilization, args.target, args.seed
        )
        runs.append(run)
        print(json.dumps(summarize_two_pool(run, args.target)), flush=True)
    if args.plot:
        plot_two_pool(runs, args.target, args.plot)
    if args.json:
        summary = {
            "scenario": scenario.name,
            "profile": asdict(profile),
            "target_s": args.target,
            "seed": args.seed,
            "results": [summarize_two_pool(r, args.target) for r in runs],
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
