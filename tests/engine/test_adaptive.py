"""The adaptive speculation policy, table-driven, and its effect in the engine."""

from dataclasses import replace
from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import (
    AdaptivePolicy,
    CostMeter,
    ForwardCost,
    ProbeSchedule,
    expected_speedup,
)
from multiguess.engine.drafter import TreeBudget
from multiguess.engine.engine import Engine, EngineConfig
from multiguess.models.loading import load_model

from tests.engine.test_lossless import random_prompts, reference

BASE = TreeBudget(num_candidates=3, depth=6, max_nodes=16)
POLICY = AdaptivePolicy(token_budget=64, min_speedup=1.05, probe_every=8)


@pytest.mark.parametrize(
    ("acceptance", "cost", "batch", "expected"),
    [
        (0.95, 0.1, 1, TreeBudget(3, 6, 16)),  # drafts pay, batch small: the whole budget
        (0.5, 0.1, 1, TreeBudget(3, 2, 12)),  # 1.75 tokens for 1.2 forwards beats 1 or 3 levels
        (0.2, 0.1, 1, TreeBudget(3, 1, 3)),  # one level still wins 9%
        (0.05, 0.1, 1, TreeBudget(3, 0, 16)),  # drafting does not pay: off
        (0.8, 0.6, 1, TreeBudget(3, 1, 3)),  # an expensive draft: one level only
        (0.5, 0.6, 1, TreeBudget(3, 0, 16)),  # expensive and poor: off
        (0.95, 0.1, 8, TreeBudget(1, 6, 6)),  # 8 sequences share 64 nodes: 7 each, a chain
        (0.95, 0.1, 16, TreeBudget(1, 3, 3)),  # 16 sequences: 3 nodes each
        (0.95, 0.1, 32, TreeBudget(1, 1, 1)),
        (0.95, 0.1, 64, TreeBudget(3, 0, 16)),  # the budget is all roots: plain decoding
    ],
)
def test_plan(acceptance: float, cost: float, batch: int, expected: TreeBudget) -> None:
    assert POLICY.plan(BASE, acceptance, batch, cost) == expected


def test_expected_speedup() -> None:
    assert expected_speedup(0.0, 0, 0.5) == 1.0
    assert expected_speedup(1.0, 4, 0.0) == 5.0
    assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)


def test_plan_never_exceeds_the_base_budget() -> None:
    for acceptance in (0.0, 0.3, 0.7, 1.0):
        for batch in (1, 2, 5, 40):
            plan = POLICY.plan(BASE, acceptance, batch, 0.1)
            assert plan.depth <= BASE.depth and plan.num_candidates <= BASE.num_candidates
            assert plan.max_nodes <= BASE.max_nodes


def test_cost_meter_ratio() -> None:
    meter = CostMeter(smoothing=0.5, prior_ratio=0.1)
    assert meter.ratio() == 0.1
    meter.record(draft_seconds=0.0, levels=0, verify_seconds=0.04)  # a plain step: no draft cost
    assert meter.ratio() == 0.1
    meter.record(draft_seconds=0.012, levels=3, verify_seconds=0.04)
    assert meter.ratio() == pytest.approx(0.004 / 0.04)
    meter.record(draft_seconds=0.024, levels=3, verify_seconds=0.04)
    assert meter.ratio() == pytest.approx(0.006 / 0.04)
    assert meter.ratio(plain_step=0.03) == pytest.approx(0.006 / 0.03)  # against the plain step


# Target forward seconds by tokens: this CPU's shape (flat, then compute-bound) and a flat one.
CPU_COST = ForwardCost((1, 2, 4, 8, 16, 32), (0.026, 0.027, 0.026, 0.028, 0.033, 0.046))
FLAT_COST = ForwardCost((1, 32), (0.010, 0.010))


def test_forward_cost_interpolates_and_extrapolates() -> None:
    assert CPU_COST(8) == 0.028
    assert CPU_COST(12) == pytest.approx(0.0305)
    assert CPU_COST(64) == pytest.approx(0.072)  # linear beyond the last two points
    assert CPU_COST.growth(8, 4) == pytest.approx(0.046 / 0.028)
    assert ForwardCost().growth(8, 4) == 1.0  # unmeasured: every forward costs the same


def test_verification_cost_turns_speculation_off_where_it_does_not_pay() -> None:
    policy = AdaptivePolicy(token_budget=32)
    # Batch 1: verifying a few nodes is nearly free on either machine: speculate.
    assert policy.plan(BASE, 0.4, 1, 0.1, CPU_COST).depth >= 1
    # Batch 8 with this draft: 4 nodes each make the CPU forward 1.6x a plain step, which
    # 1 + 0.4 + ... tokens do not repay; with a flat cost curve the same step pays.
    assert policy.plan(BASE, 0.4, 8, 0.1, CPU_COST).depth == 0
    assert policy.plan(BASE, 0.4, 8, 0.1, FLAT_COST).depth >= 1


def test_probes_are_wide_only_where_width_is_nearly_free() -> None:
    policy = AdaptivePolicy(token_budget=32)
    assert policy.probe(BASE, 1, CPU_COST) == TreeBudget(3, 1, 3)
    assert policy.probe(BASE, 8, CPU_COST) == TreeBudget(1, 1, 1)  # 11 tokens for 8: +7%
    assert policy.probe(BASE, 8, FLAT_COST) == TreeBudget(3, 1, 3)
    assert policy.probe(BASE, 16, CPU_COST) == TreeBudget(1, 1, 1)  # one node is all that fits
    assert policy.probe(BASE, 32, CPU_COST).depth == 0  # the budget is all roots: no tree fits


