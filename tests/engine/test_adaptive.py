"""The adaptive speculation policy, table-driven, and its effect in the engine."""

from dataclasses import replace
from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import (
    CONTEXT_STEP,
    AdaptivePolicy,
    CostMeter,
    Coverage,
    ForwardCost,
    ProbeSchedule,
    expected_tokens,
    level_outcomes,
)
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, SampleSpec, TreeBudget
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.sampling import Generators, Processing
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model

from tests.drafters import model_drafter
from tests.engine.test_lossless import random_prompts, reference

BASE = TreeBudget(num_candidates=3, depth=6, max_nodes=16)
POLICY = AdaptivePolicy(token_budget=64, min_speedup=1.05, probe_every=8)
# Coverage of the draft's top 1, 2, 3: a strong draft, the embedded one on chat, a weak one.
STRONG = Coverage((0.9, 0.95, 0.97))
EMBEDDED = Coverage((0.4, 0.52, 0.6))
WEAK = Coverage((0.1, 0.15, 0.18))


# Target forward seconds by tokens, as the bf16 kernels measured them on a 2-core AMD EPYC.
BF16_COST = ForwardCost((1, 2, 4, 8, 16, 32), (0.0133, 0.0134, 0.0153, 0.0162, 0.023, 0.0351))


@pytest.mark.parametrize(
    ("coverage", "cost", "batch", "expected"),
    [
        (STRONG, 0.1, 1, TreeBudget(2, 6, 7)),  # drafts pay: deep, a second child where cheap
        (STRONG, 0.1, 8, TreeBudget(1, 3, 3)),  # 8 tokens cost little more than 1, 32 do: chains
        (STRONG, 0.1, 32, TreeBudget(1, 1, 1)),  # 64 nodes for 32 sequences: one each
        (STRONG, 0.1, 64, TreeBudget(3, 0, 16)),  # the budget is all roots: plain decoding
        (STRONG, 0.6, 1, TreeBudget(3, 2, 6)),  # an expensive draft: few levels, width instead
        (EMBEDDED, 0.1, 1, TreeBudget(3, 2, 6)),  # width pays more than depth
        (EMBEDDED, 0.1, 4, TreeBudget(1, 1, 1)),
        (EMBEDDED, 0.1, 8, TreeBudget(3, 0, 16)),  # verifying 16 tokens costs 1.4 steps: off
        (EMBEDDED, 0.6, 1, TreeBudget(3, 0, 16)),  # expensive and mediocre: off
        (Coverage((0.4, 0.4, 0.4)), 0.1, 1, TreeBudget(1, 1, 1)),  # width catches nothing: a chain
        (WEAK, 0.1, 1, TreeBudget(3, 0, 16)),  # drafting does not pay: off
    ],
)
def test_plan(coverage: Coverage, cost: float, batch: int, expected: TreeBudget) -> None:
    assert POLICY.plan(BASE, [coverage] * batch, cost, BF16_COST) == expected


def test_plan_never_exceeds_the_base_budget() -> None:
    for coverage in (WEAK, EMBEDDED, STRONG, Coverage((1.0, 1.0, 1.0))):
        for batch in (1, 2, 5, 40):
            for cost in (None, BF16_COST):
                plan = POLICY.plan(BASE, [coverage] * batch, 0.1, cost)
                assert plan.depth <= BASE.depth and plan.num_candidates <= BASE.num_candidates
                assert plan.max_nodes <= BASE.max_nodes


def test_plan_weighs_each_sequence_by_its_own_coverage() -> None:
    """Greedy and sampled requests reach different rates; the plan takes their mean tokens."""
    assert POLICY.plan(BASE, [STRONG, STRONG], 0.1, BF16_COST) == TreeBudget(1, 5, 5)
    assert POLICY.plan(BASE, [WEAK, WEAK], 0.1, BF16_COST).depth == 0
    assert POLICY.plan(BASE, [STRONG, WEAK], 0.1, BF16_COST) == TreeBudget(1, 3, 3)


