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


def test_draft_saturation_pauses_speculation_and_more_drafts_restore_it() -> None:
    profile = sim.SpecProfile()
    light = sim.draft_state(profile, 3.0, busy_sequences=100, draft_pods=20)
    saturated = sim.draft_state(profile, 3.0, busy_sequences=2000, draft_pods=4)
    restored = sim.draft_state(profile, 3.0, busy_sequences=2000, draft_pods=60)
    assert light.paused < 0.01 and saturated.paused > 0.5 and restored.paused < 0.05
    assert saturated.seconds_per_token > 2 * light.seconds_per_token  # near plain decoding
    assert sim.draft_state(profile, 3.0, 2000, 0).paused > 0.99  # no draft pod: plain decoding


def test_two_pool_policy_beats_scaling_the_targets_alone_under_draft_saturation() -> None:
    """A short, small version of the documented run: the load triples; drafts sized for the
    start saturate unless the draft pool scales."""
    scenario = sim.TwoPoolScenario(
        "short", load=((0.0, 8.0), (300.0, 24.0)), acceptance=((0.0, 3.0),), duration=1500.0, min_targets=2
    )
    profile = sim.SpecProfile(tokens_mean=256.0)
    both = sim.simulate_two_pool(scenario, profile, sim.Policy("two-pool", True), 15, 300, 0.5, seed=3)
    alone = sim.simulate_two_pool(scenario, profile, sim.Policy("targets only", False), 15, 300, 0.5, seed=3)
    both_s, alone_s = sim.summarize_two_pool(both, 0.5), sim.summarize_two_pool(alone, 0.5)
    assert both_s["max_drafts"] > alone_s["max_drafts"]
    assert both_s["mean_paused_pct"] < alone_s["mean_paused_pct"] / 3
    assert both_s["gpu_hours"] < alone_s["gpu_hours"]
    late = [r for r in both.intervals if r.time > 1200]
    assert max(r.paused for r in late) < 0.05  # speculation restored once the drafts serve
