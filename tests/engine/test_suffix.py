"""Copy-source drafting (``engine/suffix.py``) and its policy: the pure parts, then the engine.

Lossless: whatever the copy index holds (the right continuation, a partly right one, a wrong
one), greedy and seeded outputs are those of plain decoding, for the suffix drafter alone and
for copy drafts grafted onto a draft model's trees.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import (
    CopyYield,
    ForwardCost,
    copies_may_widen,
    copy_width,
    graft_outcome,
    match_bucket,
)
from multiguess.engine.ngram import graft
from multiguess.engine.prediction import Alignment, prediction_draft, prediction_prospect
from multiguess.engine.sources import better_copy, copy_worth
from multiguess.engine.suffix import (
    CopySource,
    Match,
    OwnText,
    RecentOutputs,
    copy_tree,
    drafts_nodes,
    own_matches,
)
from multiguess.engine.tree import TokenTree

from tests.engine.test_lossless import random_prompts


def test_own_matches_measure_each_occurrence_longest_then_latest() -> None:
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3]
    found = own_matches(tokens)
    assert [(m.length, m.end) for m in found] == [(3, 2), (2, 6)]  # "1 2 3" at 0..2, "2 3" at 5..6
    assert found[0].continuation(3) == (9, 5, 2)
    assert own_matches([4, 5, 6]) == [] and own_matches([4]) == []
    assert [m.length for m in own_matches([7] * 10, max_match=4)] == [4] * 6 + [3, 2, 1]


def own(tokens: list[int]) -> OwnText:
    text = OwnText()
    text.sync(tokens)
    return text


def test_own_text_kept_as_it_grows_matches_as_measured_afresh() -> None:
    """Tokens taken in one at a time give the matches of the whole text at once, the
    vectorised walk back (``matching.match_lengths``) that the n-gram drafter shares."""
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, 5, 40)]
    output = [int(t) for t in rng.integers(0, 5, 150)]
    kept = OwnText(max_match=12)
    for size in range(len(output) + 1):
        kept.sync(prompt, output[:size])
        fresh = own_matches(prompt + output[:size], max_match=12, limit=1000)
        assert [(m.length, m.end) for m in kept.matches(1000)] == [(m.length, m.end) for m in fresh]
        for match in fresh:
            tokens = prompt + output[:size]
            length = 0
            while length < min(12, match.end + 1) and tokens[match.end - length] == tokens[-1 - length]:
                length += 1
            assert match.length == length


def test_recent_outputs_match_within_their_scope_only() -> None:
    recent = RecentOutputs()
    recent.add([10, 11, 12, 13, 14], scope="a")
    recent.add([20, 11, 12, 15], scope="b")
    found = recent.matches([99, 10, 11, 12], scope="a")
    assert [(m.length, m.continuation(2)) for m in found] == [(3, (13, 14))]
    assert [m.continuation(1) for m in recent.matches([11, 12], scope="b")] == [(15,)]
    assert recent.matches([11, 12], scope="c") == [] and recent.matches([12]) == []


def test_recent_outputs_drop_the_oldest_past_their_size_and_age() -> None:
    now = [0.0]
    recent = RecentOutputs(max_tokens=6, max_age=10.0, clock=lambda: now[0])
    recent.add([1, 2, 3])
    recent.add([4, 5, 6])
    assert len(recent) == 2 and recent.matches([1, 2])
    recent.add([7, 8])  # 8 tokens: the oldest goes
    assert len(recent) == 2 and recent.size == 5 and not recent.matches([1, 2]) and recent.matches([4, 5])
    now[0] = 11.0
    assert not recent.matches([4, 5]) and len(recent) == 0 and recent.size == 0
    assert recent._pairs == {}  # nothing of the dropped outputs is kept


def test_copy_tree_weighs_branches_by_how_often_they_were_seen() -> None:
    texts = [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 4), (0, 1, 5, 6)]
    matches = [Match(2, t, 1) for t in texts]
    draft = copy_tree(1, matches, depth=2, rate=0.9, max_nodes=8)
    assert draft.tree.tokens == (1, 2, 3, 5, 4, 6)
    assert draft.tree.parents == (-1, 0, 1, 0, 1, 3)
    assert draft.reach == pytest.approx((0.9 * 3 / 4, 0.81 / 2, 0.9 / 4, 0.81 / 4, 0.81 / 4))
    assert copy_tree(1, matches, 2, 0.9, max_nodes=2).tree.tokens == (1, 2, 3)
    assert copy_tree(1, matches, 2, 0.9, 8, min_share=0.5).tree.tokens == (1, 2, 3)


def test_copy_drafts_grow_as_deep_as_the_match_supports() -> None:
    source = CopySource()
    text = list(range(10, 70))
    short = source.draft(own([*text, 99, 10, 11]), depth=32, max_nodes=32)
    long = source.draft(own([*text, 99, *text[:20]]), depth=32, max_nodes=32)
    assert short is not None and short.match == 2 and short.tree.max_depth == 4
    assert long is not None and long.match == 20 and long.tree.tokens[1:] == tuple(text[20:52])
    assert source.draft(own([1, 2, 3]), depth=32, max_nodes=32) is None
    source.record([5, 6, 7, 8])
    recalled = source.draft(own([1, 5, 6]), depth=32, max_nodes=32)
    assert recalled is not None and recalled.tree.tokens == (6, 7, 8)


def test_graft_merges_along_the_trees_nodes_and_appends_the_rest() -> None:
    #     0            root 10
    #   1   2          11, 12
    #   3              13 under 11
    tree = TokenTree((10, 11, 12, 13), (-1, 0, 0, 1))
    copy = TokenTree((10, 11, 13, 14, 15, 12, 20), (-1, 0, 1, 2, 3, 0, 5))
    grafted, reach = graft(tree, copy, (0.9, 0.8, 0.7, 0.6, 0.5, 0.4), max_new=5)
    assert grafted.tokens[:4] == tree.tokens and grafted.parents[:4] == tree.parents  # indices kept
    assert grafted.tokens[4:] == (14, 15, 20) and grafted.parents[4:] == (3, 4, 2)
    assert reach == (0.7, 0.6, 0.4)
    capped, reach = graft(tree, copy, (0.9, 0.8, 0.7, 0.6, 0.5, 0.4), max_new=1)
    assert capped.tokens[4:] == (14,) and reach == (0.7,)
    assert graft(tree, TokenTree.chain([10, 11, 13]), (1.0, 1.0), max_new=5) == (tree, ())


def test_copy_width_widens_only_where_the_yield_pays_for_the_forward() -> None:
    flat, steep = ForwardCost(), ForwardCost((1, 64), (1.0, 64.0))
    sure, unsure = (0.95, 0.9, 0.85, 0.8), (0.1, 0.01)
    gentle = ForwardCost((1, 2, 4), (1.0, 1.2, 1.5))
    assert copy_width([1], [1.0], [sure], flat, 33) == 5
    assert copy_width([1], [1.0], [sure], steep, 33) == 1
    assert copy_width([1], [1.0], [unsure], gentle, 33) == 1
    assert copy_width([1], [1.0], [sure], gentle, 33) == 5
    assert copy_width([4, 1], [1.5, 1.0], [(), unsure], steep, 33) == 4  # the padding is free
    assert copy_width([1], [1.0], [sure], flat, 3) == 3  # within the limit
    # A drafted tree that loses to plain decoding is not widened to lose a little less.
    assert copy_width([7], [1.9], [sure], steep, 33) == 7


def test_copies_that_cannot_widen_never_widen_a_batch_of_root_only_trees() -> None:
    """``copies_may_widen`` lets the planner skip building drafts: it must be false only where
    ``copy_width`` would not widen a batch of root-only trees with the real drafts (random texts
    of few distinct tokens, so matches branch; some sequences with a prediction besides, of
    which the draft worth more is grafted, as the planner does; rates, batch sizes and cost
    curves vary, a noisy curve that dips included), and the cases must include both answers."""
    rng = np.random.default_rng(0)
    curves = [
        ForwardCost((1, 2, 4, 8, 16, 32), (3.3, 3.3, 3.6, 4.9, 8.0, 14.6)),
        ForwardCost((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.01, 1.02, 1.05, 1.1)),
        ForwardCost((1, 2, 4, 8, 16, 32), (3.0, 3.4, 3.2, 5.0, 4.8, 9.0)),
    ]
    seen = {True: 0, False: 0}
    for case in range(300):
        cost, batch, limit = curves[case % 3], int(rng.integers(1, 9)), int(rng.integers(2, 34))
        source = CopySource(yields=CopyYield(rates=list(rng.uniform(0.0, 1.0, size=8))))
        predicted = CopyYield(rates=list(rng.uniform(0.0, 1.0, size=8)))
        reach, drafts = [], []
        for _ in range(batch):
            tokens = [
                int(t) for t in rng.integers(0, int(rng.integers(2, 12)), size=int(rng.integers(2, 80)))
            ]
            text, room = own(tokens), int(rng.integers(0, 33))
            best = source.longest(text)
            draft = source.draft_from(int(text.tokens[-1]), best, room, limit - 1)
            assert (draft is not None and len(draft.tree) > 1) == (
                bool(best) and room > 0 and drafts_nodes(best)
            )
            made, shapes = [], []
            if draft is not None and len(draft.tree) > 1:
                made.append(draft)
                shapes.append(source.prospect(best, room))
            if rng.random() < 0.5:  # a prediction: the text again, its latest tokens edited
                alignment = Alignment(np.array(tokens[: int(rng.integers(2, len(tokens) + 1))]))
                alignment.sync(tokens[len(tokens) // 2 :])
                match = alignment.locate()
                chain = prediction_draft(int(text.tokens[-1]), match, min(room, limit - 1), predicted)
                if match is not None and chain is not None:
                    made.append(chain)
                    shapes.append(prediction_prospect(match, min(room, limit - 1), predicted))
            drafts.append(shapes)
            worths = [copy_worth(d.reach, cost, batch, limit) for d in made]
            chosen = better_copy(worths)
            reach.append(() if chosen is None else made[chosen].reach)
        may = copies_may_widen(drafts, cost, batch, limit)
        if not may:
            assert copy_width([1] * batch, [1.0] * batch, reach, cost, limit) == 1
        seen[may] += 1
    assert seen[True] > 20 and seen[False] > 20


def test_copy_yield_learns_by_match_length_and_relaxes_back() -> None:
    yields = CopyYield()
    assert [match_bucket(m) for m in (1, 2, 3, 4, 5, 9, 17, 33, 1000)] == [0, 1, 2, 2, 3, 4, 5, 6, 6]
    assert yields.rate(1) < yields.rate(4) < yields.rate(40)
    before = yields.rate(40)
    for _ in range(20):
        yields.observe(2, tried=3, accepted=0)
    assert yields.rate(2) < 0.01 and yields.rate(40) == before
    low = yields.rate(2)
    yields.relax(2)
    assert low < yields.rate(2) < CopyYield.prior(1)
    #   0 -> 1 (own) -> 2 (grafted) -> 3 (grafted); 0 -> 4 (grafted)
    tree = TokenTree((5, 6, 7, 8, 9), (-1, 0, 1, 2, 0))
    assert graft_outcome(tree, 2, [0, 1, 2, 3]) == (3, 2)  # tried at 0, 1 and 2; 3 is a leaf
    assert graft_outcome(tree, 2, [0, 1]) == (2, 0)
    assert graft_outcome(tree, 2, [0, 4]) == (1, 1)


PARAMS = {
    "greedy": SamplingParams(max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=3),
}


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> dict:
    """Plain decoding's outputs for each setting's prompts (some repeating themselves)."""
    prompts = [p * 3 for p in random_prompts(11, (5, 9, 17))] + random_prompts(12, (3, 30, 61))
    llm = LLM(str(tiny_llama), None, dtype="float32", max_batch=4)
    return {
        name: (prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, p)])
        for name, p in PARAMS.items()
    }


def corrupt(tokens: list[int], every: int) -> list[int]:
    return [4 + (t + 1) % 60 if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("setting", list(PARAMS))
@pytest.mark.parametrize("index", ["right", "partly", "wrong", "empty"])
@pytest.mark.parametrize("drafter", ["suffix", "model"])
def test_copy_drafts_are_lossless_whatever_the_index_holds(
    tiny_llama: Path, tiny_llama_draft: Path, plain: dict, setting: str, index: str, drafter: str
) -> None:
    """The recent-output index holds each prompt followed by its plain output (right), by an
    output with every fifth token changed (partly right), or by random text (wrong); outputs
    are plain decoding's token for token, batched (sequences joining and leaving) and one by
    one, and a right index is accepted for long stretches."""
    prompts, expected = plain[setting]
    llm = LLM(
        str(tiny_llama),
        str(tiny_llama_draft) if drafter == "model" else None,
        drafter=drafter,
        dtype="float32",
        max_batch=3,
    )
    held = {
        "right": expected,
        "partly": [corrupt(out, 5) for out in expected],
        "wrong": random_prompts(13, (40,) * len(prompts)),
        "empty": [],
    }[index]
    # every width costs alike: acceptance, not timing, is tested
    llm.engine.planner.forward_cost = ForwardCost()
    for prompt, out in zip(prompts, held, strict=False):
        llm.engine.planner.copies.record(prompt + out)
    outs = llm.generate(prompts, PARAMS[setting])
    assert [o.outputs[0].token_ids for o in outs] == expected
    totals = llm.engine.totals
    assert totals.copy_accepted_tokens > 0  # copies were verified (the prompts repeat themselves)
    if index == "right":
        assert totals.copy_accepted_tokens > 0.7 * sum(len(o) for o in expected)
        assert totals.mean_accepted_length > 4


def test_repeated_requests_copy_from_recent_outputs(tiny_llama: Path, plain: dict) -> None:
    """A request whose reply was given before drafts it from the recent outputs: the second
    time, almost every token is an accepted copy."""
    prompts, expected = plain["greedy"]
    llm = LLM(str(tiny_llama), None, drafter="suffix", dtype="float32", max_batch=1)
    # every width costs alike: acceptance, not timing, is tested
    llm.engine.planner.forward_cost = ForwardCost()
    prompt = prompts[-1]  # random: nothing of its reply repeats its prompt
    first = llm.generate(prompt, PARAMS["greedy"])[0]
    copied = llm.engine.totals.copy_accepted_tokens
    second = llm.generate(prompt, PARAMS["greedy"])[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected[-1]
    assert llm.engine.totals.copy_accepted_tokens - copied >= 0.8 * len(expected[-1])


def test_recent_outputs_steer_only_their_own_tenants_drafts(tiny_llama: Path, plain: dict) -> None:
    """A reply one tenant received joins the recent outputs under that tenant's scope only:
    another tenant's lookup (or a request salted apart) finds nothing of it, and the same
    tenant's repeat copies it; output is plain decoding's throughout."""
    prompts, expected = plain["greedy"]
    llm = LLM(str(tiny_llama), None, drafter="suffix", dtype="float32", max_batch=1)
    # every width costs alike: acceptance, not timing, is tested
    llm.engine.planner.forward_cost = ForwardCost()
    prompt, reply = prompts[-1], expected[-1]
    alice = replace(PARAMS["greedy"], tenant="alice")
    assert llm.generate(prompt, alice)[0].outputs[0].token_ids == reply
    recent = llm.engine.planner.copies.recent
    probe = [*prompt, *reply[:4]]
    assert recent.matches(probe, scope=alice.cache_scope)
    for other in (replace(alice, tenant="bob"), replace(alice, cache_salt="s"), PARAMS["greedy"]):
        assert recent.matches(probe, scope=other.cache_scope) == []
    before = llm.engine.totals.copy_accepted_tokens
    assert llm.generate(prompt, alice)[0].outputs[0].token_ids == reply
    assert llm.engine.totals.copy_accepted_tokens - before >= 0.8 * len(reply)


def test_copy_drafts_off_draft_nothing(tiny_llama: Path, plain: dict) -> None:
    prompts, expected = plain["greedy"]
    llm = LLM(str(tiny_llama), None, drafter="suffix", dtype="float32", max_batch=4, prompt_lookup=0)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS["greedy"])] == expected
    assert llm.engine.totals.draft_tokens == 0 and len(llm.engine.planner.copies.recent) == 0


def test_while_no_copy_can_pay_copies_are_checked_ever_more_rarely(tiny_llama: Path, plain: dict) -> None:
    """Where every width costs alike copies pay and are checked every step; where the forward's
    cost grows with every row none can, and a batch's check backs off (2, then 4 steps apart)
    until one finds a copy that may pay again, while a lone sequence checks every step; output
    stays plain decoding's."""
    prompts, expected = plain["greedy"]
    llm = LLM(str(tiny_llama), None, drafter="suffix", dtype="float32", max_batch=4)
    planner = llm.engine.planner
    checks: list[tuple[int, bool]] = []  # the steps whose copies were checked, and if idle
    idle = planner._copies_idle

    def recording(candidates: list, batch: int) -> bool:
        checks.append((planner.steps, idle(candidates, batch)))
        return checks[-1][1]

    def gaps() -> list[tuple[int, bool]]:
        return [(b - a, was_idle) for (a, was_idle), (b, _) in itertools.pairwise(checks)]

    planner._copies_idle = recording  # type: ignore[method-assign]
    steep = ForwardCost((1, 64), (1.0, 64.0))
    for cost in (ForwardCost(), steep, ForwardCost()):
        planner.forward_cost = cost
        outs = llm.generate(prompts[:4], PARAMS["greedy"])
        assert [o.outputs[0].token_ids for o in outs] == expected[:4]
    assert {gap for gap, was_idle in gaps() if not was_idle} == {1}
    assert {gap for gap, was_idle in gaps() if was_idle} == {2, 4}
    assert sum(was_idle for _, was_idle in gaps()) >= 4  # ...and the steep stretch backed off
    checks.clear()
    planner.forward_cost = steep
    assert llm.generate(prompts[0], PARAMS["greedy"])[0].outputs[0].token_ids == expected[0]
    assert {gap for gap, _ in gaps()} == {1} and all(was_idle for _, was_idle in checks)
