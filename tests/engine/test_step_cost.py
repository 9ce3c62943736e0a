"""What a step costs: the start curve, calibrated by the seconds real steps take."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.step_cost import CONTEXT_STEP, ContextCurves, StepCosts, scaled

from tests.engine.test_lossless import random_prompts, reference

START = ForwardCost((1, 2, 4, 8), (1.0, 1.0, 2.0, 4.0))
CURVES = ContextCurves.flat(START)


def test_scaling_interpolates_between_measured_counts_and_holds_beyond() -> None:
    curve = scaled(START, [(1, 0.5), (4, 1.0)])
    assert curve(1) == 0.5
    assert curve(2) == pytest.approx(1.0 * (0.5 + 0.5 / 3))  # a third of the way to 4's factor
    assert curve(4) == 2.0 and curve(8) == 4.0  # 4's factor held past it
    assert scaled(START, []) is START
    assert scaled(START, [(2, 3.0)])(1) == 3.0  # held below the least count too


def test_curves_after_other_contexts_follow_the_line_through_the_nearest_two() -> None:
    short, long = ForwardCost((1, 4), (1.0, 2.0)), ForwardCost((1, 4), (2.0, 6.0))
    curves = ContextCurves((64, 512), (short, long))
    assert curves.at(64) == short and curves.at(512) == long
    assert curves.at(288)(1) == 1.5 and curves.at(288)(4) == 4.0  # halfway
    assert curves.at(960)(4) == 10.0  # beyond the longest the line goes on
    assert curves.at(0) == short  # below the shortest it is held
    assert ContextCurves.flat(short).at(4096) is short


def test_a_steps_ratio_is_to_the_start_curve_at_its_own_context() -> None:
    """Steps that cost what the start curves say at their contexts leave them as they are,
    however far apart those contexts; one at twice that doubles its count's seconds at every
    context."""
    curves = ContextCurves((64, 512), (ForwardCost((1, 4), (1.0, 2.0)), ForwardCost((1, 4), (2.0, 6.0))))
    costs = StepCosts(curves)
    for _ in range(3):
        costs.observe(1, 512, 2.0)
        costs.observe(4, 64, 2.0)
    assert costs.curve(512) == curves.at(512) and costs.curve(64) == curves.at(64)
    for _ in range(4):
        costs.observe(4, 8 * CONTEXT_STEP, 12.0)
    assert costs.curve(512)(4) == 12.0 and costs.curve(64)(4) == 4.0


def test_a_scaled_curve_never_falls_with_more_tokens() -> None:
    curve = scaled(START, [(1, 2.0), (2, 0.5)])
    assert curve(2) == curve(1) == 2.0


def test_the_curve_follows_real_steps_once_a_count_has_enough_of_them() -> None:
    costs = StepCosts(CURVES)
    costs.observe(1, 0, 0.5)
    costs.observe(1, 0, 0.5)
    assert costs.curve(0) is START  # two steps: not yet
    costs.observe(1, 0, 0.5)
    assert costs.curve(0)(1) == 0.5 and costs.curve(0).growth(1, 4) == 2.0  # the start's shape
    for seconds in (3.0, 3.0, 3.0, 90.0):  # one stalled step among them
        costs.observe(4, 0, seconds)
    assert costs.curve(0)(4) == 3.0 and costs.curve(0).growth(1, 4) == 6.0


def test_the_curve_changes_only_when_a_factor_does_at_plan_precision() -> None:
    costs = StepCosts(CURVES)
    for _ in range(3):
        costs.observe(2, 0, 1.5)
    curve = costs.curve(0)
    costs.observe(2, 0, 1.501)
    assert costs.curve(0) is curve  # plans cached on it stay valid
    for _ in range(5):
        costs.observe(2, 0, 2.0)
    assert costs.curve(0) is not curve and costs.curve(0)(2) == 2.0


def test_a_curve_set_by_hand_is_not_calibrated() -> None:
    costs = StepCosts.fixed(START)
    for _ in range(5):
        costs.observe(1, 0, 9.0)
    assert costs.curve(0) is START and costs.curve(5000) is START and not costs.plain_due(1)


def test_plain_steps_are_due_spaced_until_measured_then_now_and_again() -> None:
    costs = StepCosts(CURVES, spacing=3, refresh=10)
    assert costs.plain_due(1)  # none yet
    for _ in range(2):
        costs.observe(1, 0, 1.0)
        costs.observe(4, 0, 2.0)
        costs.observe(4, 0, 2.0)
        assert not costs.plain_due(1)
        costs.observe(4, 0, 2.0)
        assert costs.plain_due(1)  # three steps since the last plain one
    costs.observe(1, 0, 1.0)
    assert not costs.plain_due(1) and costs.plain_due(2)  # each batch size its own
    for _ in range(9):
        costs.observe(4, 0, 2.0)
    assert not costs.plain_due(1)
    costs.observe(4, 0, 2.0)
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
    assert len(costs.ratios[1]) >= costs.min_samples and costs.curve(0) != costs.start.at(0)
    assert costs.steps == len(sizes)
    assert any(sizes)  # trees were drafted after the plain steps
    outputs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids for p in prompts]
    assert outputs == reference(tiny_llama, prompts, 24, ignore_eos=True)
