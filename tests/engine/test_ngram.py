"""The model-free n-gram drafter: matching, tree building, and lossless output."""

from pathlib import Path

from multiguess import LLM, SamplingParams
from multiguess.engine.drafter import DraftRequest, TreeBudget
from multiguess.engine.ngram import NgramDrafter, find_continuations, trie

from tests.engine.test_lossless import random_prompts, reference


def test_longest_suffix_match_first_then_most_recent() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 5, 1, 2]
    # Suffix [1, 2] occurred at 0 (-> 3 9) and 4 (-> 4 7); [2] also at 8 (-> 3 5, same first as 3 9).
    assert find_continuations(tokens, depth=2, limit=3, max_ngram=3, min_ngram=1) == [[4, 7], [3, 9]]


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
