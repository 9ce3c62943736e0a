"""Prefix reuse (engine/prefix_cache.py): the pure matching and planning, and the engine's
output with reuse, which must be the output without it, token for token (bit for bit on the
bf16 kernels), for target and draft, while the caches really are hit."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from multiguess import SamplingParams
from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.prefix_cache import PrefixIndex, Reuse, common_prefix, plan_reuse
from multiguess.engine.sequence import Sequence
from multiguess.models.eagle3_checkpoint import head_drafter
from multiguess.models.loading import load_model

from tests.engine.test_eagle3 import saved_head, small_vocab_target  # noqa: F401 (a fixture)

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


# -- the pure parts ---------------------------------------------------------------------------
def test_common_prefix_is_the_first_difference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        expected = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix(a, b) == common_prefix(tuple(b), a) == expected
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], (1, 2)) == 2


def test_the_index_keeps_swaps_and_names_the_oldest() -> None:
    index = PrefixIndex()
    index.keep(2, [1, 2, 3])
    index.keep(0, (4, 5))
    index.keep(1, [])  # keeps nothing
    assert index.kept(2) == (1, 2, 3) and index.kept(1) == ()
    assert index.oldest([0, 1, 2]) == 1  # an empty slot first
    assert index.oldest([0, 2]) == 2 and index.used_before(2, 0)
    index.swap(2, 3)
    assert index.kept(3) == (1, 2, 3) and index.kept(2) == () and index.oldest([0, 3]) == 3
    index.drop(3)
    assert index.kept(3) == () and index.oldest([]) is None


def test_the_plan_takes_the_longest_prefix_from_wherever_it_is() -> None:
    index = PrefixIndex()
    index.keep(2, [9, 9, 9])
    index.keep(3, [1, 2, 3, 4, 5])  # kept in another free slot: swapped in, keeping slot 2's
    assert plan_reuse([1, 2, 3, 7], 2, range(2, 5), {}, index) == Reuse(2, 3, swap_with=3)
    # its own slot's entry, in place; a whole prompt leaves its last token to compute
    assert plan_reuse([9, 9, 9], 2, range(2, 5), {0: (None, [9, 9])}, index) == Reuse(2, 2)
    # a running sequence's, copied: slot 2's entry moves to the empty slot 4 first
    plan = plan_reuse([5, 6, 7, 8], 2, range(2, 5), {0: (None, [5, 6, 7]), 1: (None, [5])}, index)
    assert plan == Reuse(2, 3, swap_with=4, copy_from=0) and plan.source == 0
    # nothing matches: slot 2's entry still moves out of the way
    assert plan_reuse([8], 2, range(2, 5), {}, index) == Reuse(2, 0, swap_with=4)
    # no empty slot: the least recently stored entry gives way, or is the one dropped
    index.keep(4, [6])
    assert plan_reuse([8, 8], 2, range(2, 5), {}, index) == Reuse(2, 0)  # slot 2's is the oldest
    index.keep(2, [9])
    assert plan_reuse([8, 8], 2, range(2, 5), {}, index) == Reuse(2, 0, swap_with=3)


def test_the_plan_reuses_only_prefixes_of_the_same_scope() -> None:
    alice, bob, salted = ("alice", None), ("bob", None), ("alice", "s1")
    index = PrefixIndex()
    index.keep(2, [1, 2, 3, 4], alice)
    index.keep(3, [1, 2, 3], bob)
    assert index.reusable(2, alice) == (1, 2, 3, 4) and index.reusable(2, bob) == ()
    prompt = [1, 2, 3, 4, 5]
    assert plan_reuse(prompt, 2, range(2, 5), {}, index, alice) == Reuse(2, 4)
    assert plan_reuse(prompt, 2, range(2, 5), {}, index, bob) == Reuse(2, 3, swap_with=3)
    # another scope's entry in the slot is no match, but is kept elsewhere all the same
    assert plan_reuse(prompt, 2, range(2, 5), {}, index, salted) == Reuse(2, 0, swap_with=4)
    running = {0: (salted, [1, 2, 3, 4, 5, 6]), 1: (bob, [1, 2, 3, 4, 5])}
    assert plan_reuse(prompt, 2, range(2, 5), running, index, salted) == Reuse(2, 4, swap_with=4, copy_from=0)
    assert plan_reuse(prompt, 2, range(2, 5), running, index, ("carol", None)).length == 0
    index.swap(2, 4)  # the scope travels with the entry
    assert index.reusable(4, alice) == (1, 2, 3, 4) and index.reusable(2, alice) == ()
    index.keep(4, [7], bob)  # and is replaced with it
    assert index.reusable(4, alice) == () and index.reusable(4, bob) == (7,)


# -- the engine ---------------------------------------------------------------------------------
def serve(engine: Engine, waves: list[list[list[int]]], params: SamplingParams = GREEDY) -> list[Sequence]:
    """Each wave's prompts added together, served until all finish, then the next wave."""
    return serve_each(engine, [[(p, params) for p in wave] for wave in waves])


