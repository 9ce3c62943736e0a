"""The policy in closed loop with a queue model (bench/autoscale_sim.py, a short scenario): after a
traffic step the queue's p95 returns under target and stays there, with few scale events."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import autoscale_sim as sim


def test_a_step_is_absorbed_without_oscillation() -> None:
    scenario = sim.Scenario("step", ((300, 1.5), (1500, 6.0)), min_replicas=2, max_replicas=40)
    records = sim.simulate(scenario, sim.Profile(), interval=15, stabilization=300, target=0.5, seed=3)
    summary = sim.summarize(records, scenario, target=0.5)
    (step,) = summary["steps"]
    assert step["back_under_target_after_s"] <= 420  # three 90 s start-ups and the backlog
    assert step["over_target_afterwards_pct"] <= 10  # single noisy 15 s intervals at most
    assert summary["scale_events"] <= 10 and summary["direction_reversals"] <= 3
    late = [r.desired for r in records if r.time >= 300 + 900]
    moves = [b > a for a, b in itertools.pairwise(late) if a != b]
    assert sum(a != b for a, b in itertools.pairwise(moves)) <= 1  # late: settling, not hunting
