"""The scaling policy, table-driven: up, down, tolerance, caps, stabilization, bounds, no data,
and sequences that must not flap."""

from __future__ import annotations

import itertools

import pytest
from multiguess_operator.autoscaler.policy import (
    Decision,
    PolicyConfig,
    Recommendation,
    acceptance_floor,
    capacity_at,
    decide,
)

CFG = PolicyConfig(min_replicas=1, max_replicas=10, stabilization_seconds=300)


@pytest.mark.parametrize(
    ("current", "ratio", "replicas", "reason"),
    [
        (2, 2.0, 4, "ScaleUp"),
        (2, 1.5, 3, "ScaleUp"),  # ceil(3.0) stays 3
        (3, 1.2, 4, "ScaleUp"),  # ceil(3.6)
        (4, 1.09, 4, "Steady"),  # inside the 10 % band
        (4, 0.91, 4, "Steady"),
        (4, 1.11, 5, "ScaleUp"),  # just outside
        (2, 5.0, 4, "ScaleUpLimited"),  # at most ×2 per decision
        (1, 1.8, 2, "ScaleUp"),
        (8, 3.0, 10, "ScaleUp"),  # capped by maxReplicas, not by the ×2 limit
        (10, 3.0, 10, "AtBounds"),
        (4, 0.5, 2, "ScaleDown"),  # no earlier recommendation in the window
        (4, 0.0, 1, "ScaleDown"),  # idle: down to minReplicas
        (1, 0.0, 1, "AtBounds"),
        (12, 1.0, 10, "ScaleDown"),  # above maxReplicas (bounds changed): clamp down
        (0, 0.0, 1, "ScaleUp"),  # below minReplicas: clamp up
        (4, None, 4, "NoMetrics"),  # nothing scraped: hold
        (12, None, 10, "OutOfBounds"),  # ...but still respect the bounds
    ],
)
def test_single_decisions(current: int, ratio: float | None, replicas: int, reason: str) -> None:
    decision = decide(current, ratio, now=1000.0, window=(), config=CFG)
    assert (decision.replicas, decision.reason) == (replicas, reason)


def test_scale_down_waits_for_the_highest_recommendation_in_the_window() -> None:
    window = (Recommendation(800.0, 6), Recommendation(950.0, 5))
    held = decide(6, 0.5, now=1000.0, window=window, config=CFG)
    assert (held.replicas, held.recommended, held.reason) == (6, 3, "ScaleDownStabilized")
    partly = decide(6, 0.5, now=1101.0, window=held.window, config=CFG)  # the 6 at t=800 expired
    assert (partly.replicas, partly.reason) == (5, "ScaleDown")
    done = decide(5, 0.5, now=1251.0, window=partly.window, config=CFG)  # the 5 at t=950 expired
    assert done.replicas == 3  # the highest left is this decision's own recommendation (or t=1000's 3)


def test_no_metrics_records_nothing_and_never_scales_down() -> None:
    window = (Recommendation(990.0, 2),)
    decision = decide(6, None, now=1000.0, window=window, config=CFG)
    assert decision.replicas == 6 and decision.window == window


def run(loads: list[float | None], current: int, step: float = 15.0) -> list[int]:
    """Replicas over time for a load given in replicas' worth of work (ratio = load / current)."""
    window: tuple[Recommendation, ...] = ()
    replicas = []
    for i, load in enumerate(loads):
        ratio = None if load is None else load / current
        decision: Decision = decide(current, ratio, now=i * step, window=window, config=CFG)
        window, current = decision.window, decision.replicas
        replicas.append(current)
    return replicas


def test_noisy_steady_load_does_not_flap() -> None:
    # ±8 % noise around 4 replicas' worth of load: inside the band, nothing moves.
    noise = [1.08, 0.93, 1.05, 0.92, 1.0, 1.07] * 5
    assert set(run([4 * n for n in noise], current=4)) == {4}


def test_alternating_load_scales_up_once_and_holds() -> None:
    # Bursts every other interval: scale up on the first burst, hold through the quiet ones.
    replicas = run([6.0, 2.4] * 10, current=4)
    assert set(replicas) == {6}


def test_load_step_then_quiet_goes_back_down_only_after_the_window() -> None:
    replicas = run([6.0, 6.0, 6.0] + [0.4] * 30, current=2, step=15.0)
    assert replicas[:3] == [4, 6, 6]  # ×2 at most, then the rest
    first_down = replicas.index(1)
    # The last recommendation of 6 was at t=30 s; it leaves the 300 s window at t=330 s.
    assert first_down * 15.0 >= 30 + 300
    assert set(replicas[3:first_down]) == {6}


def test_missing_data_during_a_quiet_period_never_scales_down() -> None:
    assert set(run([None] * 10, current=5)) == {5}