def test_expected_tokens_sums_the_chance_of_reaching_each_node() -> None:
    chain = Coverage((0.5,))
    assert expected_tokens(chain, TreeBudget(1, 2, 2)) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(chain, TreeBudget(1, 0, 2)) == 1.0
    wide = Coverage((0.4, 0.6))
    assert expected_tokens(wide, TreeBudget(2, 1, 2)) == pytest.approx(1 + 0.4 + 0.2)
    assert expected_tokens(wide, TreeBudget(2, 1, 1)) == pytest.approx(1 + 0.4)  # the spine only
    # Two levels of width 2, five nodes: the spine (0.4, 0.16) first, then the likeliest others:
    # the first level's second child (0.2) and two grandchildren of 0.4 * 0.2 = 0.08 each.
    assert expected_tokens(wide, TreeBudget(2, 2, 5)) == pytest.approx(1 + 0.4 + 0.16 + 0.2 + 0.08 + 0.08)


def test_coverage_never_narrows() -> None:
    coverage = Coverage((0.4, 0.3, 0.7))  # a noisy estimate: top-2 measured below top-1
    assert coverage(0) == 0.0
    assert coverage(2) == 0.4
    assert coverage(5) == 0.7
    assert Coverage.prior(0.5, 3).rates == (0.5, 0.75, 0.875)


def test_level_outcomes_read_each_tried_level_of_the_accepted_path() -> None:
    #        0
    #   1    2    3        root's children, rank order
    #  4 5   6             children of 1 and 2
    tree = TokenTree((9, 1, 2, 3, 4, 5, 6), (-1, 0, 0, 0, 1, 1, 2))
    assert level_outcomes(tree, [0, 2, 6]) == [(3, 1), (1, 0)]  # 6 is a leaf: nothing more tried
    assert level_outcomes(tree, [0, 1]) == [(3, 0), (2, None)]  # level 2 tried, none accepted
    assert level_outcomes(tree, [0]) == [(3, None)]
    assert level_outcomes(TokenTree.chain([9]), [0]) == []  # nothing drafted


def test_update_counts_each_width_only_where_the_level_had_that_many_children() -> None:
    policy = AdaptivePolicy(smoothing=1.0, step_weight=1.0)
    start = Coverage((0.5, 0.5, 0.5))
    # Rank 1 of 3 accepted: a miss for top-1, a hit for top-2 and top-3. A chain's miss says
    # nothing about wider levels.
    assert policy.update(start, [[(3, 1)]]).rates == (0.0, 1.0, 1.0)
    assert policy.update(start, [[(1, None)]]).rates == (0.0, 0.5, 0.5)
    assert policy.update(start, [[(3, 0), (1, None)]]).rates == (0.5, 1.0, 1.0)  # one depth: pooled
    assert policy.update(start, []) == start
    damped = AdaptivePolicy(smoothing=0.1, step_weight=0.3)
    assert damped.update(start, [[(1, 0)]]).rates[0] == pytest.approx(0.55)  # one level weighs 0.1
    assert damped.update(start, [[(1, 0)]] * 8).rates[0] == pytest.approx(0.65)  # a step at most 0.3


def test_update_keeps_each_depth_apart() -> None:
    """A tree's first level updates the first-level rates, its second the second's, and
    everything deeper the deepest tracked rates; a depth no path reached keeps its estimate."""
    policy = AdaptivePolicy(smoothing=1.0, step_weight=1.0)
    start = Coverage.prior(0.5, 1, depth=3)
    assert start.deeper == ((0.5,), (0.5,))
    hit_then_miss = policy.update(start, [[(1, 0), (1, None)]])
    assert (hit_then_miss.rates, hit_then_miss.deeper) == ((1.0,), ((0.0,), (0.5,)))
    deep = policy.update(start, [[(1, 0), (1, 0), (1, 0), (1, None)]])
    assert deep.deeper == ((1.0,), (0.5,))  # depths 3 and 4 pooled: one hit, one miss
    assert deep(1, depth=9) == 0.5


