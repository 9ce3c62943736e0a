"""The ``ngram`` drafter: continuations of earlier occurrences of the sequence's own suffix.

Prompt lookup: when the last few tokens appeared before (in the prompt or the output so far),
what followed them then is a cheap guess for what follows now. Summaries, code edits and
extraction repeat their input heavily, so this drafter costs microseconds and can still
accept several tokens per step. Different earlier occurrences give different continuations:
they become the branches of the tree (merged where they share a prefix).
"""

from __future__ import annotations

from multiguess.engine.drafter import DraftRequest, Proposal
from multiguess.engine.drafters.base import StatelessDrafter
from multiguess.engine.ngram import find_continuations, trie


class NgramDrafter(StatelessDrafter):
    """Stateless prompt-lookup drafter; children are deterministic (exact under sampling too)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = []
        for req in requests:
            budget = req.budget
            chains = find_continuations(
                req.token_ids, budget.depth, budget.num_candidates, self.max_ngram, self.min_ngram
            )
            if req.grammar is not None:  # structured output: each chain up to what the grammar allows
                chains = [c[: req.grammar.valid_prefix(c)] for c in chains]
            proposals.append(Proposal(trie(req.token_ids[-1], chains, budget.max_nodes)))
        return proposals
