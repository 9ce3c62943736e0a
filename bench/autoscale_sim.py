"""Discrete-event simulation of the autoscaler: the operator's real signal and policy code
(``Autoscaler.observe/decide``, ``compute_signal``) against a fleet of simulated serving pods.

Each pod runs ``slots`` requests at once (the engine's batch) and queues the rest FIFO; the Service
spreads requests at random over ready pods (kube-proxy); a new pod serves only after a start-up
delay (scheduling + model loading); a removed pod stops receiving traffic and drains. Every
``interval`` the autoscaler scrapes each ready pod's cumulative queue histogram (the serving image's
buckets) and waiting gauge, exactly as the operator does over HTTP.

    .venv/bin/python bench/autoscale_sim.py --plot docs/img/autoscale.png --json bench/autoscale_sim.json
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

from multiguess_operator.autoscaler.loop import Autoscaler, compute_signal
from multiguess_operator.autoscaler.metrics import Snapshot
from multiguess_operator.spec import AutoscalingSpec

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

    def snapshot(self) -> Snapshot:
        running, buckets = 0, []
        for le, n in zip(QUEUE_BUCKETS, self.cumulative, strict=True):
            running += n
            buckets.append((float(le), float(running)))
        return Snapshot(tuple(buckets), float(self.count), self.total, float(len(self.queue)))

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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
