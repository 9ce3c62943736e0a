"""What passes between the engine and a drafter: a tree budget, a draft request, a proposal.

The drafters themselves (``engine/drafters/``) answer the calls of ``drafters/base.Drafter``:
``propose`` a tree per ``DraftRequest``, as a ``Proposal`` the target verifies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from multiguess.engine.grammar import GrammarState
from multiguess.engine.sampling import Generators, Processing
from multiguess.engine.tree import TokenTree


@dataclass(frozen=True)
class TreeBudget:
    """``num_candidates`` children per expanded node and beam width per level; ``depth`` levels;
    ``max_nodes`` drafted nodes at most (the root not counted)."""

    num_candidates: int = 3
    depth: int = 4
    max_nodes: int = 16

    def __post_init__(self) -> None:
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates must be at least 1, got {self.num_candidates}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {self.max_nodes}")

    @property
    def slack(self) -> int:
        """Cache room past a sequence's end for such a tree (and a drafter's level-by-level region)."""
        return max(self.max_nodes, self.num_candidates * self.depth) + 2


@dataclass
class DraftRequest:
    slot: int
    token_ids: list[int]  # the whole sequence; its last token is the tree's root
    budget: TreeBudget
    # Processes draft logits into the distribution children are *sampled* from; None means the
    # deterministic top-k children (greedy requests).
    sample: SampleSpec | None = None
    # Structured output: drafted children are only tokens the grammar allows at their parent.
    grammar: GrammarState | None = None


@dataclass
class SampleSpec:
    processing: Processing
    generators: Generators
    # A seeded request: its children win the draft's race under the noise its target draws with
    # (``acceptance.SeededChoices``), not independent draws.
    coupled: bool = False


@dataclass
class Proposal:
    tree: TokenTree
    # For sampled children: node index -> the distribution its children were drawn from.
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    # How many of the tree's first nodes the drafter drafted (None: all); the rest were
    # grafted on as copy drafts (``ngram.graft``), which say nothing of the drafter's coverage.
    drafted: int | None = None
    # The match length of the grafted copy draft (``engine/suffix.py``; 0: none), whose
    # outcome the copy policy measures by it.
    copy_match: int = 0
    predicted: bool = False  # the grafted nodes follow the request's prediction, not a copy

    @property
    def own_nodes(self) -> int:
        """The tree's first nodes, the root included, that the drafter drafted."""
        return len(self.tree) if self.drafted is None else self.drafted

    @property
    def drafted_depth(self) -> int:
        """The levels the drafter drafted (grafted nodes may reach deeper)."""
        return max(self.tree.depths[: self.own_nodes])

    def drafted_part(self, path: list[int]) -> tuple[TokenTree, list[int]]:
        """The tree of the drafter's own nodes and the part of ``path`` (root first) in it."""
        if self.drafted is None:  # nothing grafted: no copy on every step of every sequence
            return self.tree, path
        n = self.drafted
        own = TokenTree(self.tree.tokens[:n], self.tree.parents[:n])
        return own, list(itertools.takewhile(lambda node: node < n, path))
