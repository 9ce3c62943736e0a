"""Acceptance rules: which drafted path the target agrees with, plus its own bonus token.

Both rules walk the tree from the root. Greedy follows the child equal to the target's argmax.
Sampling follows multi-draft speculative sampling (see ``accept_sampled``), which keeps the
output distribution exactly the target's whatever the draft proposed. A seeded sample draws
each token by an exponential race (the Gumbel-max trick) with noise fixed by its seed, the
token's position and the token (``SeededChoices``); that makes its output a function of the seed alone, so it is
verified like greedy output: token-identical to plain seeded decoding whatever tree was
drafted. A draft that perturbs its own distribution with the same noise proposes the target's
choice often (``sampling.race_top``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from multiguess.engine.sampling import NodeDistributions, draw
from multiguess.engine.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root first
    tokens: list[int]  # tokens to emit: the accepted drafted tokens, then the bonus token

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


class ByNode(Protocol):
    def __getitem__(self, node: int) -> int: ...


def accept_greedy(tree: TokenTree, target_argmax: ByNode) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent, plus a bonus
    (``target_argmax[i]``: the target's token after node i; read along the path only)."""
    children = tree.children()
    node, path = 0, [0]
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, [tree.tokens[i] for i in path[1:]] + [want])
        node = nxt
        path.append(node)


def accept_sampled(
    tree: TokenTree,
    target_probs: NodeDistributions,
    draft_probs: dict[int, torch.Tensor],
    generator: torch.Generator,
) -> Acceptance:
    """Multi-draft speculative sampling on a tree (SpecInfer / MCSD style); exact in distribution.

    ``target_probs[i]`` is the processed target distribution after node i. ``draft_probs[i]`` is
    the distribution node i's children were drawn from; a node missing there has deterministic
    children (top-k, n-gram), for which q is a point mass on each child in turn. At each node the children are
    tried in order: child token x is accepted with probability min(1, p(x) / q(x)); on rejection
    p becomes norm(max(p - q, 0)), and q is renormalised after removing the rejected token,
    because sampled siblings are drawn without replacement: the next child was drawn from what
    was left. If all children are rejected, the bonus token is drawn from the residual p; at a
    node without children, from its row as it is (``NodeDistributions.draw``, which a plain
    step's row never leaves).
    """
    children = tree.children()
    node, path = 0, [0]
    while True:
        if not children[node]:
            bonus = target_probs.draw(node, generator)
            return Acceptance(path, [tree.tokens[i] for i in path[1:]] + [bonus])
        p = target_probs[node].double()
        sampled_q = draft_probs.get(node)
        q = sampled_q.to(p.device, torch.float64, copy=True) if sampled_q is not None else None
        chosen = None
        for child in children[node]:
            x = tree.tokens[child]
            if sampled_q is None:  # a deterministic child: q is a point mass on x
                q = torch.zeros_like(p)
                q[x] = 1.0
            assert q is not None
            if (
                q[x] > 0
                and torch.rand((), generator=generator, dtype=torch.float64, device=p.device) * q[x] < p[x]
            ):
                chosen = child
                break
            residual = torch.clamp(p - q, min=0.0)
            if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
                break
            p = residual / residual.sum()
            if sampled_q is not None:
                q[x] = 0.0
                if q.sum() <= 0:
                    break
                q = q / q.sum()
        if chosen is None:
            bonus = draw(p, generator)
            return Acceptance(path, [tree.tokens[i] for i in path[1:]] + [bonus])
        node = chosen
        path.append(node)


class SeededChoices:
    """The token a seeded sample takes after each node of ``tree``, whose root is token
    ``length - 1`` of the sequence: node ``i`` chooses token ``length + depth(i)`` by the race
    under that position's noise. Each is computed when the walk reads it (one path)."""

    def __init__(self, target: NodeDistributions, tree: TokenTree, seed: int, length: int) -> None:
        self.target = target
        self.depths = tree.depths
        self.seed = seed
        self.length = length

    def __getitem__(self, node: int) -> int:
        return self.target.seeded_choice(node, self.seed, self.length + self.depths[node])