def test_expected_tokens_follow_each_depths_rates() -> None:
    """A chain whose deeper levels are accepted more often (text the draft got right once it
    tends to go on getting right) yields more than the first level's rate says."""
    flat = Coverage((0.4,), ((0.4,),))
    rising = Coverage((0.4,), ((0.6,),))
    chain = TreeBudget(1, 3, 3)
    assert expected_tokens(flat, chain) == pytest.approx(1 + 0.4 + 0.16 + 0.064)
    assert expected_tokens(rising, chain) == pytest.approx(1 + 0.4 + 0.24 + 0.144)
    assert POLICY.plan(BASE, [rising], 0.1, BF16_COST).depth > POLICY.plan(BASE, [flat], 0.1, BF16_COST).depth


def test_cost_meter_ratio() -> None:
    meter = CostMeter(window=5, min_samples=2, prior_ratio=0.1)
    assert meter.ratios(plain_step=0.04) == (0.0, 0.1)
    meter.record(draft_seconds=0.0, levels=0)  # a plain step: no draft cost
    meter.record(draft_seconds=0.012, levels=3)
    assert meter.ratios(plain_step=0.04) == (0.0, 0.1)  # one sample is not yet a measurement
    meter.record(draft_seconds=0.024, levels=3)
    # One depth only: a line through zero, the median of 4 and 8 ms per level.
    assert meter.ratios(plain_step=0.04) == pytest.approx((0.0, 0.006 / 0.04))
    assert meter.ratios(plain_step=0.03) == pytest.approx((0.0, 0.006 / 0.03))


def test_cost_meter_splits_a_steps_fixed_cost_from_its_levels() -> None:
    """One level for 2 ms and three for 4 ms: 1 ms a step and 1 ms a level, not the 2 ms a
    level that one level's step would say, nor the 1.33 ms of three; a stalled step moves neither."""
    meter = CostMeter()
    for levels, seconds in ((1, 0.002), (3, 0.004), (1, 0.002), (3, 0.004), (2, 0.090), (2, 0.003)):
        meter.record(draft_seconds=seconds, levels=levels)
    assert meter.fitted() == pytest.approx((0.001, 0.001))
    assert meter.ratios(plain_step=0.01) == pytest.approx((0.1, 0.1))


def test_one_stalled_step_does_not_move_the_draft_cost() -> None:
    """A step that stalled (here 40x the others) leaves the estimate where the others put it,
    and the window forgets old samples as the draft's cost changes."""
    meter = CostMeter()
    for seconds in (0.002, 0.002, 0.080, 0.002, 0.002):
        meter.record(draft_seconds=seconds, levels=1)
    assert meter.draft_per_level == pytest.approx(0.002)
    for _ in range(meter.window):
        meter.record(draft_seconds=0.003, levels=1)
    assert meter.draft_per_level == pytest.approx(0.003)


# Target forward seconds by tokens: this CPU's shape (flat, then compute-bound) and a flat one.
CPU_COST = ForwardCost((1, 2, 4, 8, 16, 32), (0.026, 0.027, 0.026, 0.028, 0.033, 0.046))
FLAT_COST = ForwardCost((1, 32), (0.010, 0.010))


def test_forward_cost_interpolates_and_extrapolates() -> None:
    assert CPU_COST(8) == 0.028
    assert CPU_COST(12) == pytest.approx(0.0305)
    assert CPU_COST(64) == pytest.approx(0.072)  # linear beyond the last two points
    assert CPU_COST.growth(8, 4) == pytest.approx(0.046 / 0.028)
    assert ForwardCost().growth(8, 4) == 1.0  # unmeasured: every forward costs the same


