"""A draft vocabulary: the draft scores only its own tokens, and output stays exact."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.errors import ModelLoadError
from multiguess.models.draft_vocab import FILE, load_draft_vocab, most_frequent, write_draft_vocab

from tests.engine.test_lossless import random_prompts, reference


def with_draft_vocab(draft: Path, token_ids: list[int]) -> Path:
    """A copy of ``draft`` that ships a draft vocabulary."""
    copy = draft.with_name(f"{draft.name}-vocab{len(token_ids)}")
    if not copy.exists():
        shutil.copytree(draft, copy)
        write_draft_vocab(copy, token_ids, "test")
    return copy


def test_most_frequent_ranks_by_count_then_id_and_returns_ids_sorted() -> None:
    counts = Counter({7: 5, 3: 9, 11: 5, 2: 1})
    assert most_frequent(counts, 2) == [3, 7]  # 3 (9), then 7 before 11 on the tie
    assert most_frequent(counts, 10) == [2, 3, 7, 11]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a draft vocabulary"),
        (json.dumps({"ids": [1]}), "not a draft vocabulary"),
        (json.dumps({"token_ids": []}), "non-empty list of integers"),
        (json.dumps({"token_ids": [1, "2"]}), "non-empty list of integers"),
        (json.dumps({"token_ids": [1, 1]}), "distinct and in [0, 10)"),
        (json.dumps({"token_ids": [3, 10]}), "distinct and in [0, 10)"),
    ],
)
def test_a_bad_vocabulary_file_is_a_clear_load_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / FILE).write_text(content)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_draft_vocab(str(tmp_path), vocab_size=10)


def test_loading_sorts_and_a_folder_without_one_scores_everything(tmp_path: Path) -> None:
    assert load_draft_vocab(str(tmp_path), vocab_size=10) is None
    write_draft_vocab(tmp_path, [5, 1, 3], "test")
    assert load_draft_vocab(str(tmp_path), vocab_size=10).tolist() == [1, 3, 5]


def proposed_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, set[int]]:
    """(outputs, every token the drafter proposed)."""
    drafter = llm.engine.drafter
    propose, seen = drafter.propose, set()

    def recording(requests: list) -> list:
        proposals = propose(requests)
        for proposal in proposals:
            seen.update(proposal.tree.tokens[1:])
        return proposals

    drafter.propose = recording
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], seen


def test_the_draft_proposes_only_its_vocabulary_and_output_stays_exact(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    vocab = list(range(0, 64, 2))
    draft = with_draft_vocab(tiny_llama_draft, vocab)
    prompts = random_prompts(31, (4, 11, 25))
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = reference(tiny_llama, prompts, 32, ignore_eos=True)
    for draft_vocab in (True, False):
        llm = LLM(str(tiny_llama), str(draft), 3, 4, dtype="float32", adaptive=False, draft_vocab=draft_vocab)
        outputs, seen = proposed_tokens(llm, prompts, params)
        assert outputs == expected
        # With it, only its tokens; without it (--full-draft-vocab), others too.
        assert (seen <= set(vocab)) == draft_vocab


def test_a_sampled_draft_over_its_vocabulary_keeps_zero_mass_outside(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """The distributions a sampled draft proposes from (which rejection sampling divides by)
    are zero outside its vocabulary and sum to one."""
    vocab = list(range(0, 64, 3))
    llm = LLM(str(tiny_llama), str(with_draft_vocab(tiny_llama_draft, vocab)), 3, 2, dtype="float32")
    drafter = llm.engine.drafter
    propose, dists = drafter.propose, []

    def recording(requests: list) -> list:
        proposals = propose(requests)
        dists.extend(q for p in proposals for q in p.draft_probs.values())
        return proposals

    drafter.propose = recording
    llm.generate(random_prompts(5, (9,)), SamplingParams(max_tokens=12, temperature=0.9, seed=1))
    outside = torch.ones(dists[0].shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert dists and all(float(q[outside].sum()) == 0.0 for q in dists)
    assert all(abs(float(q.sum()) - 1.0) < 1e-5 for q in dists)