def serve_each(engine: Engine, waves: list[list[tuple[list[int], SamplingParams]]]) -> list[Sequence]:
    """``serve`` with parameters of its own for each prompt."""
    seqs: list[Sequence] = []
    for wave in waves:
        added = [engine.add_request(f"{len(seqs)}-{i}", p, params) for i, (p, params) in enumerate(wave)]
        while engine.has_unfinished():
            engine.step()
        seqs += added
    return seqs


def shared_prompts(seed: int, system: int = 40) -> list[list[int]]:
    """Prompts after one system prompt: one served twice in a row, one followed by a strict
    prefix of itself, two more, and the system prompt's first half alone."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(4, 64, (system,), generator=g).tolist()
    p = [head + torch.randint(4, 64, (n,), generator=g).tolist() for n in (5, 9, 1, 13)]
    return [p[0], p[0], p[1], p[1][: system - 10], p[2], p[3], head[: system // 2]]


def waves_of(prompts: list[list[int]]) -> list[list[list[int]]]:
    """One at a time (reuse from kept slots), then batches (reuse from running sequences too)."""
    return [[p] for p in prompts] + [prompts[:4], prompts[2:]]


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tiny_llama_draft: Path) -> tuple:
    return load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")


def engine_for(target, drafter, caching: bool, shape: tuple[int, int] = (3, 3), **config) -> Engine:
    config = {"max_batch": 4, "max_model_len": 256, "adaptive": False} | config
    return Engine(target, drafter, EngineConfig(*shape, prefix_caching=caching, **config))


@pytest.mark.parametrize(("shape", "drafted"), [((3, 3), True), ((1, 4), True), ((3, 3), False)],
                         ids=["tree", "chain", "plain"])  # fmt: skip
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_output_with_reuse_is_the_output_without(
    pair: tuple, shape: tuple[int, int], drafted: bool, backend: str
) -> None:
    target, draft = pair
    drafter = ModelDrafter(draft) if drafted else None
    prompts = shared_prompts(1)
    plain = serve(engine_for(target, None, False, backend=backend), waves_of(prompts))
    seqs = serve(engine_for(target, drafter, True, shape, backend=backend), waves_of(prompts))
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    cached = [s.cached_tokens for s in seqs]
    assert cached[:2] == [0, len(prompts[1]) - 1]  # a prompt served again: all but its last token
    assert cached[3] == len(prompts[3]) - 1  # a strict prefix of the one before
    assert cached[2] >= 40 and cached[4] >= 30 and cached[5] >= 40 and cached[6] == 19
    assert sum(cached[7:]) > 0  # batches: from kept slots and from each other
    if drafted:
        assert sum(s.stats.accepted_tokens for s in seqs) > 0


def test_seeded_sampling_with_reuse_is_sampling_without(pair: tuple) -> None:
    target, draft = pair
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=7)
    prompts = shared_prompts(2)
    without = serve(engine_for(target, ModelDrafter(draft), False), waves_of(prompts), params)
    seqs = serve(engine_for(target, ModelDrafter(draft), True), waves_of(prompts), params)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in without]
    assert sum(s.cached_tokens for s in seqs) > 0


def test_scoped_reuse_shares_only_within_a_scope_and_output_is_plain(pair: tuple) -> None:
    """Tenants and cache salts (``SamplingParams.cache_scope``): a prompt another scope sent is
    computed afresh (``cached_tokens`` 0), the same scope reuses it, kept or running, and every
    output is the one plain decoding gives."""
    target, draft = pair
    prompt, other = shared_prompts(9)[0], shared_prompts(9)[2]
    alice, bob = replace(GREEDY, tenant="alice"), replace(GREEDY, tenant="bob")
    salted = replace(alice, cache_salt="s1")
    order = [alice, bob, salted, alice, bob, salted, replace(alice, cache_salt="s2"), GREEDY]
    waves = [[(prompt, params)] for params in order] + [[(other, bob), (other, GREEDY)]]
    plain = serve(engine_for(target, None, False), [[p for p, _ in wave] for wave in waves])
    engine = engine_for(target, ModelDrafter(draft), True, max_batch=8)
    seqs = serve_each(engine, waves)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    n = len(prompt) - 1
    assert [s.cached_tokens for s in seqs[:8]] == [0, 0, 0, n, n, n, 0, 0]
    assert seqs[8].cached_tokens >= 40 and seqs[9].cached_tokens >= 40  # each from its own scope's
    # a running sequence's KV is shared within its scope only
    carol = replace(GREEDY, tenant="carol", max_tokens=32)
    first = engine.add_request("carol-1", other, carol)
    for _ in range(3):
        engine.step()
    dave = engine.add_request("dave", other, replace(carol, tenant="dave"))
    again = engine.add_request("carol-2", other, carol)
    while engine.has_unfinished():
        engine.step()
    assert first.cached_tokens == dave.cached_tokens == 0 and again.cached_tokens == len(other) - 1
    assert first.output_ids == dave.output_ids == again.output_ids


def test_an_evicted_prefix_is_prefilled_again(pair: tuple) -> None:
    """Two free slots keep two prefixes: a third prompt evicts the least recently stored one.
    (Without prompt lookup, whose accepted runs would change which request retires first.)"""
    target, draft = pair
    a, b, c = shared_prompts(3), shared_prompts(4), shared_prompts(5)
    assert len({a[0][0], b[0][0], c[0][0]}) == 3  # three system prompts that share nothing
    waves = [[a[0], b[0]], [c[0]], [b[2]], [a[2]]]  # a retires first: b's entry is the newer
    runs = {
        c: serve(engine_for(target, ModelDrafter(draft), c, max_batch=2, prompt_lookup=0), waves)
        for c in (False, True)
    }
    assert [s.output_ids for s in runs[True]] == [s.output_ids for s in runs[False]]
    assert [s.cached_tokens for s in runs[True]] == [0, 0, 0, 40, 0]  # c evicted a's, b's stayed


def test_the_draft_reuses_its_cache_too(pair: tuple) -> None:
    """The draft is fed only what it has not cached: a prompt served again costs it a token or
    two, not the prompt, and drafts and acceptance are those of serving it afresh."""
    target, draft = pair
    prompt = shared_prompts(6)[0]
    first: dict[bool, int] = {}
    for caching in (False, True):
        engine = engine_for(target, ModelDrafter(draft), caching)
        serve(engine, [[prompt]])
        fed = count_fed(engine.drafter.runner)
        again = serve(engine, [[prompt]])[0]
        assert again.cached_tokens == (len(prompt) - 1 if caching else 0)
        first[caching] = fed[0]
    assert first[False] >= len(prompt) - 1 and first[True] <= 2


def count_fed(runner) -> list[int]:
    """The tokens of each chain the runner is fed from now on (level forwards not counted)."""
    fed: list[int] = []
    forward = runner.forward_trees

    def counting(slots, prefix_lens, trees, *args, **kwargs):
        fed.append(sum(len(t) for t in trees))
        return forward(slots, prefix_lens, trees, *args, **kwargs)

    runner.forward_trees = counting
    return fed


needs_kernel = pytest.mark.skipif(
    bf16_kernel.library() is None, reason="the bf16 kernels need AVX512-BF16 or AVX2, and a C compiler"
)


@needs_kernel
def test_bf16_kernels_reuse_bit_for_bit(gqa_pair: tuple[Path, Path]) -> None:
    """The kernels compute every row alone, so KV computed in a decode step, a verification or a
    longer prefill is the bits a prefill computes: with reuse every log-probability, draft and
    acceptance is the same as without. Copy drafts are off: what they draft follows the batch a
    sequence steps with, and a prompt found cached starts decoding a step before one whose
    last chunk rides along a verification."""
    target, draft = (load_model(str(p), "bfloat16") for p in gqa_pair)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = shared_prompts(7)
    runs = {
        c: serve(engine_for(target, ModelDrafter(draft), c, prompt_lookup=0), waves_of(prompts), params)
        for c in (False, True)
    }
    assert runs[True][0].logprobs and sum(s.cached_tokens for s in runs[True]) > 0
    for off, on in zip(runs[False], runs[True], strict=True):
        assert on.output_ids == off.output_ids
        assert [lp.logprob for lp in on.logprobs] == [lp.logprob for lp in off.logprobs]
        assert on.stats == off.stats


def test_eagle3_heads_reuse_their_cache(small_vocab_target: Path, tmp_path: Path) -> None:  # noqa: F811
    """The head keeps the positions fed with the target's features; the target recomputes the
    features from there on (at least the last prompt position's), and output is the plain one."""
    head = saved_head(small_vocab_target, tmp_path / "head", seed=21)
    target = load_model(str(small_vocab_target), "float32")
    g = torch.Generator().manual_seed(8)
    system = torch.randint(4, 8, (30,), generator=g).tolist()
    prompts = [system + torch.randint(4, 8, (n,), generator=g).tolist() for n in (3, 6, 1)]
    waves = waves_of([*prompts, prompts[0], prompts[1][:20]])  # reuse in [1:4]; 19 at most in [4]
    plain = serve(engine_for(target, None, False), waves)
    engine = engine_for(target, head_drafter(head, target), True)
    seqs = serve(engine, waves)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    cached = [s.cached_tokens for s in seqs]
    assert all(n >= 29 for n in cached[1:4]) and 0 < cached[4] < 19
    assert engine.totals.accepted_tokens > 0 and engine.totals.fallback_steps == 0
