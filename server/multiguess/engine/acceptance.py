"""Acceptance rules: which drafted path the target agrees with, plus its own bonus token.

Both rules walk the tree from the root. Greedy follows the child equal to the target's argmax.
Sampling follows multi-draft speculative sampling (see ``accept_sampled``), which keeps the
output distribution exactly the target's whatever the draft proposed. A seeded sample draws
each token by an exponential race (the Gumbel-max trick) with noise fixed by its seed, the
token's position and the token (``SeededChoices``); that makes its output a function of the seed alone, so it is
verified like greedy output: token-identical to plain seeded decoding whatever tree was
drafted. A draft that perturbs its own distribution with the same noise proposes the target's
choice often (``sampling.race_top``).

``accepted_paths`` and ``accept_sampled_rows`` are the same rules for a whole batch of padded
trees at once, as tensor operations on the device: nothing is read back while they run, so a
step reads its outcome in one transfer (``engine/batch_acceptance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from multiguess.engine.sampling import NodeDistributions, RowSettings, draw, drawn_rows, processed_rows
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


def accepted_paths(
    tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_greedy`` for a batch of padded trees: ``tokens`` and ``parents`` ``[B, N]`` (a
    padding node has token -1; roots have parent -1), ``choice[b, i]`` the token the target
    takes after node i, ``depth`` at least the deepest tree's depth. Returns the accepted
    nodes ``[B, depth + 1]``, root first (entries past a row's length are 0), and the lengths
    ``[B]``; the tokens to emit are ``choice`` at those nodes.

    A node is accepted when it is the first child of its parent to equal the parent's choice
    and its parent is accepted; parents precede children, so the accepted nodes in index order
    are the path."""
    batch, width = tokens.shape
    up = parents.clamp(min=0)
    matches = tokens == choice.gather(1, up)
    matches[:, 0] = False
    earlier = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril_(-1)
    siblings = (parents[:, :, None] == parents[:, None, :]) & earlier
    first = matches & ~(siblings & matches[:, None, :]).any(dim=-1)
    accepted = torch.zeros_like(first)
    accepted[:, 0] = True
    for _ in range(depth):
        accepted = accepted | (first & accepted.gather(1, up))
    index = torch.arange(width, device=tokens.device).expand(batch, width)
    order = torch.where(accepted, index, index + width).sort(dim=-1).values[:, : depth + 1]
    lengths = accepted.sum(dim=-1)
    return torch.where(order < width, order, 0), lengths


def accept_sampled_rows(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    draft_rows: torch.Tensor | None,
    draft_index: torch.Tensor,
    settings: RowSettings,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_sampled`` for a batch of padded trees, on the device, exact in distribution.

    ``logits`` ``[B, N, V]``: each node's (adjusted) target logits, processed by ``settings``
    (one row per tree) as the walk reaches them; ``tokens`` ``[B, N]``; ``children``
    ``[B, N, K]``: each node's children in order, -1 past them; ``draft_rows`` ``[M, V]`` the
    distributions sampled children were drawn from and ``draft_index`` ``[B, N]`` the row of
    each node's (-1: its children are deterministic, q a point mass on each in turn);
    ``uniforms`` ``[B, levels, K + 1]``, independent U(0, 1), ``levels`` at least the deepest
    tree's depth + 1. Every tree walks one level per iteration, trying each child against the
    residual as ``accept_sampled`` does; a tree that stops draws its bonus from the residual.
    Returns the path ``[B, levels + 1]`` (root first, 0 past its length), the lengths ``[B]``
    and the bonus tokens ``[B]``."""
    batch = logits.shape[0]
    levels, tries = uniforms.shape[1], children.shape[2]
    rows = torch.arange(batch, device=logits.device)
    node = torch.zeros(batch, dtype=torch.long, device=logits.device)
    done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    path = torch.zeros(batch, levels + 1, dtype=torch.long, device=logits.device)
    lengths = torch.ones(batch, dtype=torch.long, device=logits.device)
    bonus = torch.zeros(batch, dtype=torch.long, device=logits.device)
    for level in range(levels):
        p = processed_rows(logits[rows, node], settings)
        which = draft_index[rows, node]
        sampled = which >= 0
        q = torch.zeros_like(p) if draft_rows is None else draft_rows[which.clamp(min=0)].double()
        chosen = torch.full_like(node, -1)
        stopped = done.clone()
        for rank in range(tries):
            child = children[rows, node, rank]
            trying = (child >= 0) & ~stopped & (chosen < 0)
            x = tokens[rows, child.clamp(min=0)].clamp(min=0)[:, None]
            point = torch.zeros_like(p).scatter_(1, x, 1.0)
            proposal = torch.where(sampled[:, None], q, point)
            qx, px = proposal.gather(1, x)[:, 0], p.gather(1, x)[:, 0]
            taken = trying & (qx > 0) & (uniforms[:, level, rank] * qx < px)
            chosen = torch.where(taken, child, chosen)
            rejected = trying & ~taken
            residual = (p - proposal).clamp(min=0.0)
            mass = residual.sum(dim=-1)
            drained = rejected & (mass <= 0)  # p == q up to rounding: rejection had probability ~0
            moved = rejected & ~drained
            p = torch.where(moved[:, None], residual / torch.where(moved, mass, 1.0)[:, None], p)
            left = q.scatter(1, x, 0.0)
            left_mass = left.sum(dim=-1)
            emptied = moved & sampled & (left_mass <= 0)
            renormalised = moved & sampled & ~emptied
            q = torch.where(
                renormalised[:, None], left / torch.where(renormalised, left_mass, 1.0)[:, None], q
            )
            stopped = stopped | drained | emptied
        ends = ~done & (chosen < 0)
        bonus = torch.where(ends, drawn_rows(p, uniforms[:, level, tries]), bonus)
        onward = ~done & (chosen >= 0)
        node = torch.where(onward, chosen, node)
        path[:, level + 1] = torch.where(onward, chosen, 0)
        lengths = lengths + onward.long()
        done = done | ends
    return path, lengths, bonus