def test_scale_events_are_few_under_a_long_ramp() -> None:
    replicas = run([1.0 + i * 0.1 for i in range(40)], current=1)
    changes = sum(1 for a, b in itertools.pairwise(replicas) if a != b)
    assert replicas[-1] >= 5
    assert changes <= 8
    assert replicas == sorted(replicas)  # a rising load never causes a scale-down


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": 0, "max_replicas": 3},
        {"min_replicas": 4, "max_replicas": 3},
        {"min_replicas": 1, "max_replicas": 3, "max_scale_up": 0.5},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_pods_still_starting_are_not_counted_again() -> None:
    # 4 asked for, 2 serving, queue at 3× target: the 2 starting pods are already the answer.
    decision = decide(4, 3.0, now=0.0, window=(), config=CFG, serving=2)
    assert (decision.replicas, decision.reason) == (4, "Steady")
    # Once they serve and the queue is still too long, scale again from 4.
    assert decide(4, 1.5, now=15.0, window=decision.window, config=CFG, serving=4).replicas == 6


def test_capacity_is_learned_from_an_overflow_and_floors_the_scale_down() -> None:
    overflow = decide(4, 2.0, now=0.0, window=(), config=CFG, serving=4, throughput=8.0)
    assert overflow.capacity == pytest.approx(2.0)  # 8 req/s over 4 pods was too much
    quiet = decide(
        8, 0.0, now=1000.0, window=(), config=CFG, serving=8, throughput=9.0, capacity=overflow.capacity
    )
    # 9 req/s needs 9 / (0.75 × 2) = 6 pods, whatever the (zero) latency says.
    assert (quiet.replicas, quiet.reason) == (6, "ScaleDown")
    held = decide(6, 0.0, now=1015.0, window=(), config=CFG, serving=6, throughput=9.0, capacity=2.0)
    assert (held.replicas, held.reason) == (6, "ThroughputFloor")
    lighter = decide(6, 0.0, now=1030.0, window=(), config=CFG, serving=6, throughput=3.0, capacity=2.0)
    assert lighter.replicas == 2  # the floor follows the load down


def test_capacity_is_not_learned_while_pods_come_and_go() -> None:
    decision = decide(4, 2.0, now=0.0, window=(), config=CFG, serving=4, throughput=8.0, learn=False)
    assert decision.capacity is None


def test_follow_raises_the_recommendation_to_another_pools_share() -> None:
    led = decide(2, 1.0, now=1000.0, window=(), config=CFG, follow=5)
    assert (led.replicas, led.reason) == (5, "FollowTargets")
    own = decide(2, 4.0, now=1000.0, window=(), config=CFG, follow=3)  # its own signal wants more
    assert (own.replicas, own.reason) == (4, "ScaleUpLimited")
    held = decide(6, 0.0, now=1000.0, window=(), config=CFG, follow=5)  # no scale-down below it
    assert held.replicas == 5


def test_capacity_is_learned_once_and_carried_to_another_acceptance() -> None:
    learned = decide(4, 2.0, now=0.0, window=(), config=CFG, serving=4, throughput=8.0)
    assert learned.learned and learned.capacity == 2.0
    kept = decide(4, 1.0, now=15.0, window=(), config=CFG, serving=4, throughput=8.0, capacity=2.0)
    assert not kept.learned and kept.capacity == 2.0
    # Learned at 3 tokens per step; acceptance falls to 1.5 tokens per step: half the requests/s.
    assert capacity_at(2.0, 3.0, 1.5) == pytest.approx(1.0)
    assert capacity_at(2.0, None, 1.5) == 2.0 and capacity_at(None, 3.0, 1.5) is None


def test_a_fall_in_acceptance_raises_the_throughput_floor_at_once() -> None:
    """The same throughput at half the tokens per step needs twice the pods: the floor says so
    without waiting for the queue to overflow again."""
    window = (Recommendation(0.0, 4),)
    at_learned = decide(8, 0.2, now=1000.0, window=window, config=CFG, throughput=6.0, capacity=2.0)
    assert at_learned.replicas == 4  # ceil(6 / (0.75 × 2))
    halved = capacity_at(2.0, 3.0, 1.5)
    at_lower = decide(8, 0.2, now=1000.0, window=window, config=CFG, throughput=6.0, capacity=halved)
    assert (at_lower.replicas, at_lower.reason) == (8, "ThroughputFloor")  # needs ceil(6 / 0.75) = 8


def test_a_fall_in_acceptance_adds_pods_before_the_queue_shows_it() -> None:
    # 6 requests/s; 2 per pod learned at 3 tokens per step: 4 pods at 75 %. At 2 tokens per step
    # a pod does 4/3 requests/s, so the same traffic needs ceil(6 / (0.75 × 4/3)) = 6.
    assert acceptance_floor(6.0, 2.0, 3.0, 2.0) == 6
    assert acceptance_floor(6.0, 2.0, 3.0, 2.8) == 0  # within the 10 % tolerance: noise
    assert acceptance_floor(6.0, 2.0, 3.0, 3.6) == 0  # a rise only lowers the scale-down floor
    assert acceptance_floor(None, 2.0, 3.0, 2.0) == acceptance_floor(6.0, None, 3.0, 2.0) == 0
    up = decide(4, 1.0, now=0.0, window=(), config=CFG, follow=6, follow_reason="AcceptanceFell")
    assert (up.replicas, up.reason) == (6, "AcceptanceFell")
