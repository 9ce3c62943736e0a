"""The model-free n-gram drafter: matching, tree building, and lossless output."""

import random
from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, TreeBudget
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.drafters.ngram import NgramDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.ngram import find_continuations, trie
from multiguess.models.loading import load_model

from tests.engine.test_lossless import random_prompts, reference


def test_longest_suffix_match_first_then_most_recent() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 5, 1, 2]
    # Suffix [1, 2] occurred at 0 (-> 3 9) and 4 (-> 4 7); [2] also at 8 (-> 3 5, same first as 3 9).
    assert find_continuations(tokens, depth=2, limit=3, max_ngram=3, min_ngram=1) == [[4, 7], [3, 9]]


def brute_force_continuations(
    tokens: list[int], depth: int, limit: int, max_ngram: int, min_ngram: int
) -> list[list[int]]:
    """The specification, spelled out: every earlier window equal to the suffix, longest
    suffixes first, then the latest windows, skipping continuations whose first token was had."""
    found: list[list[int]] = []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            cont = tokens[start + n : start + n + depth]
            if tokens[start : start + n] == tokens[-n:] and cont and cont[0] not in {c[0] for c in found}:
                found.append(cont)
    return found[:limit]


def test_matching_agrees_with_the_brute_force_specification() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        longest = rng.randrange(1, 5)
        args = (rng.randrange(1, 6), rng.randrange(1, 4), longest, rng.randrange(1, longest + 1))
        assert find_continuations(tokens, *args) == brute_force_continuations(tokens, *args), (tokens, args)


def test_no_match_no_continuation() -> None:
    assert find_continuations([1, 2, 3, 4], depth=3, limit=2, max_ngram=3, min_ngram=1) == []


def test_trie_merges_shared_prefixes_and_respects_the_budget() -> None:
    tree = trie(0, [[5, 6, 7], [5, 8], [9]], max_nodes=10)
    assert tree.tokens == (0, 5, 6, 7, 8, 9)
    assert tree.parents == (-1, 0, 1, 2, 1, 0)
    assert len(trie(0, [[5, 6, 7], [5, 8], [9]], max_nodes=2)) == 3


def test_drafter_proposes_from_the_sequence() -> None:
    request = DraftRequest(0, [4, 5, 6, 7, 4, 5], TreeBudget(2, 3, 8))
    [proposal] = NgramDrafter().propose([request])
    assert proposal.tree.tokens == (5, 6, 7, 4)
    assert proposal.draft_probs == {}


def test_ngram_speculation_is_lossless_and_accepts_on_repetitive_text(tiny_llama: Path) -> None:
    llm = LLM(
        str(tiny_llama), None, drafter="ngram", dtype="float32", num_candidates=3, depth=5, adaptive=False
    )
    prompts = [p * 3 for p in random_prompts(4, (5, 12, 30))] + random_prompts(8, (1, 50))
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference(tiny_llama, prompts, 32, ignore_eos=True)
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("seed", [None, 7])
def test_grafted_lookup_is_lossless_and_accepted_on_repetitive_text(
    tiny_llama: Path, tiny_llama_draft: Path, seed: int | None
) -> None:
    """Greedy (and seeded) trees carry prompt lookup past the draft's depth: outputs stay
    those of plain decoding, and on repetitive text some accepted tokens are grafted ones;
    with lookup off, none are."""
    prompts = [p * 3 for p in random_prompts(4, (5, 12, 30))] + random_prompts(8, (1, 50))
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0 if seed is None else 0.3, seed=seed)
    plain = LLM(str(tiny_llama), None, dtype="float32", max_batch=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for lookup in (8, 0):
        llm = LLM(
            str(tiny_llama),
            str(tiny_llama_draft),
            2,
            2,
            dtype="float32",
            adaptive=False,
            prompt_lookup=lookup,
        )
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert (llm.engine.totals.copy_accepted_tokens > 0) == (lookup > 0)


def test_unseeded_sampled_trees_get_no_lookup(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """Exact sampling checks each child against the draft's distribution it was drawn from:
    a grafted node was not drawn from any, so sampled trees keep only the draft's nodes."""
    prompts = [p * 3 for p in random_prompts(4, (5, 12, 30))]
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), 2, 2, dtype="float32", adaptive=False)
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8))
    assert llm.engine.totals.copy_accepted_tokens == 0 and llm.engine.totals.accepted_tokens > 0


def test_grafts_widen_the_forward_only_where_the_widening_is_cheap(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A forward that costs a plain step more per node leaves grafts only the padding of the
    batch's widest tree (here none: one sequence); a flat one lets them widen it."""
    prompts = [p * 3 for p in random_prompts(4, (5, 12, 30))]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    looked_up = {}
    for name, cost in (("flat", ForwardCost()), ("steep", ForwardCost((1, 64), (1.0, 64.0)))):
        config = EngineConfig(2, 2, 16, max_batch=1, max_model_len=256, adaptive=False)
        engine = Engine(
            load_model(str(tiny_llama), dtype="float32"),
            ModelDrafter(load_model(str(tiny_llama_draft), dtype="float32")),
            config,
        )
        engine.planner.forward_cost = cost
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished():
            engine.step()
        looked_up[name] = engine.totals.copy_accepted_tokens
    assert looked_up["flat"] > 0 and looked_up["steep"] == 0