def test_probe_schedule_backs_off_while_drafting_does_not_pay() -> None:
    schedule = ProbeSchedule(first=8)
    due = [step for step in range(1, 121) if schedule.due(longest=32)]
    assert due == [8, 24, 56, 88, 120]  # intervals 8, 16, 32, 32, 32
    schedule.reset()  # drafting paid again: the next stop probes early
    assert [step for step in range(1, 25) if schedule.due(longest=32)] == [8, 24]
    alone = ProbeSchedule(first=8)
    assert [step for step in range(1, 25) if alone.due(longest=8)] == [8, 16, 24]


def test_a_lone_sequence_probes_at_the_first_interval_a_batch_backs_off_further() -> None:
    policy = AdaptivePolicy(probe_every=8, probe_every_max=64)
    assert [policy.probe_interval(b) for b in (1, 2, 4, 8, 16)] == [8, 16, 32, 64, 64]


def test_update_estimates_the_per_level_rate() -> None:
    policy = AdaptivePolicy(smoothing=1.0)
    assert policy.observed(accepted=4, drafted_depth=4) == 1.0
    assert policy.observed(accepted=0, drafted_depth=4) == 0.0
    assert policy.observed(accepted=2, drafted_depth=4) == pytest.approx(2 / 3)
    assert policy.observed(accepted=0, drafted_depth=0) is None  # nothing drafted
    assert policy.update(0.5, [1.0, 0.0]) == 0.5  # a step's trees count as their mean
    assert policy.update(0.5, []) == 0.5
    assert AdaptivePolicy(smoothing=0.25).update(0.4, [0.8]) == pytest.approx(0.5)


def test_adaptive_engine_stays_lossless_and_shrinks_trees_for_a_poor_draft(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    prompts = random_prompts(21, (3, 17, 40))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    fixed = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 6, dtype="float32", adaptive=False)
    adaptive = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 6, dtype="float32", adaptive=True)
    fixed_out, adaptive_out = fixed.generate(prompts, params), adaptive.generate(prompts, params)
    expected = reference(tiny_llama, prompts, 40, ignore_eos=True)
    assert [o.token_ids for o in adaptive_out] == expected == [o.token_ids for o in fixed_out]
    drafted = lambda outs: sum(o.stats["draft_tokens"] for o in outs)  # noqa: E731
    assert drafted(adaptive_out) < drafted(fixed_out)


def test_request_override_disables_speculation(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32")
    out = llm.generate(random_prompts(2, (9,)), SamplingParams(max_tokens=10, depth=0))[0]
    assert out.stats["draft_tokens"] == 0 and out.stats["verify_steps"] == 10


def test_new_requests_start_from_the_rate_measured_on_earlier_ones(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """The estimate follows the draft: high for the target itself, lower for a noisy copy."""
    measured = []
    for draft in (tiny_llama, tiny_llama_draft):
        engine = LLM(str(tiny_llama), str(draft), dtype="float32").engine
        assert engine.acceptance == 0.5  # the prior, before anything was drafted
        for i, prompt in enumerate(random_prompts(4, (6, 12))):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        measured.append(engine.acceptance)
    perfect, noisy = measured
    assert perfect > 0.8 and noisy < perfect - 0.1


def test_one_sequence_probes_at_a_time_the_one_observed_longest_ago(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """While no tree pays, probes follow the schedule, one sequence each, in rotation; a
    request with its own fixed tree drafts every step and is never picked; outputs stay exact."""
    policy = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=4)  # batch 4: 2, 4
    config = EngineConfig(3, 4, 16, max_batch=4, max_model_len=128, policy=policy)
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    engine = Engine(target, draft, config)
    prompts = random_prompts(23, (5, 9, 14, 7))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    seqs = [engine.add_request(str(i), prompt, params) for i, prompt in enumerate(prompts[:3])]
    seqs.append(engine.add_request("fixed", prompts[3], replace(params, max_tokens=60, depth=1)))
    drafted = []
    while engine.has_unfinished():
        engine.step()
        drafted.append([size > 0 for size in engine.last_tree_sizes])
    adaptive = [row[:3] for row in drafted if len(row) == 4]
    probes = [(step, row.index(True)) for step, row in enumerate(adaptive, 1) if any(row)]
    assert [step for step, _ in probes[:6]] == [2, 6, 10, 14, 18, 22]  # 2 steps, then every 4
    assert [seq for _, seq in probes[:6]] == [0, 1, 2, 0, 1, 2]  # the longest unobserved first
    assert all(sum(row) <= 1 for row in adaptive)  # never two sequences at once
    assert all(row[3] for row in drafted if len(row) == 4)  # the fixed tree: every step
    expected = reference(tiny_llama, prompts[:3], 30, ignore_eos=True)
    assert [s.output_ids for s in seqs] == [
        *expected,
        *reference(tiny_llama, prompts[3:], 60, ignore_eos=True),
    ]


def test_draft_cost_leaves_out_steps_that_caught_a_draft_cache_up(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A probe's draft forward re-reads all its sequence added since it last drafted: counted
    as cost per level, it made the draft look 3-5x as expensive and kept drafting off."""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    probing = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=2)
    for policy, measured in ((probing, False), (AdaptivePolicy(min_speedup=0.0), True)):
        engine = Engine(target, draft, EngineConfig(3, 2, 6, max_batch=2, max_model_len=96, policy=policy))
        for i, prompt in enumerate(random_prompts(24, (30, 40))):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert engine.totals.draft_tokens > 0
        assert (engine.costs.draft_per_level is not None) == measured