def test_attention_makes_extra_rows_dearer_the_longer_the_context_and_the_smaller_the_batch() -> None:
    """A sequence's attention costs per cached token a part for the sequence and a part per row:
    at a long context an extra row costs more than the bare curve says, and most where few
    sequences share the matmuls' weight reads."""
    cost = ForwardCost(CPU_COST.tokens, CPU_COST.seconds, per_sequence=2e-6, per_row=1e-6)
    assert cost.at(0).growth(4, 2) == pytest.approx(CPU_COST.growth(4, 2))  # nothing cached
    long = cost.at(1024)
    assert long.step(4, 2) == pytest.approx(CPU_COST(8) + 4 * (2e-6 + 2 * 1e-6) * 1024)
    assert long.growth(1, 4) > cost.at(64).growth(1, 4) > CPU_COST.growth(1, 4)
    assert long.growth(1, 4) / CPU_COST.growth(1, 4) > long.growth(8, 4) / CPU_COST.growth(8, 4)
    # Read in steps of CONTEXT_STEP, each once: plans cached on a cost change no more often.
    assert cost.at(1024 + CONTEXT_STEP // 3) is long
    assert cost.at(1024 + CONTEXT_STEP) is not long
    assert CPU_COST.at(1024) is CPU_COST  # nothing measured for attention: one cost for all


def test_verification_cost_turns_speculation_off_where_it_does_not_pay() -> None:
    policy = AdaptivePolicy(token_budget=32)
    # Batch 1: verifying a few nodes is nearly free on either machine: speculate.
    assert policy.plan(BASE, [EMBEDDED] * 1, 0.1, BF16_COST).depth >= 1
    # Batch 8 with this draft: one node each makes the CPU forward 1.4x a plain step, which
    # 1.4 tokens do not repay; with a flat cost curve the same step pays.
    assert policy.plan(BASE, [EMBEDDED] * 8, 0.1, BF16_COST).depth == 0
    assert policy.plan(BASE, [EMBEDDED] * 8, 0.1, FLAT_COST).depth >= 1


def test_probes_are_as_wide_as_the_room_allows() -> None:
    policy = AdaptivePolicy(token_budget=32)
    assert policy.probe(BASE, 1) == TreeBudget(3, 1, 3)
    assert policy.probe(BASE, 8) == TreeBudget(3, 1, 3)
    assert policy.probe(BASE, 11) == TreeBudget(1, 1, 1)  # one node is all that fits
    assert policy.probe(BASE, 32).depth == 0  # the budget is all roots: no tree fits


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
    """The estimates follow the draft: high for the target itself, lower for a noisy copy. (The
    target as its own draft never pays, so the policy is told to draft whatever it costs.)"""
    measured = []
    config = EngineConfig(max_batch=4, max_model_len=128, policy=AdaptivePolicy(min_speedup=0.0))
    target = load_model(str(tiny_llama), dtype="float32")
    for draft in (tiny_llama, tiny_llama_draft):
        engine = Engine(target, ModelDrafter(load_model(str(draft), dtype="float32")), config)
        assert engine.planner.coverage[True] == config.policy.initial(
            3, config.depth
        )  # before anything was drafted
        for i, prompt in enumerate(random_prompts(4, (6, 12))):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        measured.append(engine.planner.coverage[True].rates[0])
    perfect, noisy = measured
    assert perfect > 0.8 and noisy < perfect - 0.1


def test_each_step_plans_from_the_estimates_it_finds(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """Steps reuse the latest plan only while what it reads is unchanged: estimates that turn
    good draft trees on the next step, ones that turn useless stop them. (The draft's cost
    stays at its prior: measured on a draft as big as its target, it would keep trees off.)"""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    engine = Engine(
        target, ModelDrafter(draft), EngineConfig(max_batch=2, max_model_len=128, prompt_lookup=0)
    )
    for i, prompt in enumerate(random_prompts(31, (6, 9))):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    useless = Coverage((0.0, 0.0, 0.0))
    drafted = []
    for coverage in (STRONG, useless, STRONG, STRONG, useless):
        engine.planner.coverage = dict.fromkeys((True, False), coverage)
        engine.planner.costs = CostMeter()
        engine.step()
        drafted.append(max(engine.last_tree_sizes) > 0)
    assert drafted == [True, False, True, True, False]


def test_sampled_requests_keep_their_own_estimates(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """Sampled outcomes must not pull down the greedy estimates (nor the reverse): in the
    benchmark, sampled runs sharing an engine with greedy ones had halved its trees."""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    config = EngineConfig(max_batch=2, max_model_len=128, policy=AdaptivePolicy(min_speedup=0.0))
    engine = Engine(target, ModelDrafter(draft), config)
    for i, prompt in enumerate(random_prompts(5, (6, 12))):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.planner.coverage[True] == config.policy.initial(3, config.depth)
    assert engine.planner.coverage[False] != config.policy.initial(3, config.depth)


def test_one_sequence_probes_at_a_time_the_one_observed_longest_ago(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """While no tree pays, probes follow the schedule, one sequence each, in rotation; greedy
    ones probe by observation, without a tree; a request with its own fixed tree drafts every
    step and is never picked; outputs stay exact."""
    policy = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=4)  # batch 4: 2, 4
    # No copy drafts: they would fill the fixed tree's padding in the others' trees.
    config = EngineConfig(3, 4, 16, max_batch=4, max_model_len=128, policy=policy, prompt_lookup=0)
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    engine = Engine(target, ModelDrafter(draft), config)
    prompts = random_prompts(23, (5, 9, 14, 7))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    seqs = [engine.add_request(str(i), prompt, params) for i, prompt in enumerate(prompts[:3])]
    seqs.append(engine.add_request("fixed", prompts[3], replace(params, max_tokens=60, depth=1)))
    observed_slots: list[int] = []
    observe = engine.drafter.observe  # type: ignore[union-attr]

    def recording(
        slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        observed_slots.append(slot)
        return observe(slot, token_ids, width, since, sample)

    engine.drafter.observe = recording  # type: ignore[union-attr,method-assign]
    probed, drafted = [], []
    while engine.has_unfinished():
        slots = [s.slot for s in seqs]  # as this step sees them (admission assigns the first)
        observed_slots.clear()
        engine.step()
        if len(engine.last_tree_sizes) == 4:
            probed.append([slot in observed_slots for slot in slots[:3]])
            drafted.append([size > 0 for size in engine.last_tree_sizes])
    probes = [(step, row.index(True)) for step, row in enumerate(probed, 1) if any(row)]
    assert [step for step, _ in probes[:6]] == [2, 6, 10, 14, 18, 22]  # 2 steps, then every 4
    assert [seq for _, seq in probes[:6]] == [0, 1, 2, 0, 1, 2]  # the longest unobserved first
    assert all(sum(row) <= 1 for row in probed)  # never two sequences at once
    assert not any(any(row[:3]) for row in drafted)  # greedy probes draft no tree
    assert all(row[3] for row in drafted)  # the fixed tree: every step
    expected = reference(tiny_llama, prompts[:3], 30, ignore_eos=True)
    assert [s.output_ids for s in seqs] == [
        *expected,
        *reference(tiny_llama, prompts[3:], 60, ignore_eos=True),
    ]


def test_while_no_tree_pays_the_draft_skips_prompts_until_a_probe_catches_it_up(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A drafter whose prefill is optional does not prefill a prompt while the policy drafts no
    tree: its cache of the prompt goes from nothing to whole when a probe feeds it, where a
    request with its own tree prefills chunk by chunk; outputs stay exact. The first request
    is admitted before any plan, so it prefills too."""
    policy = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=4)
    config = EngineConfig(
        3, 4, 16, max_batch=4, max_model_len=128, policy=policy, prompt_lookup=0, max_prefill_tokens=8
    )
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    drafter = ModelDrafter(draft)
    engine = Engine(target, drafter, config)
    prompts = random_prompts(29, (6, 40, 20))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first = engine.add_request("first", prompts[0], params)
    while not first.output_ids:
        engine.step()
    assert not engine.planner.drafting
    later = engine.add_request("later", prompts[1], params)
    fixed = engine.add_request("fixed", prompts[2], replace(params, depth=1))
    seen: dict[str, set[int]] = {"later": set(), "fixed": set()}  # the draft's cache after each step
    while engine.has_unfinished():
        engine.step()
        for seq in (later, fixed):
            if not seq.finished:
                seen[seq.request_id].add(drafter.cached.get(seq.slot, 0))
    partly = {
        name: {n for n in cached if 0 < n < len(prompts[i]) - 1}
        for i, (name, cached) in enumerate(seen.items(), 1)
    }
    assert not partly["later"] and len(partly["fixed"]) >= 2  # never a chunk of "later"'s prompt
    assert max(seen["later"]) > len(prompts[1])  # a probe fed it
    expected = reference(tiny_llama, prompts, 30, ignore_eos=True)
    assert [s.output_ids for s in (first, later, fixed)] == expected


def test_probes_pass_over_prompts_the_draft_skipped_while_another_sequence_can_probe(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """While no tree pays, a probe goes to a sequence whose prompt the draft has seen (the
    first request, admitted before any plan, prefilled it) rather than to one whose prefill it
    skipped, which would feed it the whole prompt; once that sequence ends, one of the others
    is, and then it alone, its prompt seen. Outputs stay exact."""
    policy = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=4)
    config = EngineConfig(3, 4, 16, max_batch=4, max_model_len=128, policy=policy, prompt_lookup=0)
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    drafter = ModelDrafter(draft)
    engine = Engine(target, drafter, config)
    prompts = random_prompts(31, (6, 30, 24))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = engine.add_request("first", prompts[0], replace(params, max_tokens=20))
    while not first.output_ids:
        engine.step()
    later = [engine.add_request(f"later{i}", prompt, params) for i, prompt in enumerate(prompts[1:])]
    assert all(drafter.behind(s.slot, len(s.prompt_ids) - 1) > 0 for s in later)  # prefill skipped
    observe = drafter.observe
    observed: list[int] = []

    def recording(
        slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        observed.append(slot)
        return observe(slot, token_ids, width, since, sample)

    drafter.observe = recording  # type: ignore[method-assign]
    probes: list[tuple[bool, str]] = []  # (first still running, the probed request)
    while engine.has_unfinished():
        names = {s.slot: s.request_id for s in (first, *later) if not s.finished}
        running = not first.finished
        observed.clear()
        engine.step()
        probes += [(running, names[slot]) for slot in observed]
    assert len([p for p in probes if p[0]]) >= 3
    assert all(name == "first" for running, name in probes if running)
    assert len({name for running, name in probes if not running} & {"later0", "later1"}) == 1
    expected = reference(tiny_llama, prompts, 40, ignore_eos=True)
    assert first.output_ids == expected[0][:20]
    assert [s.output_ids for s in later] == expected[1:]


def test_observing_ranks_the_tokens_the_target_chose_and_catches_the_draft_up(tiny_llama: Path) -> None:
    """The target as its own draft ranks its greedy tokens first and any other token below
    them. Afterwards the draft's cache holds the sequence: a tree drafted from there equals one
    drafted by a drafter that never observed it."""
    model = load_model(str(tiny_llama), dtype="float32")
    prompt = random_prompts(5, (7,))[0]
    tokens = [*prompt, *reference(tiny_llama, [prompt], 12, ignore_eos=True)[0]]
    drafters = [model_drafter(model, 2, 64) for _ in range(2)]
    assert drafters[0].observe(0, tokens[:12], 3, 7) == [0] * 5  # the first 5 replies, not the prompt
    assert drafters[0].observe(0, tokens, 3, 7) == [0] * 6  # 7 more, less the first (no guess for it)
    shifted = [*prompt, *((t + 1) % 64 for t in tokens[7:])]
    assert drafters[1].observe(1, shifted, 1, 7) == [None] * 12  # never the draft's first guess
    request = [DraftRequest(0, [*tokens, 5], TreeBudget(3, 3, 9))]
    fresh = drafters[1].propose([replace(request[0], slot=0)])
    assert drafters[0].propose(request)[0].tree == fresh[0].tree


def test_a_seeded_sample_observes_the_winners_of_its_race(tiny_llama: Path) -> None:
    """The target as its own draft: under a seeded sample's noise its race's winner at each
    position is the token the target drew there (rank 0), for the replies and not the prompt;
    unseeded, a draw ranks nothing and the same tokens are mostly not its top guess."""
    model = load_model(str(tiny_llama), dtype="float32")
    prompt = random_prompts(6, (7,))[0]
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=11, ignore_eos=True)
    reply = LLM(str(tiny_llama), None, dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    tokens = [*prompt, *reply]
    seeded = SampleSpec(Processing(1.0), Generators(11), coupled=True)
    drafter = model_drafter(model, 2, 64)
    assert drafter.observe(0, tokens, 3, 7, seeded) == [0] * 14
    assert drafter.observe(0, [*tokens, 5], 3, 7, seeded) == []  # a new token, nothing to rank yet
    other = SampleSpec(Processing(1.0), Generators(12), coupled=True)  # another seed's noise
    ranks = model_drafter(model, 2, 64).observe(0, tokens, 1, 7, other)
    assert ranks.count(0) < 10


@pytest.mark.parametrize(("seed", "probe_trees"), [(7, False), (None, True)])
def test_seeded_samples_probe_by_observation_unseeded_ones_with_trees(
    tiny_llama: Path, tiny_llama_draft: Path, seed: int | None, probe_trees: bool
) -> None:
    """While no tree pays, a seeded sample probes without a tree (its output stays plain seeded
    decoding's) and an unseeded one with a one-level tree; both keep the sampled estimates.
    Copy drafts are off: their own policy grafts them, and these trees are the model's probes."""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    policy = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=2)
    config = EngineConfig(3, 4, 16, max_batch=1, max_model_len=128, policy=policy, prompt_lookup=0)
    engine = Engine(target, ModelDrafter(draft), config)
    prompt = random_prompts(25, (9,))[0]
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
    seq = engine.add_request("0", prompt, params)
    drafted = []
    while engine.has_unfinished():
        engine.step()
        drafted.append(sum(engine.last_tree_sizes))
    assert any(drafted) == probe_trees
    assert engine.planner.coverage[False] != policy.initial(3, 4)
    assert engine.planner.coverage[True] == policy.initial(3, 4)
    if seed is not None:
        plain = LLM(str(tiny_llama), None, dtype="float32").generate([prompt], params)[0].outputs[0]
        assert seq.output_ids == plain.token_ids


def test_draft_cost_leaves_out_steps_that_caught_a_draft_cache_up(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A probe's draft forward re-reads all its sequence added since it last drafted: counted
    as cost per level, it made the draft look 3-5x as expensive and kept drafting off."""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    probing = AdaptivePolicy(min_speedup=100.0, probe_every=2, probe_every_max=2)
    for policy, measured in ((probing, False), (AdaptivePolicy(min_speedup=0.0), True)):
        engine = Engine(
            target, ModelDrafter(draft), EngineConfig(3, 2, 6, max_batch=2, max_model_len=96, policy=policy)
        )
        for i, prompt in enumerate(random_prompts(24, (30, 40))):  # sampled: greedy ones observe
            engine.add_request(
                str(i), prompt, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
            )
        while engine.has_unfinished():
            engine.step()
        assert engine.totals.draft_tokens > 0
        assert (engine.planner.costs.draft_per_level is not None) == measured


def test_the_token_budget_grows_only_where_the_measured_curve_is_flat() -> None:
    gpu = ForwardCost((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.6))
    cpu = ForwardCost((1, 2, 4, 8, 16, 32), (12.9, 14.0, 18.0, 23.3, 35.1, 59.2))
    assert gpu.nearly_free(0.25) == 64
    assert cpu.nearly_free(0.25) == 2
    assert ForwardCost().nearly_free(0.25) == 1
