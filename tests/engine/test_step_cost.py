"""What a step costs: the start curve, calibrated by the seconds real steps take."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.step_cost import StepCosts, scaled

from tests.engine.test_lossless import random_prompts, reference

START = ForwardCost((1, 2, 4, 8), (1.0, 1.0, 2.0, 4.0))


def test_scaling_interpolates_between_measured_counts_and_holds_beyond() -> None:
    curve = scaled(START, [(1, 0.5), (4, 1.0)])
    assert curve(1) == 0.5
    assert curve(2) == pytest.approx(1.0 * (0.5 + 0.5 / 3))  # a third of the way to 4's factor
    assert curve(4) == 2.0 and curve(8) == 4.0  # 4's factor held past it
    assert scaled(START, []) is START
    assert scaled(START, [(2, 3.0)])(1) == 3.0  # held below the least count too


def test_a_scaled_curve_never_falls_with_more_tokens() -> None:
    curve = scaled(START, [(1, 2.0), (2, 0.5)])
    assert curve(2) == curve(1) == 2.0


def test_the_curve_follows_real_steps_once_a_count_has_enough_of_them() -> None:
    costs = StepCosts(START)
    costs.observe(1, 0.5)
    costs.observe(1, 0.5)
    assert costs.curve() is START  # two steps: not yet
    costs.observe(1, 0.5)
    assert costs.curve()(1) == 0.5 and costs.curve().growth(1, 4) == 2.0  # the start's shape
    for seconds in (3.0, 3.0, 3.0, 90.0):  # one stalled step among them
        costs.observe(4, seconds)
    assert costs.curve()(4) == 3.0 and costs.curve().growth(1, 4) == 6.0


def test_the_curve_changes_only_when_a_factor_does_at_plan_precision() -> None:
    costs = StepCosts(START)
    for _ in range(3):
        costs.observe(2, 1.5)
    curve = costs.curve()
    costs.observe(2, 1.501)
    assert costs.curve() is curve  # plans cached on it stay valid
    for _ in range(5):
        costs.observe(2, 2.0)
    assert costs.curve() is not curve and costs.curve()(2) == 2.0


def test_a_curve_set_by_hand_is_not_calibrated() -> None:
    costs = StepCosts(START, calibrating=False)
    for _ in range(5):
        costs.observe(1, 9.0)
    assert costs.curve() is START and not costs.plain_due(1)


def test_plain_steps_are_due_spaced_until_measured_then_now_and_again() -> None:
    costs = StepCosts(START, spacing=3, refresh=10)
    assert costs.plain_due(1)  # none yet
    for _ in range(2):
        costs.observe(1, 1.0)
        costs.observe(4, 2.0)
        costs.observe(4, 2.0)
        assert not costs.plain_due(1)
        costs.observe(4, 2.0)
        assert costs.plain_due(1)  # three steps since the last plain one
    costs.observe(1, 1.0)
    assert not costs.plain_due(1) and costs.plain_due(2)  # each batch size its own
    for _ in range(9):
        costs.observe(4, 2.0)
    assert not costs.plain_due(1)
    costs.observe(4, 2.0)
    assert costs.plain_due(1)  # measured enough: ten steps since the last plain one


def test_an_engine_times_its_first_steps_plain_then_drafts_on_calibrated_costs(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A fresh adaptive engine's first step is plain, and so is one every ``spacing`` steps
    until plain steps (the yardstick every tree is priced against) were measured enough; the
    seconds of every step join its costs, and output is plain decoding's."""
    prompts = random_prompts(31, (5, 9))
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", max_batch=1)
    engine, costs = llm.engine, llm.engine.planner.step_costs
    sizes = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            sizes += engine.last_tree_sizes
    assert sizes[0] == 0 and sizes.count(0) >= costs.min_samples
    assert len(costs.ratios[1]) >= costs.min_samples and costs.curve() is not costs.start
    assert costs.steps == len(sizes)
    assert any(sizes)  # trees were drafted after the plain steps
    outputs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids for p in prompts]
    assert outputs == reference(tiny_llama, prompts, 24, ignore_eos=True)
